"""The members of Lightning's ``ProgressBar`` base that ember's bars share: the attached ``trainer``, the
stage descriptions, the batch totals, the evaluation loader tracker, ``enable`` / ``disable`` and
``get_metrics`` (the items shown after the training bar, "v_num" included, what users override).

They read the trainer only; the drawing is ``ProgressBar``'s (progress_bar.py).
"""

from __future__ import annotations

from typing import Any

from ember.callbacks.callback import Callback
from ember.metric_values import to_floats
from ember.user_frames import user_stacklevel
from ember.utilities.rank_zero import rank_zero_warn


def get_standard_metrics(trainer: Any) -> dict[str, int | str]:
    """The items every bar shows: "v_num", the loggers' version (the last 4 characters of a string version;
    several loggers' versions joined by "_", duplicates dropped), when a logger has one."""
    items: dict[str, int | str] = {}
    loggers = list(getattr(trainer, "loggers", None) or [])
    if not loggers:
        return items
    if len(loggers) == 1:
        version = loggers[0].version
    else:
        version = "_".join(dict.fromkeys(str(logger.version) for logger in loggers))
    if version not in ("", None):
        items["v_num"] = version[-4:] if isinstance(version, str) else version
    return items


class ProgressBarMembers(Callback):
    """Lightning's ``ProgressBar`` base members (ember's ``ProgressBar`` derives from this)."""

    _trainer: Any = None
    _current_eval_dataloader_idx: int | None = None
    _enabled: bool = True  # Lightning's switch: disable() / enable(); the bar is off on other ranks
    refresh_rate: int

    # ------------------------------------------------------------------ the trainer and the words
    @property
    def trainer(self) -> Any:
        """The trainer this bar is attached to (set when a run sets it up)."""
        if self._trainer is None:
            raise TypeError(f"The `{self.__class__.__name__}._trainer` reference has not been set yet.")
        return self._trainer

    @property
    def sanity_check_description(self) -> str:
        return "Sanity Checking"

    @property
    def train_description(self) -> str:
        return "Training"

    @property
    def validation_description(self) -> str:
        return "Validation"

    @property
    def test_description(self) -> str:
        return "Testing"

    @property
    def predict_description(self) -> str:
        return "Predicting"

    # ------------------------------------------------------------------ totals
    @property
    def total_train_batches(self) -> int | float:
        """The training batches of an epoch (``inf`` for a loader without a length); with ``max_epochs=-1`` and a
        ``max_steps``, no more than the steps left."""
        trainer = self.trainer
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            return min(trainer.num_training_batches, trainer.max_steps - trainer.global_step)
        return trainer.num_training_batches

    @property
    def total_val_batches(self) -> int | float:
        """The batches of all validation loaders, 0 in an epoch that does not validate."""
        trainer = self.trainer
        every = trainer.check_val_every_n_epoch
        if not trainer.enable_validation or (every is not None and (trainer.current_epoch + 1) % every):
            return 0
        batches = trainer.num_val_batches
        return sum(batches) if isinstance(batches, list) else batches

    def _current(self, batches: Any) -> int | float:
        if isinstance(batches, list):
            assert self._current_eval_dataloader_idx is not None
            return batches[self._current_eval_dataloader_idx]
        return batches

    @property
    def total_val_batches_current_dataloader(self) -> int | float:
        """The batches of the validation loader being run (of the sanity check while it runs)."""
        trainer = self.trainer
        return self._current(trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches)

    @property
    def total_test_batches_current_dataloader(self) -> int | float:
        """The batches of the test loader being run."""
        return self._current(self.trainer.num_test_batches)

    @property
    def total_predict_batches_current_dataloader(self) -> int | float:
        """The batches of the predict loader being run."""
        return self._current(self.trainer.num_predict_batches)

    def has_dataloader_changed(self, dataloader_idx: int) -> bool:
        """Record the evaluation loader being run; whether it differs from the one recorded before."""
        old, self._current_eval_dataloader_idx = self._current_eval_dataloader_idx, dataloader_idx
        return old != dataloader_idx

    def reset_dataloader_idx_tracker(self) -> None:
        self._current_eval_dataloader_idx = None

    # ------------------------------------------------------------------ on / off
    @property
    def is_enabled(self) -> bool:
        """Whether the bar shows progress: not disabled, and ``refresh_rate`` above 0."""
        return self._enabled and self.refresh_rate > 0

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    def disable(self) -> None:
        """Turn the bar off: no new bar or line is drawn, and open ones are no longer updated."""
        self._enabled = False

    def enable(self) -> None:
        """Turn the bar back on (the trainer's ranks other than zero stay off: their ``setup`` disables them)."""
        self._enabled = True

    # ------------------------------------------------------------------ what the bar shows
    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, int | str | float | dict[str, float]]:
        """The items shown after the training bar: the ``prog_bar`` metrics (as numbers) and "v_num", the
        logger's version. Override it to change them, e.g. ``items.pop("v_num", None)`` to hide the version."""
        standard = get_standard_metrics(trainer)
        pbar_metrics = trainer.progress_bar_metrics
        duplicates = list(standard.keys() & pbar_metrics.keys())
        if duplicates:
            rank_zero_warn(
                f"The progress bar already tracks a metric with the name(s) '{', '.join(duplicates)}' and"
                f" `self.log('{duplicates[0]}', ..., prog_bar=True)` will overwrite this value. "
                " If this is undesired, change the name or override `get_metrics()` in the progress bar callback.",
                stacklevel=user_stacklevel() + 3,
            )
        return {**standard, **to_floats(pbar_metrics)}
