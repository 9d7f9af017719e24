"""Timer: track time per stage and stop fitting cleanly at a wall-clock budget."""

from __future__ import annotations

import logging
import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer

log = logging.getLogger(__name__)

_STAGES = ("train", "validate", "test")


def parse_duration(duration: str | timedelta | dict[str, float] | float | int | None) -> timedelta | None:
    """A duration from a timedelta, seconds, a dict of timedelta arguments or "DD:HH:MM:SS"."""
    if duration is None or isinstance(duration, timedelta):
        return duration
    if isinstance(duration, bool):
        raise TypeError("duration must be a timedelta, seconds, a dict or a 'DD:HH:MM:SS' string, not a bool.")
    if isinstance(duration, (int, float)):
        return timedelta(seconds=duration)
    if isinstance(duration, dict):
        return timedelta(**duration)
    if isinstance(duration, str):
        match = re.fullmatch(r"(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})", duration.strip())
        if not match:
            raise ValueError(
                f"Timer duration {duration!r} is not in the form 'DD:HH:MM:SS' (e.g. '00:12:00:00' for 12 hours)."
            )
        days, hours, minutes, seconds = map(int, match.groups())
        return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    raise TypeError(
        f"duration must be a timedelta, seconds, a dict or a 'DD:HH:MM:SS' string, got {type(duration).__name__}."
    )


class Timer(Callback):
    """Measure the time spent in training, validation and testing; optionally stop at a budget.

    When the training time reaches ``duration``, ``trainer.should_stop`` is set: the current batch
    (or epoch) finishes and fit ends through its normal path, so end-of-epoch work such as
    checkpointing still runs. Under several processes, the decision is agreed across them. The
    budget is also checked when fit starts, after a resume restored the time already used (as in
    Lightning), so a run whose budget is spent does not train on.

    Args:
        duration: the training time budget: timedelta, seconds, dict (``{"hours": 2}``) or
            "DD:HH:MM:SS"; None only measures.
        interval: check after every training batch ("step") or at every epoch end ("epoch").
        verbose: log a line (INFO) when the budget stops training.
    """

    uses_step_outputs = False  # the loop need not build {"loss": ...} for this callback

    def __init__(
        self,
        duration: str | timedelta | dict[str, float] | float | None = None,
        interval: str = "step",
        verbose: bool = True,
    ) -> None:
        if interval not in ("step", "epoch"):
            raise ValueError(f"Timer interval must be 'step' or 'epoch', got {interval!r}.")
        self.duration = parse_duration(duration)
        self._budget = self.duration.total_seconds() if self.duration is not None else None
        self.interval = interval
        self.verbose = verbose
        self._start: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._offset = dict.fromkeys(_STAGES, 0.0)  # time from before a resume
        #: True once the budget stopped training.
        self.stopped = False

    # ------------------------------------------------------------------ queries
    def start_time(self, stage: str = "train") -> float | None:
        """``time.monotonic()`` when ``stage`` last started."""
        return self._start[stage]

    def end_time(self, stage: str = "train") -> float | None:
        return self._end[stage]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in ``stage`` (including time before a resume, for training)."""
        start, end = self._start[stage], self._end[stage]
        offset = self._offset[stage]
        if start is None:
            return offset
        return offset + ((end if end is not None else time.monotonic()) - start)

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left of ``duration`` (negative once it is overrun, as Lightning's); None without one."""
        return None if self._budget is None else self._budget - self.time_elapsed(stage)

    # ------------------------------------------------------------------ stage clocks
    def _begin(self, stage: str) -> None:
        self._start[stage] = time.monotonic()
        self._end[stage] = None

    def _finish(self, stage: str) -> None:
        self._end[stage] = time.monotonic()

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        self.stopped = False
        if self._budget is not None:  # the state is restored by now: a resumed run may have no time left
            self._check(trainer)

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._begin("train")

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._finish("train")

    def on_validation_start(self, trainer: Trainer, module: TrainModule) -> None:
        if not trainer.sanity_checking:
            self._begin("validate")

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        if not trainer.sanity_checking:
            self._finish("validate")

    def on_test_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._begin("test")

    def on_test_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._finish("test")

    # ------------------------------------------------------------------ the budget
    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.interval == "step" and self._budget is not None:
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self.interval == "epoch" and self._budget is not None:
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        over = self.time_elapsed("train") >= self._budget  # type: ignore[operator]
        if trainer.world_size > 1:  # clocks differ between processes: stop together or not at all
            over = trainer.strategy.reduce_boolean_decision(over, all=False)
        if over and not self.stopped:
            self.stopped = True
            trainer.should_stop = True
            if self.verbose and trainer.is_global_zero:
                log.info(
                    "Timer: the training budget of %s is used up (%s elapsed; epoch %d, global step %d); stopping.",
                    self.duration,
                    timedelta(seconds=int(self.time_elapsed("train"))),
                    trainer.current_epoch,
                    trainer.global_step,
                )

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in _STAGES}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        elapsed = state_dict.get("time_elapsed", {})
        self._offset["train"] = float(elapsed.get("train", 0.0))
