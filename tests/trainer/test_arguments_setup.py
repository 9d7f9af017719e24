"""Trainer arguments that set up the run around the loop: log_every_n_steps, deterministic, benchmark,
detect_anomaly, default_root_dir, callbacks, enable_checkpointing, enable_progress_bar, logger,
enable_autolog_hparams, strategy, accelerator and devices. One test (or a few) per argument: what it
changes in a real fit. Where a comment says "Lightning 2.6.6", the expected value was observed on
Lightning first with the same module and data (32 samples, batches of 8: 4 per epoch).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.callbacks import Callback
from tests.helpers.models import (
    BatchCounter,
    BoringModel,
    RecordingLogger,
    TrainOnlyModel,
    fast_trainer,
    regression_loader,
)


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


@pytest.mark.parametrize("bad", [-1, 1.5])  # (0 is taken, as Lightning: no step metrics; test_barebones.py)
def test_log_every_n_steps_bad_value(bad):
    with pytest.raises(ValueError, match="log_every_n_steps must be a non-negative int"):
        fast_trainer(log_every_n_steps=bad)


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


# ---------------------------------------------------------------------- benchmark, detect_anomaly
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


# ---------------------------------------------------------------------- default_root_dir
def test_default_root_dir(tmp_path, monkeypatch):
    trainer = fast_trainer(default_root_dir=tmp_path)
    assert trainer.default_root_dir == str(tmp_path)
    assert trainer.log_dir == str(tmp_path)  # no logger: the root dir
    monkeypatch.chdir(tmp_path)
    assert fast_trainer().default_root_dir == os.getcwd()


# ---------------------------------------------------------------------- callbacks
def test_callbacks_accepts_one_callback_or_a_list():
    cb = BatchCounter()
    assert cb in fast_trainer(callbacks=cb).callbacks
    a, b = BatchCounter(), BatchCounter()
    trainer = fast_trainer(callbacks=[a, b])
    assert trainer.callbacks.index(a) < trainer.callbacks.index(b)
    trainer.fit(BoringModel(), regression_loader())
    assert len(a.train) == len(b.train) == 4


def test_callbacks_rejects_non_callbacks():
    with pytest.raises(TypeError, match="callbacks must be ember.callbacks.Callback instances, got function"):
        fast_trainer(callbacks=[lambda *a: None])


def test_module_configure_callbacks_are_added():
    counter = BatchCounter()

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
    assert all(isinstance(lg, ember.callbacks.Logger) for lg in trainer.loggers)
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


# ---------------------------------------------------------------------- enable_autolog_hparams
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
