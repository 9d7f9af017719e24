"""EarlyStopping: stop fitting when a monitored metric stops improving, crosses a threshold or is not finite."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ember.callbacks.callback import Callback
from ember.metric_values import to_floats
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer

log = logging.getLogger(__name__)


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved for ``patience`` validation checks.

    The check runs after each validation (so ``patience`` counts validation checks, which differ
    from epochs when ``val_check_interval`` < 1 or ``check_val_every_n_epoch`` > 1), or at the end
    of each training epoch when validation runs exactly once per epoch or not at all. Either way it
    sees the epoch's reduced metrics, including anything the module logs in its own
    ``on_train_epoch_end``. The decision to stop is agreed across processes: one rank's NaN stops all.

    Args:
        monitor: the logged metric to watch (a key of ``trainer.callback_metrics``).
        min_delta: the smallest change that counts as an improvement.
        patience: checks without improvement after which training stops.
        verbose: log every improvement and the reason for stopping (``logging`` at INFO level).
        mode: "min" (lower is better) or "max".
        strict: raise if ``monitor`` was never logged; with False, warn once and skip the check.
        check_finite: stop when the metric becomes NaN or infinite.
        stopping_threshold: stop as soon as the metric is better than this value.
        divergence_threshold: stop as soon as the metric is worse than this value.
        check_on_train_epoch_end: force the check to the end of training epochs (True) or after
            validation (False); None chooses as described above.
        log_rank_zero_only: in a multi-process run, log the messages on global rank zero only; with
            False (the default, as Lightning's) every rank logs its own, prefixed ``[rank: N]``.
    """

    monitors_metrics = True
    #: As Lightning's: the comparison ("is better than") and its symbol for each ``mode``.
    mode_dict: ClassVar[dict[str, Callable[..., Any]]] = {"min": torch.lt, "max": torch.gt}
    order_dict: ClassVar[dict[str, str]] = {"min": "<", "max": ">"}

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        log_rank_zero_only: bool = False,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"EarlyStopping needs the name of a logged metric to monitor, got {monitor!r}.")
        if mode not in self.mode_dict:
            modes = " or ".join(repr(m) for m in self.mode_dict)
            raise ValueError(f"EarlyStopping(mode={mode!r}): mode must be {modes}.")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping(patience={patience!r}): patience must be a non-negative int.")
        if min_delta < 0:
            raise ValueError(
                f"EarlyStopping(min_delta={min_delta!r}): min_delta must be >= 0 (it is applied in "
                "the direction of `mode`)."
            )
        self.monitor = monitor
        self.min_delta = float(min_delta)
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.strict = strict
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.log_rank_zero_only = log_rank_zero_only
        self.wait_count = 0
        self._best = math.inf if self.monitor_op is torch.lt else -math.inf
        self.stopped_epoch = 0  # as Lightning: 0 when training was not stopped
        self.stopped_step = -1
        #: Why training was stopped, once it was.
        self.stopping_reason: str | None = None
        self._on_epoch_end = False
        self._warned_missing = False

    @property
    def monitor_op(self) -> Callable[..., Any]:
        """The comparison for ``mode``: ``torch.lt`` ("min") or ``torch.gt`` ("max"), as Lightning's."""
        return self.mode_dict[self.mode]

    @property
    def best_score(self) -> torch.Tensor:
        """The best value seen so far, as a tensor (as Lightning's); +-inf before the first check."""
        return torch.tensor(self._best)

    @best_score.setter
    def best_score(self, value: float | torch.Tensor) -> None:
        self._best = float(value)

    def _state_key_args(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.mode}

    def _better(self, a: float, b: float) -> bool:
        return bool(self.monitor_op(torch.tensor(a, dtype=torch.float64), b))

    # ------------------------------------------------------------------ when to check
    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        if self.check_on_train_epoch_end is not None:
            self._on_epoch_end = self.check_on_train_epoch_end
        else:
            # Not requested yet when the first epoch does not validate: then whether the fit validates decides.
            batches = trainer.num_val_batches
            validates = any(batches) if batches else trainer.enable_validation
            once_per_epoch = trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1
            self._on_epoch_end = not validates or once_per_epoch

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._on_epoch_end or trainer.state != "fitting" or trainer.sanity_checking:  # trainer.validate, sanity
            return
        self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._on_epoch_end:
            self._check(trainer)

    # ------------------------------------------------------------------ the check
    def _check(self, trainer: Trainer) -> None:
        if trainer.fast_dev_run:  # as Lightning: a smoke run of a batch or two decides nothing
            return
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            available = ", ".join(sorted(metrics)) or "none"
            message = (
                f"EarlyStopping could not find the monitored metric {self.monitor!r} "
                f"(metrics logged so far: {available}). Log it with self.log({self.monitor!r}, value) "
                "in validation_step (or training_step), or fix the `monitor` name"
            )
            if self.strict:
                raise RuntimeError(message + "; pass strict=False to skip checks while it is missing.")
            if not self._warned_missing:
                warnings.warn(message + "; skipping the check.", RuntimeWarning, stacklevel=user_stacklevel())
                self._warned_missing = True
            return
        current = to_floats({self.monitor: metrics[self.monitor]})[self.monitor]
        stop_here, reason, alarming = self._evaluate(current, trainer)
        should_stop = trainer.strategy.reduce_boolean_decision(stop_here, all=False)
        if should_stop:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.stopped_step = trainer.global_step
            if not stop_here:
                reason = (
                    f"EarlyStopping: another process asked to stop at epoch {trainer.current_epoch}, "
                    f"global step {trainer.global_step} ({self.monitor!r} = {current:.6g} here)."
                )
            self.stopping_reason = reason
        if reason:
            level = logging.WARNING if alarming else (logging.INFO if self.verbose else logging.DEBUG)
            self._log(trainer, reason, level)

    def _log(self, trainer: Trainer, message: str, level: int) -> None:
        """As Lightning's: in a multi-process run every rank logs, prefixed with its rank, unless
        ``log_rank_zero_only``."""
        if trainer.world_size > 1:
            if self.log_rank_zero_only and not trainer.is_global_zero:
                return
            message = f"[rank: {trainer.global_rank}] {message}"
        log.log(level, message)

    def _evaluate(self, current: float, trainer: Trainer) -> tuple[bool, str | None, bool]:
        """(stop?, message, alarming?) for the value ``current``; updates best and wait counters."""
        where = f"at epoch {trainer.current_epoch}, global step {trainer.global_step}"
        name = repr(self.monitor)
        if self.check_finite and not math.isfinite(current):
            return (
                True,
                (
                    f"EarlyStopping: monitored metric {name} = {current} is not finite {where}; stopping. "
                    f"Best value so far: {self._best:.6g}."
                ),
                True,
            )
        order = self.order_dict.get(self.mode, self.mode)
        if self.stopping_threshold is not None and self._better(current, self.stopping_threshold):
            return (
                True,
                (
                    f"EarlyStopping: {name} = {current:.6g} reached the stopping threshold "
                    f"({current:.6g} {order} {self.stopping_threshold}) {where}; stopping."
                ),
                False,
            )
        if self.divergence_threshold is not None and self._better(self.divergence_threshold, current):
            return (
                True,
                (
                    f"EarlyStopping: {name} = {current:.6g} crossed the divergence threshold "
                    f"({self.divergence_threshold} {order} {current:.6g}) {where}; stopping."
                ),
                True,
            )
        target = self._best - self.min_delta if self.monitor_op is torch.lt else self._best + self.min_delta
        if self._better(current, target):
            old, self._best, self.wait_count = self._best, current, 0
            change = f" (by {abs(old - current):.6g})" if math.isfinite(old) else ""
            return False, f"EarlyStopping: {name} improved{change} to {current:.6g} {where}.", False
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return (
                True,
                (
                    f"EarlyStopping: {name} did not improve on {self._best:.6g} for {self.wait_count} "
                    f"checks (patience {self.patience}) {where}; stopping."
                ),
                False,
            )
        return False, None, False

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "best_score": self._best,
            "patience": self.patience,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = state_dict["wait_count"]
        self.stopped_epoch = state_dict["stopped_epoch"]
        self._best = float(state_dict["best_score"])
        self.patience = state_dict.get("patience", self.patience)
