"""Trainer arguments that decide how long a fit runs and what it runs: max/min epochs and steps,
should_stop, accumulate_grad_batches, validation cadence, limit_*_batches, overfit_batches,
num_sanity_val_steps, fast_dev_run, max_time. One test (or a few) per argument: what it changes in a
real fit. Where a comment says "Lightning 2.6.6", the expected value was observed on Lightning first
with the same module and data (32 samples, batches of 8: 4 per epoch).
"""

from __future__ import annotations

import logging
import time
import warnings

import pytest
from torch.utils.data import DataLoader

import ember
from ember.callbacks import Callback, EarlyStopping, Timer
from ember.trainer.loops import settle_epoch_limits
from tests.helpers.models import (
    BatchCounter,
    BoringModel,
    RecordingCallback,
    RecordingLogger,
    TrainOnlyModel,
    UnsizedBatches,
    fast_trainer,
    regression_loader,
)


def fit(n_train: int = 32, n_val: int = 32, batch_size: int = 8, module=None, **kwargs):
    counter = BatchCounter()
    kwargs.setdefault("num_sanity_val_steps", 0)
    trainer = fast_trainer(callbacks=[counter, *kwargs.pop("callbacks", [])], **kwargs)
    val = regression_loader(n=n_val, batch_size=batch_size) if n_val else None
    trainer.fit(module or BoringModel(), regression_loader(n=n_train, batch_size=batch_size), val)
    return trainer, counter


class StopAt(Callback):
    """Sets ``trainer.should_stop`` at a given (epoch, batch_idx), or at the end of an epoch."""

    def __init__(self, epoch: int, batch_idx: int | None = None) -> None:
        self.epoch, self.batch_idx = epoch, batch_idx

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.batch_idx is not None and (trainer.current_epoch, batch_idx) == (self.epoch, self.batch_idx):
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer, module):
        if self.batch_idx is None and trainer.current_epoch == self.epoch:
            trainer.should_stop = True


# ---------------------------------------------------------------------- max_epochs / max_steps / min_epochs
def test_max_epochs_runs_that_many_full_epochs():
    trainer, c = fit(max_epochs=3, n_val=0)
    assert trainer.current_epoch == 3
    assert trainer.global_step == 12
    assert c.train == [(e, b) for e in range(3) for b in range(4)]


def test_max_epochs_zero_trains_nothing():
    trainer, c = fit(max_epochs=0, n_val=0)
    assert c.train == [] and trainer.global_step == 0


def test_max_epochs_defaults():
    # As Lightning: an unset max_epochs reads None until a fit sets it: 1000, or -1 beside max_steps
    # (tests/trainer/test_trainer_lightning_members.py follows the 1000 through a fit).
    assert fast_trainer(max_epochs=None).max_epochs is None
    stepped = fast_trainer(max_epochs=None, max_steps=5)
    assert stepped.max_epochs is None
    stepped.fit(BoringModel(), regression_loader())
    assert stepped.max_epochs == -1 and stepped.global_step == 5


def test_max_steps_stops_mid_epoch():
    trainer, c = fit(max_epochs=10, max_steps=6, n_val=0)
    assert trainer.global_step == 6
    assert c.train == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]


def test_max_epochs_minus_one_means_no_epoch_limit():
    trainer, c = fit(max_epochs=-1, max_steps=10, n_val=0)
    assert trainer.global_step == 10
    assert len(c.train) == 10 and c.train[-1] == (2, 1)


def test_max_steps_counts_optimizer_steps_with_accumulation():
    trainer, c = fit(max_epochs=10, max_steps=3, accumulate_grad_batches=2, n_val=0)
    assert trainer.global_step == 3
    assert len(c.train) == 6


def test_should_stop_from_a_callback_stops_training():
    trainer, c = fit(max_epochs=5, n_val=0, callbacks=[StopAt(0, batch_idx=1)])
    assert c.train == [(0, 0), (0, 1)]
    assert trainer.should_stop


def test_min_epochs_trains_full_epochs_despite_an_early_should_stop():
    # should_stop is set on the second batch of epoch 0; min_epochs=3 means three *complete* epochs.
    trainer, c = fit(max_epochs=10, min_epochs=3, n_val=0, callbacks=[StopAt(0, batch_idx=1)])
    assert c.train == [(e, b) for e in range(3) for b in range(4)]
    assert trainer.current_epoch == 3


def test_min_epochs_with_should_stop_at_epoch_end():
    trainer, c = fit(max_epochs=10, min_epochs=2, n_val=0, callbacks=[StopAt(0)])
    assert trainer.current_epoch == 2 and len(c.train) == 8
    trainer, c = fit(max_epochs=10, min_epochs=2, n_val=0, callbacks=[StopAt(3)])
    assert trainer.current_epoch == 4 and len(c.train) == 16


class StopAtStep(Callback):
    """Sets ``should_stop`` once ``global_step`` reaches ``at``; records (epoch, batch_idx, global_step)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen: list[tuple[int, int, int]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append((trainer.current_epoch, batch_idx, trainer.global_step))
        if trainer.global_step == self.at:
            trainer.should_stop = True


def fit_stopping(at: int, **kwargs):
    stopper = StopAtStep(at)
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


# ---------------------------------------------------------------------- accumulate_grad_batches
@pytest.mark.parametrize("k,steps", [(1, 4), (2, 2), (3, 2), (4, 1), (8, 1)])
def test_accumulate_grad_batches_global_step(k, steps):
    trainer, c = fit(accumulate_grad_batches=k, n_val=0)
    assert len(c.train) == 4
    assert trainer.global_step == steps


# ---------------------------------------------------------------------- validation cadence
@pytest.mark.parametrize(
    "interval,expected",
    [
        (1.0, [(0, 8), (1, 8)]),
        (0.5, [(0, 4), (0, 8), (1, 4), (1, 8)]),
        (0.25, [(0, 2), (0, 4), (0, 6), (0, 8), (1, 2), (1, 4), (1, 6), (1, 8)]),
        (3, [(0, 3), (0, 6), (1, 3), (1, 6)]),
        (8, [(0, 8), (1, 8)]),
    ],
)
def test_val_check_interval(interval, expected):
    _, c = fit(n_train=64, max_epochs=2, val_check_interval=interval, limit_val_batches=1)
    assert c.val_runs == expected
    assert c.val_batches == len(expected)


def test_val_check_interval_int_across_epochs_with_check_val_every_n_epoch_none():
    # 4 batches per epoch, validation every 5 batches counted across epochs: after batch 5 and batch 10.
    _, c = fit(max_epochs=3, val_check_interval=5, check_val_every_n_epoch=None, limit_val_batches=1)
    assert c.val_runs == [(1, 1), (2, 2)]


def test_val_check_interval_larger_than_the_epoch_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"val_check_interval=10 is larger than the 4 training batches.*"
        r"check_val_every_n_epoch=None",
    ):
        fit(val_check_interval=10)


@pytest.mark.parametrize("bad", [0, -1, 0.0, 1.5, True, "half"])
def test_val_check_interval_bad_values(bad):
    with pytest.raises(ValueError, match="val_check_interval"):
        fast_trainer(val_check_interval=bad)


def test_check_val_every_n_epoch():
    _, c = fit(max_epochs=5, check_val_every_n_epoch=2, limit_val_batches=1)
    assert [e for e, _ in c.val_runs] == [1, 3]


@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_check_val_every_n_epoch_bad_values(bad):
    with pytest.raises(ValueError, match="check_val_every_n_epoch must be a positive int or None"):
        fast_trainer(check_val_every_n_epoch=bad)


# ---------------------------------------------------------------------- limit_*_batches
@pytest.mark.parametrize("limit,expected", [(0.5, 4), (0.25, 2), (0.01, 1), (1.0, 8), (3, 3), (100, 8)])
def test_limit_train_batches(limit, expected):
    _, c = fit(n_train=64, n_val=0, limit_train_batches=limit)
    assert len(c.train) == expected


@pytest.mark.parametrize("limit,expected", [(0.5, 2), (1, 1), (0, 0), (0.0, 0)])
def test_limit_val_batches(limit, expected):
    _, c = fit(limit_val_batches=limit)
    assert c.val_batches == expected


@pytest.mark.parametrize("limit,expected", [(0.5, 2), (3, 3), (1.0, 4)])
def test_limit_test_and_predict_batches(limit, expected):
    counter = BatchCounter()
    trainer = fast_trainer(callbacks=[counter], limit_test_batches=limit, limit_predict_batches=limit)
    trainer.test(BoringModel(), regression_loader())
    out = trainer.predict(BoringModel(), regression_loader())
    assert counter.test_batches == expected
    assert counter.predict_batches == expected == len(out)


def test_int_limit_larger_than_a_stream_without_length():
    # The stream has 5 batches, the limit allows 10: the epoch still ends (and validates, and closes its
    # accumulation window) when the stream runs out.
    counter = BatchCounter()
    trainer = fast_trainer(
        callbacks=[counter], max_epochs=2, accumulate_grad_batches=2, limit_train_batches=10, num_sanity_val_steps=0
    )
    trainer.fit(BoringModel(), UnsizedBatches(n=40), regression_loader(n=8))
    assert len(counter.train) == 10
    assert trainer.global_step == 6  # windows of 2, 2 and 1 in each epoch
    assert counter.val_runs == [(0, 5), (1, 5)]


def test_int_limit_shorter_than_a_stream_without_length():
    counter = BatchCounter()
    trainer = fast_trainer(callbacks=[counter], max_epochs=2, limit_train_batches=3, num_sanity_val_steps=0)
    trainer.fit(BoringModel(), UnsizedBatches(n=40), regression_loader(n=8))
    assert counter.train == [(e, b) for e in range(2) for b in range(3)]
    assert counter.val_runs == [(0, 3), (1, 3)]


@pytest.mark.parametrize("bad", [-1, 1.5, "all", True])
def test_limit_bad_values(bad):
    with pytest.raises(ValueError, match=r"limit_train_batches.*(fraction|int)"):
        fast_trainer(limit_train_batches=bad)


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


# ---------------------------------------------------------------------- num_sanity_val_steps
@pytest.mark.parametrize("steps,expected", [(0, 0), (1, 1), (2, 2), (-1, 4), (10, 4)])
def test_num_sanity_val_steps(steps, expected):
    _, c = fit(num_sanity_val_steps=steps, limit_val_batches=1.0)
    assert c.sanity_batches == expected
    assert c.val_batches == 4  # the real validation is not affected


def test_no_sanity_check_without_validation_batches():
    calls: list[str] = []
    trainer = fast_trainer(callbacks=[RecordingCallback(calls)], limit_val_batches=0, num_sanity_val_steps=2)
    trainer.fit(BoringModel(), regression_loader(), regression_loader())
    assert not [c for c in calls if "sanity" in c or "validation" in c]


def test_sanity_check_metrics_are_thrown_away():
    seen = {}

    class Peek(Callback):
        def on_sanity_check_end(self, trainer, module):
            seen.update(trainer.callback_metrics)

    trainer = fast_trainer(num_sanity_val_steps=1, max_epochs=0, callbacks=[Peek()])
    trainer.fit(BoringModel(), regression_loader(), regression_loader())
    assert "val_loss" not in seen
    assert "val_loss" not in trainer.callback_metrics


def test_num_sanity_val_steps_bad_value():
    with pytest.raises(ValueError, match="num_sanity_val_steps must be an int >= -1"):
        fast_trainer(num_sanity_val_steps=-2)


# ---------------------------------------------------------------------- fast_dev_run
def test_fast_dev_run_true_runs_one_batch_of_each_without_loggers():
    logger = RecordingLogger()
    counter = BatchCounter()
    trainer = ember.Trainer(
        fast_dev_run=True,
        logger=logger,
        callbacks=[counter],
        enable_progress_bar=False,
        max_epochs=10,
        num_sanity_val_steps=2,
    )
    # As Lightning: the loggers given are replaced by one DummyLogger, which writes nothing.
    assert [type(lg).__name__ for lg in trainer.loggers] == ["DummyLogger"] and logger not in trainer.callbacks
    trainer.fit(BoringModel(), regression_loader(), regression_loader())
    assert counter.train == [(0, 0)]
    assert counter.sanity_batches == 0 and counter.val_batches == 1
    assert trainer.global_step == 1
    trainer.test(BoringModel(), regression_loader())
    assert counter.test_batches == 1
    assert logger.records == []


def test_fast_dev_run_int_runs_n_batches():
    counter = BatchCounter()
    trainer = ember.Trainer(fast_dev_run=3, callbacks=[counter], enable_progress_bar=False)
    trainer.fit(BoringModel(), regression_loader(n=64), regression_loader(n=64))
    assert counter.train == [(0, 0), (0, 1), (0, 2)]
    assert counter.val_batches == 3
    assert trainer.current_epoch == 1


@pytest.mark.parametrize("bad", [-1, "yes", 1.5, None])
def test_fast_dev_run_bad_values(bad):
    with pytest.raises(ValueError, match=rf"fast_dev_run must be a bool or a non-negative int, got {bad!r}"):
        ember.Trainer(fast_dev_run=bad, enable_progress_bar=False, logger=False)


# ---------------------------------------------------------------------- max_time
def test_max_time_adds_a_step_timer_and_lifts_the_epoch_default():
    """Lightning 2.6.6: Trainer(max_time=...) adds Timer(duration, interval="step"); with no max_epochs /
    max_steps the fit has no epoch limit (max_epochs -1); an explicit max_epochs is kept."""
    trainer = fast_trainer(max_time={"seconds": 5}, max_epochs=None)
    timers = [c for c in trainer.callbacks if isinstance(c, Timer)]
    assert len(timers) == 1 and timers[0].duration.total_seconds() == 5 and timers[0].interval == "step"
    # The limit is set when a fit starts (it reads None until then, as Lightning's): what fit() calls.
    assert trainer.max_epochs is None
    settle_epoch_limits(trainer)
    assert trainer.max_epochs == -1
    assert fast_trainer(max_time="00:00:00:05", max_epochs=3).max_epochs == 3
    timed = fast_trainer(callbacks=[Timer(duration=7)], max_epochs=None)
    settle_epoch_limits(timed)
    assert timed.max_epochs == -1
    plain = fast_trainer(max_epochs=None)
    with pytest.warns(UserWarning, match="Setting it to 1000 epochs"):
        settle_epoch_limits(plain)
    assert plain.max_epochs == 1000


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
