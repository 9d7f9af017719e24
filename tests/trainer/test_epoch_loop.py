"""The two batch loops of an epoch (``EpochLoop.run`` for the usual step, ``EpochLoop.run_iter`` for a
``training_step(self, dataloader_iter)``) share what follows each step: with one batch fetched per step, every
hook sees the same counters, schedulers and decisions in both, to the end of an epoch cut short.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.callbacks import Callback
from ember.loggers import CSVLogger
from tests.helpers.models import fast_trainer, regression_loader


class Usual(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 2}}


class Fetching(Usual):
    def training_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)
        return super().training_step(batch, 0)


class Recorder(Callback):
    """What the loop's bookkeeping shows each hook; a monitoring callback, so at an epoch's end it sees where a
    checkpoint written there would resume (``epoch_finished``)."""

    monitors_metrics = True

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.seen: list[tuple[Any, ...]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loop = trainer.fit_loop
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.seen.append(
            (
                "batch_end",
                batch_idx,
                trainer.global_step,
                trainer.is_last_batch,
                lr,
                loop.log_step,
                loop.writes_step_metrics,
            )
        )
        if trainer.global_step == self.stop_at:
            trainer.should_stop = True

    def on_validation_start(self, trainer, module):
        self.seen.append(("validate", trainer.global_step))

    def on_train_epoch_end(self, trainer, module):
        self.seen.append(("epoch_end", trainer.global_step, trainer.progress.epoch_finished, trainer.fit_loop.log_step))


SCHEDULES = {
    # Cut in epoch 1 after its 3rd batch: the epoch-end validation runs then, and the epoch is not finished.
    "max_steps mid-epoch": dict(max_epochs=3, max_steps=7),
    "a window of 2 batches, validation every 2 batches": dict(
        max_epochs=2, accumulate_grad_batches=2, val_check_interval=2
    ),
    "should_stop mid-epoch": dict(max_epochs=3, stop_at=6),
}


def _fit(cls: type[Usual], tmp_path: Any, stop_at: int | None = None, **options: Any) -> tuple[Usual, list[Any]]:
    torch.manual_seed(0)
    module, recorder = cls(), Recorder(stop_at)
    trainer = fast_trainer(
        callbacks=[recorder], logger=CSVLogger(str(tmp_path)), log_every_n_steps=3, num_sanity_val_steps=0, **options
    )
    trainer.fit(module, regression_loader(n=32, batch_size=8), regression_loader(n=16, batch_size=8))
    return module, recorder.seen


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_both_batch_loops_keep_the_same_books_after_each_step(schedule, tmp_path):
    usual, seen = _fit(Usual, tmp_path / "usual", **SCHEDULES[schedule])
    fetching, seen_iter = _fit(Fetching, tmp_path / "iter", **SCHEDULES[schedule])
    assert seen_iter == seen
    assert all(torch.equal(a, b) for a, b in zip(usual.parameters(), fetching.parameters()))
    assert any(s[0] == "validate" for s in seen) and any(s[0] == "batch_end" and s[-1] for s in seen)
    if schedule == "max_steps mid-epoch":
        assert seen[-2:] == [("validate", 7), ("epoch_end", 7, False, 6)]
