"""When a callback's own metrics reach the loggers, and how (shared by LearningRateMonitor and
ThroughputMonitor, which log outside ``self.log``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


def logs_after_this_batch(trainer: Trainer) -> bool:
    """Called in ``on_train_batch_end``: will the loop write step metrics once this batch is done?

    The loop increments ``global_step`` after ``on_train_batch_end`` when the batch stepped an
    optimizer, and writes step metrics when the new step is a multiple of ``log_every_n_steps``.
    """
    stepped = getattr(trainer._loop, "stepped_this_batch", False)
    return stepped and (trainer.global_step + 1) % trainer.log_every_n_steps == 0


def write_to_loggers(trainer: Trainer, metrics: dict[str, float], step: int) -> None:
    """Hand ``metrics`` (floats) to every logger at ``step``, on global rank zero only."""
    if not trainer.is_global_zero:
        return
    trainer.logged_metrics.update(metrics)
    for lg in trainer.loggers:
        lg.log_metrics(metrics, step)
