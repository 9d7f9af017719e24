"""Counters of a fit: epoch, optimizer steps, batches consumed, and their state_dict."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class FitProgress:
    """Where a fit is.

    ``global_step`` counts batches on which the optimizer(s) stepped (once per batch, however many
    optimizers there are). ``batch_in_epoch`` counts batches consumed in the current epoch, which is
    what an exact mid-epoch resume skips. ``steps_in_epoch`` counts the steps of a ``training_step(self,
    dataloader_iter)``, which fetches its own batches, any number per step; the usual step takes one batch
    per step, which ``batch_in_epoch`` counts, and leaves it 0.
    """

    current_epoch: int = 0
    global_step: int = 0
    batch_in_epoch: int = 0
    steps_in_epoch: int = 0
    total_batches: int = 0
    val_checks_in_epoch: int = 0
    epoch_finished: bool = False
    # Not a field (no annotation): ``trainer.is_last_batch`` of the batch being run, not saved in checkpoints.
    is_last_batch = False

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)
