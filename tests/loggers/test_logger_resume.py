"""Logger rows after a real kill: a fit SIGKILLed after a checkpoint and a few steps more, resumed into the
same run directory (``ckpt_path="last"``), has each step once in ``metrics.csv`` and in TensorBoard, with
the values of an uninterrupted run.

Also run as a script (``python test_logger_resume.py ROOT CONFIG KILL_STEP CKPT``): it trains in ``CONFIG``
("two": a TensorBoardLogger and a CSVLogger, a checkpoint every 4 steps; "default": ``logger=True`` and the
default checkpointing) from ``CKPT`` ("none" or "last") and SIGKILLs itself before the batch after
``KILL_STEP`` optimizer steps.

TensorBoard reads a run directory's event files in name order, which begins with the second the file was
made in; a resumed run here starts the moment the killed one died (a real restart takes seconds), so the
test waits for the next second before each resume.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint
from ember.loggers import CSVLogger, TensorBoardLogger

BATCH, EPOCHS = 4, 3
SAMPLES = {"two": 32, "default": 64}  # 8 and 16 batches per epoch


class Net(ember.TrainModule):
    """An MLP with dropout on shuffled data: the logged values depend on the RNG, the data order and the
    epoch's running sums, all of which the resume has to carry."""

    def __init__(self, hidden: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss, on_step=True, on_epoch=True)  # the epoch value: written at the epoch's end
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class KillAt(Callback):
    """SIGKILL this process before the batch after ``step`` optimizer steps (nothing runs after it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def fit(root: str, config: str, ckpt_path: str | None = None, kill_step: int | None = None) -> ember.Trainer:
    ember.seed_everything(0)
    g = torch.Generator().manual_seed(3)
    n = SAMPLES[config]
    data = TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))
    callbacks: list[Callback] = [KillAt(kill_step)] if kill_step is not None else []
    kwargs: dict[str, Any] = {}
    if config == "two":
        # Every event straight to disk, as in a run that went on long enough after its checkpoint to flush; the
        # CSV rows reach the disk only with a checkpoint (flush_logs_every_n_steps=100 is never reached).
        kwargs["logger"] = [TensorBoardLogger(root, max_queue=1), CSVLogger(root)]
        callbacks.append(ModelCheckpoint(every_n_train_steps=4))
    trainer = ember.Trainer(
        max_epochs=EPOCHS,
        log_every_n_steps=1,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=callbacks,
        **kwargs,
    )
    trainer.fit(
        Net(),
        DataLoader(data, batch_size=BATCH, shuffle=True),
        DataLoader(data, batch_size=16),
        ckpt_path=ckpt_path,
    )
    return trainer


def killed_run(root: str, config: str, kill_step: int, ckpt_path: str | None) -> None:
    """Run ``fit`` in a new process that SIGKILLs itself at ``kill_step``."""
    args = [sys.executable, __file__, root, config, str(kill_step), ckpt_path or "none"]
    proc = subprocess.run(args, capture_output=True, timeout=100)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    time.sleep(1)  # (the module docstring: the resumed run's event file must sort after this one's)


def csv_rows(log_dir: str) -> list[dict[str, str]]:
    with open(os.path.join(log_dir, "metrics.csv"), newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(log_dir)
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_two_kills_leave_each_step_once_with_the_values_of_an_uninterrupted_run(tmp_path):
    reference = fit(str(tmp_path / "reference"), "two").log_dir
    root = str(tmp_path / "run")
    # Killed at step 10: its last checkpoint is the step boundary after the first epoch's last batch (step 8),
    # so the resumed run writes that epoch's end (at step 7) again. Then killed at 15, after the one at 12.
    killed_run(root, "two", 10, None)
    log_dir = os.path.join(root, "ember_logs", "version_0")
    # The rows up to the checkpoint reached the disk with it (flush_logs_every_n_steps=100 alone writes none).
    assert [r["step"] for r in csv_rows(log_dir)] == [str(s) for s in range(8)]
    killed_run(root, "two", 15, "last")
    trainer = fit(root, "two", ckpt_path="last")
    assert trainer.log_dir == log_dir  # every run wrote into the first one's directory
    assert sorted(os.listdir(os.path.dirname(log_dir))) == ["version_0"]

    rows, expected = csv_rows(log_dir), csv_rows(reference)
    assert [r["step"] for r in rows] == [str(s) for s in range(EPOCHS * 8)]  # each step once, none lost
    assert rows == expected  # every value (and column) as in the run that was never killed
    assert scalars(log_dir) == scalars(reference)


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_the_default_logger_after_a_kill_shows_each_step_once(tmp_path):
    """logger=True and the default checkpointing (last.ckpt at each epoch's end): killed 13 steps into the
    second epoch, after TensorBoard's writer queue (10 events) was flushed once."""
    reference = fit(str(tmp_path / "reference"), "default").log_dir
    root = str(tmp_path / "run")
    killed_run(root, "default", 16 + 13, None)
    trainer = fit(root, "default", ckpt_path="last")
    assert trainer.log_dir == os.path.join(root, "ember_logs", "version_0")
    got, expected = scalars(trainer.log_dir), scalars(reference)
    assert [s for s, _ in got["train/loss_step"]] == list(range(EPOCHS * 16))
    assert got == expected


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    root_, config_, kill_, ckpt_ = sys.argv[1:5]
    fit(root_, config_, None if ckpt_ == "none" else ckpt_, int(kill_))
    sys.exit("the run was not killed")
