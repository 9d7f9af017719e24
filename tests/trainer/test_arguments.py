"""One test (or a few) per Trainer argument: what it changes in a real fit."""

from __future__ import annotations

import os

import pytest
import torch

import ember
from ember.callbacks import Callback
from tests.helpers.models import (
    BoringModel,
    RecordingCallback,
    RecordingLogger,
    TrainOnlyModel,
    UnsizedBatches,
    fast_trainer,
    regression_loader,
)


class Counter(Callback):
    """Records training batches as (epoch, batch_idx), validations as (epoch, batches so far), sanity checks."""

    def __init__(self) -> None:
        self.train: list[tuple[int, int]] = []
        self.val_runs: list[tuple[int, int]] = []
        self.val_batches = 0
        self.sanity_batches = 0
        self.test_batches = 0
        self.predict_batches = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.train.append((trainer.current_epoch, batch_idx))

    def on_validation_start(self, trainer, module):
        if not trainer.sanity_checking:
            self.val_runs.append((trainer.current_epoch, trainer.progress.batch_in_epoch))

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking:
            self.sanity_batches += 1
        else:
            self.val_batches += 1

    def on_test_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.test_batches += 1

    def on_predict_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.predict_batches += 1


def fit(n_train: int = 32, n_val: int = 32, batch_size: int = 8, module=None, **kwargs):
    counter = Counter()
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
    assert fast_trainer(max_epochs=None).max_epochs == 1000
    assert fast_trainer(max_epochs=None, max_steps=5).max_epochs == -1


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
    counter = Counter()
    trainer = fast_trainer(callbacks=[counter], limit_test_batches=limit, limit_predict_batches=limit)
    trainer.test(BoringModel(), regression_loader())
    out = trainer.predict(BoringModel(), regression_loader())
    assert counter.test_batches == expected
    assert counter.predict_batches == expected == len(out)


def test_int_limit_larger_than_a_stream_without_length():
    # The stream has 5 batches, the limit allows 10: the epoch still ends (and validates, and closes its
    # accumulation window) when the stream runs out.
    counter = Counter()
    trainer = fast_trainer(
        callbacks=[counter], max_epochs=2, accumulate_grad_batches=2, limit_train_batches=10, num_sanity_val_steps=0
    )
    trainer.fit(BoringModel(), UnsizedBatches(n=40), regression_loader(n=8))
    assert len(counter.train) == 10
    assert trainer.global_step == 6  # windows of 2, 2 and 1 in each epoch
    assert counter.val_runs == [(0, 5), (1, 5)]


def test_int_limit_shorter_than_a_stream_without_length():
    counter = Counter()
    trainer = fast_trainer(callbacks=[counter], max_epochs=2, limit_train_batches=3, num_sanity_val_steps=0)
    trainer.fit(BoringModel(), UnsizedBatches(n=40), regression_loader(n=8))
    assert counter.train == [(e, b) for e in range(2) for b in range(3)]
    assert counter.val_runs == [(0, 3), (1, 3)]


@pytest.mark.parametrize("bad", [-1, 1.5, "all", True])
def test_limit_bad_values(bad):
    with pytest.raises(ValueError, match=r"limit_train_batches.*(fraction|int)"):
        fast_trainer(limit_train_batches=bad)


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


# ---------------------------------------------------------------------- log_every_n_steps
def test_log_every_n_steps_with_a_recording_logger():
    logger = RecordingLogger()
    trainer = fast_trainer(logger=logger, log_every_n_steps=2, max_epochs=2)
    trainer.fit(TrainOnlyModel(), regression_loader(n=64, batch_size=8))
    # As Lightning: a step's metrics are written at the step's index (0, 1, ...), and only when the step count
    # after the step is a multiple of log_every_n_steps: 16 steps, every 2nd written at 1, 3, ..., 15.
    assert logger.steps_with("train_loss") == [1, 3, 5, 7, 9, 11, 13, 15]
    step, metrics = logger.records[0]
    assert step == 1
    assert metrics["epoch"] == 0.0 and isinstance(metrics["train_loss"], float)
    assert logger.status == "success"


def test_log_every_n_steps_is_kept_across_epoch_ends():
    # 5 steps per epoch, every 2nd step logged: the 2nd, 4th, ... 10th step, written (as Lightning) at their
    # indices 1, 3, 5, 7, 9 (no extra write at an epoch's last step).
    logger = RecordingLogger()
    trainer = fast_trainer(logger=logger, log_every_n_steps=2, max_epochs=2)
    trainer.fit(TrainOnlyModel(), regression_loader(n=40, batch_size=8))
    assert logger.steps_with("train_loss") == [1, 3, 5, 7, 9]


def test_log_every_n_steps_counts_optimizer_steps():
    logger = RecordingLogger()
    trainer = fast_trainer(logger=logger, log_every_n_steps=2, accumulate_grad_batches=2)
    trainer.fit(TrainOnlyModel(), regression_loader(n=64, batch_size=8))
    # 8 batches, 4 optimizer steps; the 2nd and 4th are written, at their indices 1 and 3 (as Lightning).
    assert logger.steps_with("train_loss") == [1, 3]


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_log_every_n_steps_bad_value(bad):
    with pytest.raises(ValueError, match="log_every_n_steps must be a positive int"):
        fast_trainer(log_every_n_steps=bad)


# ---------------------------------------------------------------------- fast_dev_run
def test_fast_dev_run_true_runs_one_batch_of_each_without_loggers():
    logger = RecordingLogger()
    counter = Counter()
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
    counter = Counter()
    trainer = ember.Trainer(fast_dev_run=3, callbacks=[counter], enable_progress_bar=False)
    trainer.fit(BoringModel(), regression_loader(n=64), regression_loader(n=64))
    assert counter.train == [(0, 0), (0, 1), (0, 2)]
    assert counter.val_batches == 3
    assert trainer.current_epoch == 1


@pytest.mark.parametrize("bad", [-1, "yes", 1.5, None])
def test_fast_dev_run_bad_values(bad):
    with pytest.raises(ValueError, match=rf"fast_dev_run must be a bool or a non-negative int, got {bad!r}"):
        ember.Trainer(fast_dev_run=bad, enable_progress_bar=False, logger=False)


# ---------------------------------------------------------------------- deterministic
@pytest.fixture
def restore_determinism():
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.usefixtures("restore_determinism")
def test_deterministic_true_and_warn():
    fast_trainer(deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    fast_trainer(deterministic="warn")
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    fast_trainer(deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.usefixtures("restore_determinism")
def test_deterministic_runs_give_identical_weights():
    weights = []
    for _ in range(2):
        ember.seed_everything(3)
        module = BoringModel()
        fast_trainer(deterministic=True, max_epochs=2).fit(module, regression_loader(shuffle=True))
        weights.append(module.layer.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])


@pytest.mark.usefixtures("restore_determinism")
def test_deterministic_bad_value():
    with pytest.raises(ValueError, match="deterministic must be True, False or 'warn'"):
        fast_trainer(deterministic="yes")


# ---------------------------------------------------------------------- default_root_dir
def test_default_root_dir(tmp_path, monkeypatch):
    trainer = fast_trainer(default_root_dir=tmp_path)
    assert trainer.default_root_dir == str(tmp_path)
    assert trainer.log_dir == str(tmp_path)  # no logger: the root dir
    monkeypatch.chdir(tmp_path)
    assert fast_trainer().default_root_dir == os.getcwd()


# ---------------------------------------------------------------------- callbacks
def test_callbacks_accepts_one_callback_or_a_list():
    cb = Counter()
    assert cb in fast_trainer(callbacks=cb).callbacks
    a, b = Counter(), Counter()
    trainer = fast_trainer(callbacks=[a, b])
    assert trainer.callbacks.index(a) < trainer.callbacks.index(b)
    trainer.fit(BoringModel(), regression_loader())
    assert len(a.train) == len(b.train) == 4


def test_callbacks_rejects_non_callbacks():
    with pytest.raises(TypeError, match="callbacks must be ember.callbacks.Callback instances, got function"):
        fast_trainer(callbacks=[lambda *a: None])


def test_module_configure_callbacks_are_added():
    counter = Counter()

    class WithCallbacks(BoringModel):
        def configure_callbacks(self):
            return [counter]

    trainer = fast_trainer()
    trainer.fit(WithCallbacks(), regression_loader())
    assert counter in trainer.callbacks and len(counter.train) == 4


# ---------------------------------------------------------------------- enable_checkpointing
def test_enable_checkpointing_adds_a_default_model_checkpoint(tmp_path):
    from ember.callbacks import ModelCheckpoint

    trainer = fast_trainer(enable_checkpointing=True, default_root_dir=tmp_path)
    assert sum(isinstance(c, ModelCheckpoint) for c in trainer.callbacks) == 1
    trainer.fit(BoringModel(), regression_loader())
    assert list((tmp_path / "checkpoints").glob("*.ckpt"))
    assert not any(isinstance(c, ModelCheckpoint) for c in fast_trainer(enable_checkpointing=False).callbacks)


def test_enable_checkpointing_keeps_the_users_checkpoint(tmp_path):
    from ember.callbacks import ModelCheckpoint

    mine = ModelCheckpoint(dirpath=tmp_path)
    trainer = fast_trainer(enable_checkpointing=True, callbacks=[mine])
    assert [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)] == [mine]


def test_enable_checkpointing_false_with_a_model_checkpoint_is_an_error(tmp_path):
    from ember.callbacks import ModelCheckpoint

    message = r"enable_checkpointing=False but a ModelCheckpoint is in callbacks; remove one"
    with pytest.raises(ValueError, match=message):
        fast_trainer(enable_checkpointing=False, callbacks=[ModelCheckpoint(dirpath=tmp_path)])


# ---------------------------------------------------------------------- enable_progress_bar
def test_enable_progress_bar(capsys):
    from ember.callbacks import ProgressBar

    trainer = fast_trainer(enable_progress_bar=True)
    assert any(isinstance(c, ProgressBar) for c in trainer.callbacks)
    trainer.fit(BoringModel(), regression_loader(), regression_loader())
    out = capsys.readouterr().out
    # One line per epoch off a terminal, the validation folded in: a 1-epoch fit reads "Epoch 0/0 done".
    assert "Epoch 0/0 done" in out and "Validation" not in out
    assert not any(isinstance(c, ProgressBar) for c in fast_trainer(enable_progress_bar=False).callbacks)


def test_enable_progress_bar_keeps_a_user_progress_bar():
    from ember.callbacks import ProgressBar

    mine = ProgressBar(refresh_rate=0)
    trainer = fast_trainer(enable_progress_bar=True, callbacks=[mine])
    assert [c for c in trainer.callbacks if isinstance(c, ProgressBar)] == [mine]


# ---------------------------------------------------------------------- logger
def test_logger_false_and_none_mean_no_logger():
    assert fast_trainer(logger=False).loggers == []
    assert fast_trainer(logger=None).loggers == []
    assert fast_trainer(logger=False).logger is None


def test_logger_instance_and_list():
    lg = RecordingLogger()
    trainer = fast_trainer(logger=lg)
    assert trainer.loggers == [lg] and trainer.logger is lg and lg in trainer.callbacks
    a, b = RecordingLogger(), RecordingLogger()
    trainer = fast_trainer(logger=[a, b], log_every_n_steps=1)
    trainer.fit(TrainOnlyModel(), regression_loader())
    assert a.records == b.records and a.steps_with("train_loss") == [0, 1, 2, 3]  # as Lightning: step indices


def test_logger_true_uses_the_default_logger(tmp_path):
    trainer = fast_trainer(logger=True, default_root_dir=tmp_path)
    assert all(isinstance(lg, ember.loggers.Logger) for lg in trainer.loggers)
    trainer.fit(BoringModel(), regression_loader())


def test_logger_bad_type():
    with pytest.raises(TypeError, match="logger must be a bool or ember Logger instances, got str"):
        fast_trainer(logger=["tensorboard"])


def test_logger_is_finalized_with_failed_on_error():
    lg = RecordingLogger()

    class Boom(TrainOnlyModel):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fast_trainer(logger=lg).fit(Boom(), regression_loader())
    assert lg.status == "failed"


# ---------------------------------------------------------------------- strategy / accelerator / devices
def test_strategy_names_and_instances():
    from ember.strategies import SingleDeviceStrategy

    assert isinstance(fast_trainer(strategy="single").strategy, SingleDeviceStrategy)
    assert isinstance(fast_trainer(strategy="auto", accelerator="cpu", devices=1).strategy, SingleDeviceStrategy)
    mine = SingleDeviceStrategy()
    trainer = fast_trainer(strategy=mine)
    assert trainer.strategy is mine and mine.trainer is trainer
    trainer.fit(BoringModel(), regression_loader())


def test_strategy_bad_type():
    with pytest.raises(TypeError, match="strategy must be a name or a Strategy instance, got int"):
        fast_trainer(strategy=3)


def test_single_strategy_with_several_devices_is_an_error():
    with pytest.raises(ValueError, match=r"strategy='single' runs on one device but devices=2.*'dp' or 'ddp'"):
        fast_trainer(strategy="single", accelerator="cpu", devices=2)


@pytest.mark.parametrize("accelerator", ["cpu", "auto"])
@pytest.mark.parametrize("devices", [1, "auto", [0]])
def test_cpu_accelerator_and_devices(accelerator, devices, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    trainer = fast_trainer(accelerator=accelerator, devices=devices)
    assert trainer.strategy.root_device == torch.device("cpu")
    assert trainer.world_size == 1


@pytest.mark.parametrize("bad", [0, -2, "two", 1.5, True, [], [0, 0], [-1]])
def test_devices_bad_values(bad):
    with pytest.raises(ValueError, match="devices"):
        fast_trainer(accelerator="cpu", devices=bad)


def test_gpu_is_an_alias_of_cuda_and_devices_picks_indices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    trainer = fast_trainer(accelerator="gpu", devices=[1])
    assert trainer.strategy.root_device == torch.device("cuda", 1)
    assert fast_trainer(accelerator="auto", devices=1).strategy.root_device == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"strategy='single' runs on one device but devices=2"):
        fast_trainer(accelerator="cuda", devices=-1, strategy="single")
