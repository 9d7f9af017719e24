"""Trainer flags as Lightning's: min_steps with min_epochs and should_stop, limit_train_batches=0,
overfit_batches, max_time, benchmark, detect_anomaly, enable_autolog_hparams. Every expected value was
observed on Lightning 2.6.6 first with the same module and data (32 samples, batches of 8: 4 per epoch)."""

from __future__ import annotations

import logging
import os
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ember.callbacks import Callback, EarlyStopping, Timer
from tests.helpers.models import BoringModel, RecordingLogger, TrainOnlyModel, fast_trainer, regression_loader


class StopAt(Callback):
    """Sets ``should_stop`` once ``global_step`` reaches ``at``; records (epoch, batch_idx, global_step)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen: list[tuple[int, int, int]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append((trainer.current_epoch, batch_idx, trainer.global_step))
        if trainer.global_step == self.at:
            trainer.should_stop = True


def fit_stopping(at: int, **kwargs):
    stopper = StopAt(at)
    trainer = fast_trainer(callbacks=[stopper], **kwargs)
    trainer.fit(TrainOnlyModel(), regression_loader())
    return trainer, stopper


# ---------------------------------------------------------------------- min_steps / min_epochs / should_stop
@pytest.mark.parametrize(
    ("kwargs", "steps", "epochs", "last"),
    [
        # Lightning 2.6.6, should_stop set at global_step 2, max_epochs=5:
        ({}, 2, 1, (0, 1, 2)),  # stops at once
        ({"min_steps": 6}, 6, 2, (1, 1, 6)),  # mid-epoch, as soon as 6 steps are taken
        ({"min_steps": 7}, 7, 2, (1, 2, 7)),
        ({"min_steps": 3}, 4, 1, (0, 3, 4)),  # min_steps alone implies min_epochs=1
        ({"min_steps": 0}, 4, 1, (0, 3, 4)),
        ({"min_epochs": 2}, 8, 2, (1, 3, 8)),  # at the end of epoch 1
        ({"min_epochs": 2, "min_steps": 3}, 8, 2, (1, 3, 8)),
        ({"min_epochs": 1, "min_steps": 10}, 10, 3, (2, 1, 10)),
    ],
)
def test_should_stop_waits_for_min_epochs_and_min_steps(kwargs, steps, epochs, last):
    trainer, stopper = fit_stopping(2, max_epochs=5, **kwargs)
    assert (trainer.global_step, trainer.current_epoch, stopper.seen[-1]) == (steps, epochs, last)
    assert trainer.should_stop


@pytest.mark.parametrize(
    ("kwargs", "steps", "epochs"),
    [
        # Lightning 2.6.6, no stop requested: max_epochs and max_steps still win over the minimums.
        ({"max_epochs": 1, "min_steps": 10}, 4, 1),
        ({"max_epochs": 2, "min_epochs": 3}, 8, 2),
        ({"max_epochs": 5, "max_steps": 3, "min_steps": 6}, 3, 1),
    ],
)
def test_max_limits_win_over_the_minimums(kwargs, steps, epochs):
    trainer, _ = fit_stopping(99, **kwargs)
    assert (trainer.global_step, trainer.current_epoch, trainer.should_stop) == (steps, epochs, False)


def test_the_continue_message_is_logged_once(caplog):
    # Lightning 2.6.6 prints once: "Trainer was signaled to stop but the required `min_epochs=1` or
    # `min_steps=6` has not been met. Training will continue..."
    with caplog.at_level(logging.INFO, logger="ember.trainer.loops"):
        fit_stopping(2, max_epochs=5, min_steps=6)
    lines = [r.getMessage() for r in caplog.records if "signaled to stop" in r.getMessage()]
    assert lines == [
        "Trainer was signaled to stop but the required min_epochs=1 or min_steps=6 has not been met. "
        "Training will continue..."
    ]


@pytest.mark.parametrize(
    ("kwargs", "steps", "epochs", "stopped_epoch", "wait"),
    [
        # Lightning 2.6.6: EarlyStopping("v", patience=0) on a rising "v" stops after epoch 1; min_epochs=3 runs
        # epoch 2 whole; min_steps=10 stops at step 10, mid-epoch 2; EarlyStopping keeps counting meanwhile.
        ({}, 8, 2, 1, 1),
        ({"min_epochs": 3}, 12, 3, 2, 2),
        ({"min_steps": 10}, 10, 3, 2, 2),
    ],
)
def test_early_stopping_waits_for_min_epochs_and_min_steps(kwargs, steps, epochs, stopped_epoch, wait):
    class Rising(BoringModel):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("v", float(self.current_epoch))

    es = EarlyStopping("v", patience=0, mode="min")
    trainer = fast_trainer(callbacks=[es], max_epochs=10, num_sanity_val_steps=0, **kwargs)
    trainer.fit(Rising(), regression_loader(), regression_loader())
    assert (trainer.global_step, trainer.current_epoch, es.stopped_epoch, es.wait_count) == (
        steps,
        epochs,
        stopped_epoch,
        wait,
    )


class StopAtTrainStart(Callback):
    def on_train_start(self, trainer, module):
        trainer.should_stop = True


@pytest.mark.parametrize(
    ("kwargs", "steps", "epochs"),
    [
        ({}, 0, 0),
        ({"min_epochs": 1}, 4, 1),
        ({"min_steps": 1}, 4, 1),  # Lightning 2.6.6, max_epochs=3
    ],
)
def test_should_stop_before_the_first_epoch(kwargs, steps, epochs):
    trainer = fast_trainer(callbacks=[StopAtTrainStart()], max_epochs=3, **kwargs)
    trainer.fit(TrainOnlyModel(), regression_loader())
    assert (trainer.global_step, trainer.current_epoch) == (steps, epochs)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_min_steps_must_be_a_non_negative_int(value):
    # Lightning 2.6.6 accepts -1 and 1.5 silently; ember says what it takes.
    with pytest.raises(ValueError, match=r"min_steps must be a non-negative int or None"):
        fast_trainer(min_steps=value)


# ---------------------------------------------------------------------- limit_train_batches=0
class Hooks(Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_fit_start(self, trainer, module):
        self.calls.append("fit_start")

    def on_sanity_check_start(self, trainer, module):
        self.calls.append("sanity_start")

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self.calls.append("val_batch")

    def on_train_start(self, trainer, module):
        self.calls.append("train_start")

    def on_train_epoch_start(self, trainer, module):
        self.calls.append("train_epoch_start")

    def on_train_end(self, trainer, module):
        self.calls.append("train_end")

    def on_fit_end(self, trainer, module):
        self.calls.append("fit_end")


class Requests(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.requested: list[str] = []

    def train_dataloader(self):
        self.requested.append("train")
        return regression_loader()

    def val_dataloader(self):
        self.requested.append("val")
        return regression_loader()


@pytest.mark.parametrize(
    ("sanity", "calls", "requested"),
    [
        # Lightning 2.6.6: the sanity check runs, the train loader is never requested, no train hook runs.
        (2, ["fit_start", "sanity_start", "val_batch", "val_batch", "fit_end"], ["val"]),
        (0, ["fit_start", "fit_end"], []),
    ],
)
def test_limit_train_batches_zero_skips_training(sanity, calls, requested):
    hooks, module = Hooks(), Requests()
    trainer = fast_trainer(callbacks=[hooks], limit_train_batches=0, max_epochs=2, num_sanity_val_steps=sanity)
    trainer.fit(module)
    assert hooks.calls == calls
    assert module.requested == requested
    assert (trainer.global_step, trainer.current_epoch) == (0, 0)


@pytest.mark.parametrize("kwargs", [{"max_epochs": 0}, {"max_steps": 0, "max_epochs": 3}])
def test_nothing_to_train_runs_no_train_hook(kwargs):
    """Lightning 2.6.6: max_epochs=0 or max_steps=0 -> the sanity check runs and both loaders are requested,
    but neither on_train_start nor on_train_end."""
    hooks, module = Hooks(), Requests()
    fast_trainer(callbacks=[hooks], **kwargs).fit(module)
    assert hooks.calls == ["fit_start", "sanity_start", "val_batch", "val_batch", "fit_end"]
    assert module.requested == ["val", "train"]


# ---------------------------------------------------------------------- overfit_batches
class Seen(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.train_x: list[tuple[int, float]] = []
        self.val_batches = 0
        self.sanity_batches = 0

    def training_step(self, batch, batch_idx):
        self.train_x.append((self.current_epoch, round(float(batch[0][0, 0]), 3)))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        if self.trainer.sanity_checking:
            self.sanity_batches += 1
        else:
            self.val_batches += 1
        super().validation_step(batch, batch_idx)


@pytest.mark.parametrize(("overfit", "per_epoch"), [(2, 2), (0.5, 2), (1, 1)])
def test_overfit_batches_replaces_both_limits_and_turns_shuffling_off(overfit, per_epoch):
    """Lightning 2.6.6, max_epochs=2, shuffled loaders of 4 batches: limits become overfit_batches;
    training sees the first batches of the unshuffled data (x[0,0] = -1.126, -0.614) in both epochs;
    validation runs per_epoch batches per epoch, the sanity check min(2, per_epoch); both loaders warn."""
    data = regression_loader().dataset
    train, val = DataLoader(data, batch_size=8, shuffle=True), DataLoader(data, batch_size=8, shuffle=True)
    module = Seen()
    trainer = fast_trainer(overfit_batches=overfit, max_epochs=2)
    with pytest.warns(UserWarning) as record:
        trainer.fit(module, train, val)
    messages = [str(w.message) for w in record if "overfit" in str(w.message)]
    assert messages == [
        f"You requested to overfit but enabled {k} dataloader shuffling. We are turning off the {k} "
        "dataloader shuffling for you."
        for k in ("val", "train")
    ]  # Lightning 2.6.6's words
    assert trainer.limit_train_batches == trainer.limit_val_batches == overfit
    assert (trainer.num_training_batches, trainer.num_val_batches) == (per_epoch, [per_epoch])
    firsts = [-1.126, -0.614][:per_epoch]
    assert module.train_x == [(e, x) for e in (0, 1) for x in firsts]
    assert (module.sanity_batches, module.val_batches) == (min(2, per_epoch), 2 * per_epoch)


def test_overfit_batches_leaves_test_and_predict_limits_and_unshuffled_loaders_alone():
    trainer = fast_trainer(overfit_batches=2, limit_train_batches=3, limit_val_batches=1)
    assert (trainer.limit_train_batches, trainer.limit_val_batches) == (2, 2)  # Lightning 2.6.6: 2 2
    assert (trainer.limit_test_batches, trainer.limit_predict_batches) == (1.0, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(TrainOnlyModel(), regression_loader())
    assert trainer.global_step == 2


# ---------------------------------------------------------------------- max_time
def test_max_time_adds_a_step_timer_and_lifts_the_epoch_default():
    """Lightning 2.6.6: Trainer(max_time=...) adds Timer(duration, interval="step"); with no max_epochs /
    max_steps the fit has no epoch limit (max_epochs -1); an explicit max_epochs is kept."""
    trainer = fast_trainer(max_time={"seconds": 5}, max_epochs=None)
    timers = [c for c in trainer.callbacks if isinstance(c, Timer)]
    assert len(timers) == 1 and timers[0].duration.total_seconds() == 5 and timers[0].interval == "step"
    assert trainer.max_epochs == -1
    assert fast_trainer(max_time="00:00:00:05", max_epochs=3).max_epochs == 3
    assert fast_trainer(callbacks=[Timer(duration=7)], max_epochs=None).max_epochs == -1
    assert fast_trainer(max_epochs=None).max_epochs == 1000


def test_max_time_with_a_timer_in_the_callbacks_keeps_that_timer(caplog):
    # Lightning 2.6.6: "Ignoring `Trainer(max_time=...)`, callbacks list already contains a Timer."
    mine = Timer(duration=7)
    with caplog.at_level(logging.INFO, logger="ember.trainer.arguments"):
        trainer = fast_trainer(callbacks=[mine], max_time=5)
    assert [c for c in trainer.callbacks if isinstance(c, Timer)] == [mine]
    assert any("Ignoring Trainer(max_time=...)" in r.getMessage() for r in caplog.records)


def test_max_time_stops_training_mid_epoch():
    # Lightning 2.6.6 with max_time 1 s and 20 ms steps: 42 steps, stopped mid-epoch (epoch 11), after ~1.0 s.
    class Slow(TrainOnlyModel):
        def training_step(self, batch, batch_idx):
            time.sleep(0.02)
            return super().training_step(batch, batch_idx)

    trainer = fast_trainer(max_time={"seconds": 0.5}, max_epochs=None)
    start = time.monotonic()
    trainer.fit(Slow(), regression_loader())
    assert 0.5 <= time.monotonic() - start < 5
    assert trainer.should_stop and trainer.global_step >= 20


# ---------------------------------------------------------------------- backend flags, anomaly detection, hparams
def test_benchmark_sets_cudnn_benchmark_and_deterministic_turns_it_off(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    fast_trainer(benchmark=True)
    assert torch.backends.cudnn.benchmark is True
    fast_trainer()  # None leaves it as it is (Lightning 2.6.6 too)
    assert torch.backends.cudnn.benchmark is True
    try:
        fast_trainer(deterministic=True)  # benchmark defaults to False under deterministic=True
        assert torch.backends.cudnn.benchmark is False
        with pytest.warns(UserWarning, match=r"deterministic=True and benchmark=True"):
            fast_trainer(deterministic=True, benchmark=True)
    finally:
        torch.use_deterministic_algorithms(False)
    with pytest.raises(ValueError, match=r"benchmark must be True, False or None, got 'yes'"):
        fast_trainer(benchmark="yes")


def test_deterministic_sets_the_cublas_workspace_unless_already_set(monkeypatch):
    # cuBLAS is deterministic only with a fixed workspace; without it, a CUDA matmul under
    # deterministic=True raises. Lightning 2.6.6 sets ":4096:8"; a value the user set is kept here.
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        fast_trainer(deterministic=False)
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        fast_trainer(deterministic="warn")
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        fast_trainer(deterministic=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(False)


def test_detect_anomaly_runs_training_under_anomaly_detection():
    seen = []

    class Module(TrainOnlyModel):
        def training_step(self, batch, batch_idx):
            seen.append(torch.is_anomaly_enabled())
            return super().training_step(batch, batch_idx)

    fast_trainer(detect_anomaly=True, limit_train_batches=1).fit(Module(), regression_loader())
    fast_trainer(limit_train_batches=1).fit(Module(), regression_loader())
    assert seen == [True, False] and not torch.is_anomaly_enabled()


class HparamsLogger(RecordingLogger):
    def __init__(self) -> None:
        super().__init__()
        self.hparams: list[dict] = []

    def log_hyperparams(self, params):
        self.hparams.append(dict(params))


class WithHparams(TrainOnlyModel):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()


@pytest.mark.parametrize(("enabled", "expected"), [(True, [{"width": 3}]), (False, [])])
def test_enable_autolog_hparams(enabled, expected):
    lg = HparamsLogger()
    trainer = fast_trainer(logger=lg, enable_autolog_hparams=enabled, limit_train_batches=1, log_every_n_steps=1)
    trainer.fit(WithHparams(), regression_loader())
    assert lg.hparams == expected


# ---------------------------------------------------------------------- loop-side logging
class LogsStepAndEpoch(TrainOnlyModel):
    """Logs ``loss`` per step and ``ep`` (the batch index) per epoch: 56 samples in batches of 8, 7 per epoch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("loss", loss)
        self.log("ep", float(batch_idx), on_step=False, on_epoch=True)
        return loss


class StopAtTwo(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            trainer.should_stop = True


def fit_logging(**kwargs):
    lg = RecordingLogger()
    trainer = fast_trainer(logger=lg, **kwargs)
    trainer.fit(LogsStepAndEpoch(), regression_loader(n=56))
    return trainer, [(step, sorted(m)) for step, m in lg.records]


@pytest.mark.parametrize(
    ("kwargs", "records"),
    [
        # Lightning 2.6.6 (records as (step, keys)): with 7 batches and log_every_n_steps=50 the loggers get only
        # the epoch values; max_steps ending the fit writes nothing more; a should_stop set in on_train_batch_end
        # writes that step's values (Lightning logs every step once should_stop is set).
        ({"max_epochs": 2}, [(6, ["ep", "epoch"]), (13, ["ep", "epoch"])]),
        (
            {"max_epochs": 2, "log_every_n_steps": 5},
            [(4, ["epoch", "loss"]), (6, ["ep", "epoch"]), (9, ["epoch", "loss"]), (13, ["ep", "epoch"])],
        ),
        ({"max_epochs": 2, "max_steps": 3}, [(2, ["ep", "epoch"])]),
        ({"max_epochs": 2, "callbacks": [StopAtTwo()]}, [(1, ["epoch", "loss"]), (1, ["ep", "epoch"])]),
    ],
)
def test_what_reaches_the_loggers_when_a_fit_ends_before_log_every_n_steps(kwargs, records):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fewer-batches warning, tested below
        trainer, written = fit_logging(**kwargs)
    assert written == records


def test_logged_metrics_hold_the_last_step_values_even_when_no_write_was_due():
    """Lightning 2.6.6: after 2 epochs with log_every_n_steps=50, logged_metrics has 'loss' (the last step's
    value, never written to a logger) and 'ep'."""
    losses = []

    class Module(LogsStepAndEpoch):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            losses.append(loss.detach())
            return loss

    trainer = fast_trainer(logger=RecordingLogger(), max_epochs=2, log_every_n_steps=50)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), regression_loader(n=56))
    assert sorted(trainer.logged_metrics) == ["ep", "loss"]
    assert float(trainer.logged_metrics["loss"]) == pytest.approx(float(losses[-1]))


def test_fast_dev_run_fills_logged_metrics():
    # Lightning 2.6.6, fast_dev_run=2 (its loggers replaced by a dummy): logged_metrics holds the last step's 'loss'.
    losses = []

    class Module(LogsStepAndEpoch):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            losses.append(loss.detach())
            return loss

    trainer = fast_trainer(fast_dev_run=2, logger=RecordingLogger())
    trainer.fit(Module(), regression_loader(n=56))
    assert len(losses) == 2
    assert float(trainer.logged_metrics["loss"]) == pytest.approx(float(losses[-1]))


@pytest.mark.parametrize(
    ("kwargs", "warns"),
    [
        ({"logger": RecordingLogger}, True),
        ({"logger": RecordingLogger, "log_every_n_steps": 7}, False),
        ({"logger": False}, False),  # Lightning 2.6.6: only with a logger
    ],
)
def test_fewer_batches_than_log_every_n_steps_warns(kwargs, warns):
    """Lightning 2.6.6: "The number of training batches (7) is smaller than the logging interval
    Trainer(log_every_n_steps=50). Set a lower value for log_every_n_steps if you want to see logs for the
    training epoch." (a PossibleUserWarning, a UserWarning)."""
    if kwargs.get("logger") is RecordingLogger:
        kwargs = {**kwargs, "logger": RecordingLogger()}
    trainer = fast_trainer(**kwargs)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(LogsStepAndEpoch(), regression_loader(n=56))
    messages = [str(w.message) for w in record if "logging interval" in str(w.message)]
    expected = [
        "The number of training batches (7) is smaller than the logging interval "
        "Trainer(log_every_n_steps=50). Set a lower value for log_every_n_steps if you want to see logs for "
        "the training epoch."
    ]
    assert messages == (expected if warns else [])
