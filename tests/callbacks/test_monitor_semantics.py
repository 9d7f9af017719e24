"""EarlyStopping with ``min_epochs`` / ``min_steps``, and the monitors (LearningRateMonitor, Timer,
ModelSummary) as Lightning's.

Every expected value below was checked against Lightning 2.6.6 running the same module (4 training
batches per epoch) and the same callbacks.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, EarlyStopping


class Module(ember.TrainModule):
    """Logs ``val_loss`` = ``values[k]`` at the k-th validation (the last value repeats)."""

    def __init__(self, values: list[float] | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.values = values or [1.0]
        self.k = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.tensor(self.values[min(self.k, len(self.values) - 1)]))

    def on_validation_epoch_end(self) -> None:
        self.k += 1

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class EpochEnds(Callback):
    """(current_epoch, global_step, should_stop) at every training epoch end, before EarlyStopping's check."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, bool]] = []

    def on_train_epoch_end(self, trainer: ember.Trainer, module: ember.TrainModule) -> None:
        self.seen.append((trainer.current_epoch, trainer.global_step, trainer.should_stop))


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 2, generator=torch.Generator().manual_seed(0))), batch_size=2)


def trainer(callbacks: list[Callback], **kw: Any) -> ember.Trainer:
    kw.setdefault("max_epochs", 10)
    return ember.Trainer(callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, enable_checkpointing=False, **kw)


# ---------------------------------------------------------------------------------------------- EarlyStopping
@pytest.mark.parametrize(("min_epochs", "min_steps", "stopped_epoch", "wait", "epochs", "steps", "stop_seen"), [
    # val_loss never improves after the first check; patience=1 asks to stop at epoch 1.
    (0, 0, 1, 1, 2, 8, []),
    # min_epochs=5: training goes on to the end of epoch 4; every check asks again (stopped_epoch 4, wait 4)
    (5, 0, 4, 4, 5, 20, [2, 3, 4]),
    # min_steps=10: the stop is honoured mid-epoch, right after step 10 (epoch 2's second batch)
    (0, 10, 2, 2, 3, 10, [2]),
    (3, 3, 2, 2, 3, 12, [2]),
])
def test_early_stopping_waits_for_min_epochs_and_min_steps(min_epochs, min_steps, stopped_epoch, wait, epochs, steps,
                                                           stop_seen):
    # Lightning 2.6.6, same module: (min_epochs, min_steps) -> stopped_epoch, wait_count, current_epoch and
    # global_step after fit, and the epochs whose end saw should_stop already True.
    es, ends = EarlyStopping("val_loss", patience=1), EpochEnds()
    t = trainer([ends, es], min_epochs=min_epochs, min_steps=min_steps)
    t.fit(Module(), loader(), loader())
    assert (es.stopped_epoch, es.wait_count, t.current_epoch, t.global_step) == (stopped_epoch, wait, epochs, steps)
    assert t.should_stop is True
    assert [epoch for epoch, _, stop in ends.seen if stop] == stop_seen


def test_a_stop_asked_before_min_epochs_stands_even_if_the_metric_improves_later():
    # Lightning 2.6.6: val_loss 1, 2, .5, .4, ... patience=1, min_epochs=4: the stop asked at epoch 1 ends
    # training once min_epochs is met (4 epochs, 16 steps); stopped_epoch stays 1, wait_count 0, best 0.4.
    es = EarlyStopping("val_loss", patience=1)
    t = trainer([es], min_epochs=4)
    t.fit(Module([1, 2, .5, .4, .3, .2, .1]), loader(), loader())
    assert (es.stopped_epoch, es.wait_count, t.current_epoch, t.global_step) == (1, 0, 4, 16)
    assert isinstance(es.best_score, torch.Tensor) and es.best_score.item() == pytest.approx(0.4)


@pytest.mark.parametrize(("min_epochs", "min_steps", "stopped_epoch", "wait", "epochs", "steps"), [
    (0, 9, 2, 4, 3, 9),   # stops right after step 9, in epoch 2
    (2, 0, 1, 3, 2, 8),   # asked in epoch 0, honoured when epoch 1 ends; every later check asks again
])
def test_early_stopping_with_validation_twice_per_epoch(min_epochs, min_steps, stopped_epoch, wait, epochs, steps):
    # Lightning 2.6.6, val_check_interval=0.5 (checks after batches 2 and 4), val_loss rising every check.
    es = EarlyStopping("val_loss", patience=1)
    t = trainer([es], min_epochs=min_epochs, min_steps=min_steps, val_check_interval=0.5)
    t.fit(Module([float(v) for v in range(1, 30)]), loader(), loader())
    assert (es.stopped_epoch, es.wait_count, t.current_epoch, t.global_step) == (stopped_epoch, wait, epochs, steps)


def test_best_score_is_a_tensor_and_round_trips_through_the_state():
    es = EarlyStopping("val_loss", mode="max")
    assert isinstance(es.best_score, torch.Tensor) and es.best_score.item() == -float("inf")
    es.best_score = torch.tensor(0.25)
    state = es.state_dict()
    again = EarlyStopping("val_loss", mode="max")
    again.load_state_dict(state)
    assert again.best_score.item() == 0.25
