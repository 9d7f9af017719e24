"""Timer: stage clocks, and a wall-clock budget that stops fit through its normal end."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, Timer
from ember.callbacks.timer import parse_duration


class Slow(ember.TrainModule):
    def __init__(self, step_s: float = 0.02) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.step_s = step_s

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_s)
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        time.sleep(0.01)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class EpochEndWatcher(Callback):
    """Stands in for checkpointing: a monitoring callback that must still run at the stopping epoch's end."""

    monitors_metrics = True

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool]] = []
        self.fit_ended = False

    def on_train_epoch_end(self, trainer, module):
        self.calls.append((trainer.current_epoch, trainer.global_step, trainer.should_stop))

    def on_fit_end(self, trainer, module):
        self.fit_ended = True


def data(n=16):
    return DataLoader(TensorDataset(torch.randn(n, 2), torch.randn(n, 1)), batch_size=4)


def fit(callbacks, max_epochs=1000, val=False, train_n=16, **kw):
    trainer = ember.Trainer(
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=kw.pop("enable_checkpointing", False),
        callbacks=callbacks,
        num_sanity_val_steps=0,
        **kw,
    )
    trainer.fit(Slow(), data(train_n), data(8) if val else None)
    return trainer


def test_budget_stops_after_the_current_step_and_ends_fit_normally():
    timer, watcher = Timer(duration=0.15), EpochEndWatcher()
    trainer = fit([timer, watcher])
    assert timer.stopped and trainer.should_stop
    # steps sleep at least 20 ms, so 0.15 s are used up by step 8 at the latest (max_epochs allows 4000)
    assert 1 <= trainer.global_step <= 8
    # the stopping epoch still ended (monitoring callbacks ran, with should_stop set), then fit ended
    assert watcher.calls[-1] == (trainer.current_epoch - 1, trainer.global_step, True)
    assert watcher.fit_ended
    assert 0.15 <= timer.time_elapsed("train") < 5
    # as Lightning's: what is left of the budget, negative once it is overrun
    assert timer.time_remaining() == pytest.approx(0.15 - timer.time_elapsed("train"))


def test_epoch_interval_stops_at_an_epoch_boundary():
    # 16 steps an epoch, each sleeping 20 ms: the 0.1 s budget runs out inside epoch 0 (by its fifth step,
    # however fast or loaded the machine), and the timer stops fit only at the end of that epoch.
    timer = Timer(duration=timedelta(seconds=0.1), interval="epoch")
    trainer = fit([timer], train_n=64)
    assert timer.stopped and trainer.global_step == 16 and trainer.current_epoch == 1


def test_stage_clocks_without_a_budget():
    timer = Timer()
    trainer = fit([timer], max_epochs=1, val=True)
    assert not timer.stopped and trainer.global_step == 4
    train, val = timer.time_elapsed("train"), timer.time_elapsed("validate")
    assert train >= 4 * 0.02 and val >= 2 * 0.01 and train > val
    assert timer.end_time("train") > timer.start_time("train")
    assert timer.time_elapsed("test") == 0.0 and timer.time_remaining() is None


def test_resume_counts_earlier_training_time():
    timer = Timer(duration=100)
    timer.load_state_dict({"time_elapsed": {"train": 99.95, "validate": 1.0, "test": 0.0}})
    assert timer.time_elapsed() == pytest.approx(99.95)
    trainer = fit([timer])
    assert timer.stopped and trainer.global_step <= 5
    assert timer.state_dict()["time_elapsed"]["train"] >= 100


def test_checkpoint_is_saved_when_the_budget_stops_training(tmp_path):
    model_checkpoint = pytest.importorskip("ember.callbacks.model_checkpoint")
    timer = Timer(duration=0.1)
    ckpt = model_checkpoint.ModelCheckpoint(dirpath=str(tmp_path))
    trainer = fit([timer, ckpt], enable_checkpointing=True, default_root_dir=str(tmp_path))
    assert timer.stopped
    assert any(f.endswith(".ckpt") for f in os.listdir(tmp_path)), os.listdir(tmp_path)
    assert trainer.global_step > 0


@pytest.mark.parametrize(
    "given, seconds",
    [
        ("00:00:01:30", 90),
        ("01:02:03:04", 93784),
        (12, 12),
        (0.5, 0.5),
        ({"minutes": 2}, 120),
        (timedelta(hours=1), 3600),
    ],
)
def test_parse_duration(given, seconds):
    assert parse_duration(given).total_seconds() == seconds


def test_bad_arguments():
    with pytest.raises(ValueError, match="DD:HH:MM:SS"):
        Timer(duration="1h")
    with pytest.raises(TypeError, match="duration"):
        Timer(duration=[1])
    with pytest.raises(ValueError, match="interval"):
        Timer(duration=1, interval="batch")
