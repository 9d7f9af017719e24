"""When a callback's own metrics reach the loggers, and how (shared by LearningRateMonitor and
ThroughputMonitor, which log outside ``self.log``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


def logs_after_this_batch(trainer: Trainer) -> bool:
    """Called in ``on_train_batch_end``: will the loop write step metrics once this batch is done?

    The fit loop decides (a batch that stepped the optimizer, ``global_step`` a multiple of
    ``log_every_n_steps``, loggers present) before ``on_train_batch_end``; these callbacks then
    write at ``trainer.global_step``, the step the loop's own write uses.
    """
    loop = trainer.fit_loop
    return loop is not None and loop.writes_step_metrics


def logger_step(trainer: Trainer) -> int:
    """The step loggers get now, numbered as Lightning numbers it: during a fit, the optimizer steps
    taken before the current batch's step (so a batch's metrics, its validation and an epoch's end
    are written at the index of the step: 0, 1, ...); outside a fit, ``global_step``."""
    loop = trainer.fit_loop
    return loop.log_step if loop is not None and trainer.state == "fitting" else trainer.global_step


def write_to_loggers(trainer: Trainer, metrics: dict[str, float], step: int) -> None:
    """Hand ``metrics`` (floats) to every logger at ``step``, on global rank zero only. As Lightning's
    monitors, they go to the loggers only, not into ``trainer.logged_metrics`` (that holds ``self.log``'s)."""
    if not trainer.is_global_zero:
        return
    for lg in trainer.loggers:
        lg.log_metrics(metrics, step)
