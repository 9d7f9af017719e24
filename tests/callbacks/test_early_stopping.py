"""EarlyStopping: stops at the right check (table-driven), NaN stops with a message, ranks agree."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import EarlyStopping
from ember.strategies.single import SingleDeviceStrategy

NAN, INF = math.nan, math.inf


class Scripted(ember.TrainModule):
    """Logs ``val/metric`` = values[k] at the k-th validation check (``train/metric`` per epoch without validation)."""

    def __init__(self, values: list[float], where: str = "val") -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.values = values
        self.where = where
        self.checks = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val/metric", self.values[min(self.checks, len(self.values) - 1)])

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.checks += 1

    def on_train_epoch_end(self):
        if self.where == "epoch_end":  # logged in the module's own hook: the callback must run after it
            self.log("train/metric", self.values[min(self.current_epoch, len(self.values) - 1)])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def run(values, es, validate=True, max_epochs=10, strategy="auto", **kw):
    ds = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    module = Scripted(values, where="val" if validate else "epoch_end")
    trainer = ember.Trainer(
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=1,
        callbacks=[es],
        strategy=strategy,
        **kw,
    )
    trainer.fit(module, DataLoader(ds, batch_size=2), DataLoader(ds, batch_size=4) if validate else None)
    return trainer, module


# (values per check, EarlyStopping kwargs, index of the check that stops (None: never), best score after)
CASES = {
    "min, patience 2": ([5, 4, 4, 4, 4, 4], dict(patience=2), 3, 4),
    "min, improving": ([9, 8, 7, 6, 5, 4, 3, 2, 1, 0], dict(patience=1), None, 0),
    "min_delta": ([5, 4.8, 4.6, 4.4, 4.2, 4.0], dict(patience=2, min_delta=0.5), 2, 5),
    "min_delta reached": ([5, 4.4, 4.3, 3.8, 3.7, 3.6], dict(patience=2, min_delta=0.5), 5, 3.8),
    "max mode": ([1, 2, 3, 3, 3], dict(patience=1, mode="max"), 3, 3),
    "max equal is no improvement": ([1, 1, 1], dict(patience=2, mode="max"), 2, 1),
    "patience 0": ([3, 2, 2], dict(patience=0), 2, 2),
    "stopping threshold": ([5, 3, 1.5, 1, 0.5], dict(patience=10, stopping_threshold=2.0), 2, 3),
    "divergence threshold": ([5, 4, 12, 3], dict(patience=10, divergence_threshold=10.0), 2, 4),
    "max divergence": ([0.5, 0.6, 0.05], dict(patience=10, mode="max", divergence_threshold=0.1), 2, 0.6),
    "nan": ([5, 4, NAN, 3], dict(patience=10), 2, 4),
    "inf": ([5, INF, 3], dict(patience=10), 1, 5),
    "nan not checked": ([5, NAN, 4, 3], dict(patience=2, check_finite=False), None, 3),
}


@pytest.mark.parametrize("values, kwargs, stop_at, best", CASES.values(), ids=CASES.keys())
def test_stops_at_the_right_validation_check(values, kwargs, stop_at, best):
    es = EarlyStopping(monitor="val/metric", **kwargs)
    max_epochs = len(values) if stop_at is None else 10
    trainer, module = run(values, es, max_epochs=max_epochs)
    if stop_at is None:
        assert not trainer.should_stop and module.checks == len(values) and es.stopped_epoch == 0
    else:
        assert trainer.should_stop and module.checks == stop_at + 1
        assert es.stopped_epoch == stop_at and trainer.current_epoch == stop_at + 1
        assert es.stopping_reason and "'val/metric'" in es.stopping_reason
    assert es.best_score == pytest.approx(best)


def test_patience_counts_validation_checks_not_epochs():
    es = EarlyStopping(monitor="val/metric", patience=3)
    trainer, module = run([5, 5, 5, 5, 5, 5], es, val_check_interval=0.5)  # two checks per epoch
    assert module.checks == 4 and es.stopped_epoch == 1
    assert trainer.global_step == 8  # stopped right after the fourth check, at the end of epoch 1


def test_checks_at_train_epoch_end_after_the_modules_hook_without_validation():
    es = EarlyStopping(monitor="train/metric", patience=1)
    trainer, _ = run([3, 2, 2, 2], es, validate=False)
    assert es.stopped_epoch == 2 and trainer.current_epoch == 3


def test_nan_stops_with_a_message_naming_metric_and_step(caplog):
    es = EarlyStopping(monitor="val/metric", patience=10)
    with caplog.at_level(logging.WARNING, logger="ember.callbacks.early_stopping"):
        trainer, _ = run([5, 4, NAN], es)
    assert trainer.current_epoch == 3 and es.stopped_step == trainer.global_step == 12
    message = es.stopping_reason
    assert "'val/metric' = nan is not finite" in message
    assert "epoch 2" in message and "global step 12" in message and "Best value so far: 4" in message
    assert [r.getMessage() for r in caplog.records] == [message]


def test_verbose_logs_improvements(caplog):
    with caplog.at_level(logging.INFO, logger="ember.callbacks.early_stopping"):
        run([5, 4, 4], EarlyStopping(monitor="val/metric", patience=1, verbose=True))
    messages = [r.getMessage() for r in caplog.records]
    assert "improved to 5" in messages[0] and "improved (by 1) to 4" in messages[1]
    assert "did not improve on 4 for 1 checks (patience 1)" in messages[2]


def test_missing_metric_strict_and_not_strict():
    with pytest.raises(RuntimeError, match=r"could not find the monitored metric 'val/acc'.*val/metric"):
        run([1.0], EarlyStopping(monitor="val/acc"))
    with pytest.warns(RuntimeWarning, match="skipping the check"):
        trainer, _ = run([1.0], EarlyStopping(monitor="val/acc", strict=False), max_epochs=3)
    assert not trainer.should_stop and trainer.current_epoch == 3


class _AnotherRankStops(SingleDeviceStrategy):
    """Answers the cross-rank vote as if another process had voted to stop."""

    def __init__(self) -> None:
        super().__init__()
        self.votes: list[tuple[bool, bool]] = []

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        self.votes.append((decision, all))
        return len(self.votes) >= 2


def test_decision_is_agreed_across_ranks():
    strategy = _AnotherRankStops()
    es = EarlyStopping(monitor="val/metric", patience=10)
    trainer, _ = run([5, 4, 3, 2, 1], es, strategy=strategy)
    assert strategy.votes == [(False, False), (False, False)]  # any rank stopping stops everyone
    assert trainer.current_epoch == 2 and es.stopped_epoch == 1 and "another process" in es.stopping_reason


def test_validate_alone_does_not_check():
    es = EarlyStopping(monitor="val/metric", patience=0)
    trainer, module = run([5, 6, 7], es, max_epochs=1)
    trainer.validate(module, DataLoader(TensorDataset(torch.randn(4, 2), torch.randn(4, 1)), batch_size=2))
    assert es.wait_count == 0 and es.best_score == 5


def test_state_dict_round_trip_and_argument_checks():
    es = EarlyStopping(monitor="val/metric", mode="max", patience=4)
    es.wait_count, es.best_score, es.stopped_epoch = 2, 0.9, 0
    other = EarlyStopping(monitor="val/metric", mode="max")
    other.load_state_dict(es.state_dict())
    assert (other.wait_count, other.best_score, other.patience) == (2, 0.9, 4)
    assert es.state_key != EarlyStopping(monitor="val/loss").state_key
    cases = [(dict(mode="avg"), "mode"), (dict(patience=-1), "patience"), (dict(min_delta=-0.1), "min_delta")]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            EarlyStopping(monitor="x", **bad)
    with pytest.raises(ValueError, match="monitor"):
        EarlyStopping(monitor="")
