"""ModelCheckpoint: save the training state on a cadence, keep the best k, keep ``last.ckpt``.

Every write is atomic (see ``ember.checkpoint``), and checkpoints are written only where
a resume continues exactly: at a step boundary (after the optimizer step, the step-interval LR
schedulers and any validation of that batch), at the end of a validation, or at the end of a
training epoch. A resumed fit does not repeat a validation or an epoch end that already ran.

Differences from Lightning, on purpose:

- ``save_last`` defaults to True, so ``fit(..., ckpt_path="last")`` always has something to resume
  from, and ``last.ckpt`` is refreshed at every save point (each epoch end or validation, and each
  step/time cadence save) whether or not a top-k file is written there, as Lightning documents
  ("every_n_epochs ... does not impact the saving of save_last=True checkpoints"). Lightning 2.6.6
  refreshes it only together with a top-k file, so there a monitored value that stops improving
  leaves ``last.ckpt`` at the best epoch, and resuming from "last" repeats the epochs after it.
  ``last.ckpt`` is a hard link to the checkpoint just written when possible (no second write).
- Slashes in metric names become ``_`` in file names (``{val/acc}`` -> ``val_acc=0.812``) instead
  of creating directories.
- A file that was resumed from is never deleted by top-k rotation, and no file outside the
  directory this run writes to is ever deleted, whatever a restored checkpoint lists.
- One run at a time writes into a directory: ``setup`` takes a lock on it, and a second live run
  aiming at the same directory gets a clear error at start-up instead of overwriting the first
  run's files. The lock is released when the fit ends; callbacks and fits of one process share
  it. Temporary files left there by a writer that died are removed; those of a live writer never
  are.
"""

from __future__ import annotations

import datetime
import math
import os
import re
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.checkpoint_base import Checkpoint
from ember.callbacks.checkpoint_rotation import CheckpointRotation
from ember.callbacks.on_exception_checkpoint import OnExceptionCheckpoint, save_on_exception
from ember.checkpoint.atomic import unwritable
from ember.checkpoint.files import check_inside, check_template
from ember.checkpoint.lock import DirectoryLock
from ember.checkpoint.temporaries import remove_stale_temporaries
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer
    from ember.types import Stage

__all__ = ["ModelCheckpoint", "OnExceptionCheckpoint"]

_FIELD = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")


class ModelCheckpoint(CheckpointRotation, Checkpoint):
    """Save checkpoints during ``fit``.

    Args:
        dirpath: directory for the files; default ``<logger version dir>/checkpoints`` with a logger,
            else ``<default_root_dir>/checkpoints``.
        filename: a template such as ``"{epoch}-{val/acc:.3f}"``; each ``{name[:format]}`` is the
            epoch, the global step or a logged metric. Default ``"{epoch}-{step}"``.
        monitor: the logged metric ranking checkpoints for ``save_top_k``; None keeps the latest.
        verbose: print a line for every file written.
        save_last: also keep ``last.ckpt`` (the most recent save point), updated atomically; "link": make
            it a symbolic link to the last top-k file written (a full write when none was written yet,
            or with ``save_top_k=0``). Its name is ``CHECKPOINT_NAME_LAST``, a template like ``filename``
            (``"last-{epoch}"``); a previous ``last`` of this run is removed when the name changes.
        save_top_k: how many checkpoints to keep (-1: all, 0: none except ``last``).
        save_weights_only: save the module's weights only (cannot resume a fit).
        mode: "min" or "max": which ``monitor`` values are better.
        auto_insert_metric_name: write ``name=value`` instead of only ``value`` for each template field.
        every_n_train_steps: save every n optimizer steps.
        train_time_interval: save when this much time (a timedelta or seconds) has passed since the last save.
            Under ddp rank zero's clock decides, and every rank saves one step boundary after it said so:
            its answer travels in the background on the CPU (``Strategy.start_decision``), so no rank waits.
        every_n_epochs: save every n epochs (default 1 when no other cadence is given).
        save_on_train_epoch_end: save at the end of the training epoch instead of after validation
            (default: only when no validation runs).
        save_on_exception: also write ``on_exception.ckpt`` when fit raises (Ctrl-C included).
        enable_version_counter: add ``-v1``, ``-v2``... when a file name is already taken (by an earlier
            run in the same directory, or by a checkpoint of this run that is kept), as Lightning does.
        async_save: write the files on a background thread: at the save point the state is copied (to
            pinned CPU memory from CUDA, on the current stream), before any other code runs, so the file is
            what a synchronous save writes there; training continues during the write; at most one write is
            in flight. ``best_model_path``, ``last_model_path`` and the top-k list name a new file only once
            it is on disk, and a replaced file is deleted only then. A failed write is raised at the next
            step boundary or save, or at the end of fit. Off by default because it is not free of
            trade-offs: a copy of the whole checkpoint (weights and optimizer state) stays in host memory
            (pinned, on CUDA) for the rest of the fit; code that reads a checkpoint file or
            ``best_model_path`` right after a save point sees the previous one until the write completes;
            a failing write (a full disk) is reported some steps later; and the write competes with data
            loading for CPU and disk.
    """

    monitors_metrics = True
    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | str | None = True,
        save_top_k: int = 1,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: datetime.timedelta | float | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        save_on_exception: bool = False,
        enable_version_counter: bool = True,
        async_save: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint mode must be 'min' or 'max', got {mode!r}.")
        if not isinstance(save_top_k, int) or isinstance(save_top_k, bool) or save_top_k < -1:
            raise ValueError(f"ModelCheckpoint save_top_k must be an int >= -1 (-1 keeps all), got {save_top_k!r}.")
        if monitor is None and save_top_k not in (-1, 0, 1):
            raise ValueError(
                f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None): keeping the best {save_top_k} "
                "needs a metric to rank them by. Set monitor='...' or use save_top_k=1 (latest) / -1 "
                "(all)."
            )
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"ModelCheckpoint {name} must be a non-negative int or None, got {value!r}.")
        if isinstance(train_time_interval, (int, float)) and not isinstance(train_time_interval, bool):
            train_time_interval = datetime.timedelta(seconds=train_time_interval)
        if train_time_interval is not None and (
            not isinstance(train_time_interval, datetime.timedelta) or train_time_interval.total_seconds() <= 0
        ):
            raise ValueError(
                f"ModelCheckpoint train_time_interval must be a positive timedelta or number of seconds, "
                f"got {train_time_interval!r}."
            )
        if not isinstance(async_save, bool):
            raise ValueError(f"ModelCheckpoint async_save must be True or False, got {async_save!r}.")
        if save_last not in (True, False, None, "link"):
            raise ValueError(f"ModelCheckpoint save_last must be True, False or 'link', got {save_last!r}.")
        given = [
            n
            for n, v in (
                ("every_n_train_steps", every_n_train_steps),
                ("every_n_epochs", every_n_epochs),
                ("train_time_interval", train_time_interval),
            )
            if v
        ]
        if len(given) > 1:
            raise ValueError(f"ModelCheckpoint: {', '.join(given)} are mutually exclusive; choose one cadence.")
        self.dirpath: str | None = None if dirpath is None else os.path.abspath(os.path.expanduser(dirpath))
        self._dirpath_given = self.dirpath is not None  # else resolved from the logger at every fit
        if filename is not None:
            check_template("filename", filename, _FIELD)
        self._lock: DirectoryLock | None = None
        self.filename = filename
        self.monitor = monitor
        self.verbose = verbose
        self.save_last: bool | str = save_last if save_last == "link" else bool(save_last)
        self.save_top_k = save_top_k
        self.save_weights_only = save_weights_only
        self.mode = mode
        self.auto_insert_metric_name = auto_insert_metric_name
        self.every_n_train_steps = every_n_train_steps or 0
        self.train_time_interval = train_time_interval
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None else (0 if given else 1)
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.save_on_exception = save_on_exception
        self.enable_version_counter = enable_version_counter
        #: Write this callback's files on the strategy's ``background_writer`` (``BackgroundSave``).
        self.async_save = async_save

        self.best_k_models: dict[str, torch.Tensor] = {}  # path -> score, tensors as Lightning's
        self.kth_best_model_path = ""
        # As Lightning: the worst score of a full top k, +-inf (the worst possible) until k are kept.
        self.kth_value: torch.Tensor | None = torch.tensor(math.inf if mode == "min" else -math.inf)
        self.best_model_path = ""
        self.best_model_score: torch.Tensor | None = None
        self.current_score: torch.Tensor | None = None
        self.last_model_path = ""
        self._last_global_step_saved = -1
        self._last_checkpoint_saved = ""  # the last top-k file written: what save_last="link" points to
        self._saved_in_fit = False
        self._replaced: list[str] = []  # top-k files replaced by this save, removed once last is in place
        self._last_time = time.monotonic()
        self._saves = 0  # calls of _save: a time vote started before the latest one is stale
        self._time_vote: tuple[Any, int] | None = None  # under ddp: (rank zero's "due?" in flight, _saves then)
        self._validation_ran = False
        self._warned_missing = False

    @property
    def dirpath_given(self) -> bool:
        """Whether ``dirpath`` was given when the callback was made; else it is resolved from the first
        logger (or ``default_root_dir``) at every fit, and ``ckpt_path="last"`` looks in every run's."""
        return self._dirpath_given

    # ------------------------------------------------------------------ identity and state
    def _state_key_args(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "every_n_train_steps": self.every_n_train_steps,
            "every_n_epochs": self.every_n_epochs,
            "train_time_interval": self.train_time_interval.total_seconds() if self.train_time_interval else None,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "dirpath": self.dirpath,
            # As Lightning: the scores are tensors (the logged values themselves: a float32 tensor compares
            # equal to the number logged).
            "best_k_models": {k: _cpu(v) for k, v in self.best_k_models.items()},
            "kth_best_model_path": self.kth_best_model_path,
            "kth_value": _cpu(self.kth_value),
            "best_model_path": self.best_model_path,
            "best_model_score": _cpu(self.best_model_score),
            "current_score": _cpu(self.current_score),
            "last_model_path": self.last_model_path,
            "last_global_step_saved": self._last_global_step_saved,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._last_global_step_saved = state.get("last_global_step_saved", -1)
        if state.get("dirpath") != self.dirpath:
            # Another directory's files are that run's: listing them here would let top-k rotation
            # delete them. Only where the best model was is kept, as information (as Lightning does).
            warnings.warn(
                "ModelCheckpoint: the checkpoint's callback state is for directory "
                f"{state.get('dirpath')!r}, this one writes to {self.dirpath!r}; its top-k list is not "
                "carried over (and none of that directory's files will be deleted).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
            self.best_model_path = state.get("best_model_path", "")
            return
        score = state.get("best_model_score")
        self.best_model_score = None if score is None else torch.as_tensor(score)
        self.best_model_path = state.get("best_model_path", "")
        self.best_k_models = {k: torch.as_tensor(v) for k, v in state.get("best_k_models", {}).items()}
        self.kth_best_model_path = state.get("kth_best_model_path", "")
        kth = state.get("kth_value")
        self.kth_value = None if kth is None else torch.as_tensor(kth)
        self.last_model_path = state.get("last_model_path", "")

    # ------------------------------------------------------------------ hooks
    def _resolve_dirpath(self, trainer: Trainer) -> str:
        if self._dirpath_given and self.dirpath is not None:
            return self.dirpath
        # As Lightning: <save_dir>/<name>/<version>/checkpoints of the first logger (default_root_dir in
        # place of a save_dir it does not have), or <default_root_dir>/checkpoints without a logger.
        if not trainer.loggers:
            return os.path.abspath(os.path.join(trainer.default_root_dir, "checkpoints"))
        first = trainer.loggers[0]
        base = first.log_dir or first.run_dir(trainer.default_root_dir)
        return os.path.abspath(os.path.join(base, "checkpoints"))

    def setup(self, trainer: Trainer, module: TrainModule, stage: Stage) -> None:
        if stage != "fit":
            return
        for what, template in (("filename", self.filename), ("CHECKPOINT_NAME_LAST", self.CHECKPOINT_NAME_LAST)):
            if template:  # (both may have been changed since __init__)
                check_template(what, template, _FIELD)
        self.dirpath = trainer.strategy.broadcast(self._resolve_dirpath(trainer))
        self._validation_ran = False
        self._saved_in_fit = False
        holder = problem = None
        if trainer.is_global_zero and not trainer.fast_dev_run:  # (which writes nothing: no lock, no directory)
            # Found now rather than at the first save, an epoch later: a directory that cannot be written.
            err = unwritable(self.dirpath)
            if err is not None:
                problem = (err.errno, f"{type(err).__name__}: {err.strerror or err}")
            else:
                self._lock = DirectoryLock(self.dirpath)
                holder = self._lock.acquire()
                if holder is None:
                    remove_stale_temporaries(self.dirpath)
                else:
                    self._lock = None
        holder, problem = trainer.strategy.broadcast((holder, problem))
        if problem is not None:
            message = (
                f"Checkpoints cannot be written into {self.dirpath} ({problem[1]}). Found before training "
                "started, so nothing is lost: make that directory writable, or write checkpoints elsewhere "
                "(ModelCheckpoint(dirpath=...), Trainer(default_root_dir=...))."
            )
            raise OSError(problem[0], message) if problem[0] is not None else OSError(message)
        if holder is not None:
            raise RuntimeError(
                f"Another run ({holder}) is writing checkpoints into {self.dirpath}. Two runs writing into one "
                "directory would overwrite and delete each other's files, so this one stops before writing anything. "
                "Wait for that run to end, or give this one its own directory: another default_root_dir, "
                "ModelCheckpoint(dirpath=...), or a logger version of its own."
            )

    def teardown(self, trainer: Trainer, module: TrainModule, stage: Stage) -> None:
        try:
            if self.async_save:  # no thread outlives the fit, and the buffers are freed
                self._warn_failed(trainer.strategy.background_writer.close())
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._last_time = time.monotonic()
        self._time_vote = None

    def on_train_step_boundary(self, trainer: Trainer, module: TrainModule) -> None:
        if self.async_save:
            trainer.strategy.background_writer.collect()  # publish a finished write's files, or raise its error
        step = trainer.global_step
        if step == self._last_global_step_saved:
            return
        due = bool(self.every_n_train_steps) and step % self.every_n_train_steps == 0
        interval = self.train_time_interval.total_seconds() if self.train_time_interval is not None else None
        # Ranks' clocks differ: under ddp rank zero decides for everyone, one boundary late (no rank waits).
        voting = interval is not None and trainer.world_size > 1
        if voting:
            due = self._time_vote_says_due() or due
        elif not due and interval is not None:
            due = time.monotonic() - self._last_time >= interval
        if due:
            self._save(trainer, at_epoch_end=False)
        if interval is not None and voting:  # after any save, so the clock it reads has been reset
            over = time.monotonic() - self._last_time >= interval
            self._time_vote = (trainer.strategy.start_decision(over, "rank_zero"), self._saves)

    def _time_vote_says_due(self) -> bool:
        """Rank zero's answer from the previous boundary; stale (False) if a save came since."""
        vote, self._time_vote = self._time_vote, None
        if vote is None:
            return False
        decision, saves = vote
        return decision.result() and saves == self._saves

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        if trainer.sanity_checking or trainer.state != "fitting":
            return
        self._validation_ran = True
        if not self._on_train_epoch_end(trainer):
            self._save_point(trainer, at_epoch_end=False)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._on_train_epoch_end(trainer):
            self._save_point(trainer, at_epoch_end=True)

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._time_vote is not None:  # every rank started it: wait for it, leaving no collective running
            self._time_vote_says_due()
        # As Lightning: a fit in which no save point came (every cadence disabled, or never due)
        # still leaves a ``last`` checkpoint of its final state.
        if self.save_last and not self._saved_in_fit and trainer.global_step != self._last_global_step_saved:
            self._save(trainer, at_epoch_end=False, last_only=True)
        if self.async_save:
            self._finish_write(trainer)  # what fit wrote is on disk (or its failure raised) when fit returns,
            trainer.strategy.barrier("async checkpoint")  # on every rank, as after a synchronous save

    def on_fit_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._finish_write(trainer)

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        self._time_vote = None  # not waited for: a rank that failed may never have sent its part
        if self.async_save:  # the exception is what fit raises; a failed write is a warning
            self._warn_failed(trainer.strategy.background_writer.wait(raise_errors=False))
        if self.save_on_exception and not trainer.fast_dev_run:  # named by `filename` (as Lightning), never over a file
            self.dirpath = self.dirpath or self._resolve_dirpath(trainer)  # (an exception before setup resolved it)
            save_on_exception(trainer, self._versioned(trainer, self._candidates(trainer), None, None), exception)

    def _finish_write(self, trainer: Trainer) -> None:
        """Wait for the background write in flight (if any), publish its files, raise its error."""
        if self.async_save:
            trainer.strategy.background_writer.wait()

    def _warn_failed(self, error: BaseException | None) -> None:
        if error is not None:
            warnings.warn(
                f"ModelCheckpoint: a checkpoint written in the background failed ({type(error).__name__}: "
                f"{error}); the previous files under its names are intact.",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )

    # ------------------------------------------------------------------ when
    def _epoch_due(self, trainer: Trainer) -> bool:
        return self.every_n_epochs >= 1 and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def _on_train_epoch_end(self, trainer: Trainer) -> bool:
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        # As Lightning: at the end of the training epoch (after on_train_epoch_end and the epoch's scheduler
        # step) when validation runs once per epoch at its end, or not at all; otherwise after validation.
        if trainer.check_val_every_n_epoch != 1:
            return False
        if not any(trainer.num_val_batches):
            return True
        return isinstance(trainer.val_check_interval, float) and trainer.val_check_interval == 1.0

    def _save_point(self, trainer: Trainer, at_epoch_end: bool) -> None:
        """An epoch end or a validation end: top-k (and last) when ``every_n_epochs`` is due; else
        only ``last``, which ignores ``every_n_epochs`` (once per global step)."""
        if self._epoch_due(trainer):
            self._save(trainer, at_epoch_end=at_epoch_end)
        elif self.save_last and trainer.global_step != self._last_global_step_saved:
            self._save(trainer, at_epoch_end=False, last_only=True)

    # ------------------------------------------------------------------ what
    def _candidates(self, trainer: Trainer) -> dict[str, Any]:
        metrics = {k: v for k, v in trainer.callback_metrics.items()}
        metrics.setdefault("epoch", trainer.current_epoch)
        metrics.setdefault("step", trainer.global_step)
        return metrics

    def _save(self, trainer: Trainer, at_epoch_end: bool, last_only: bool = False) -> None:
        """Every save point's save: the top k (unless ``last_only``) and ``last``; none under fast_dev_run."""
        if trainer.fast_dev_run:  # as Lightning: a smoke run of a batch or two writes no checkpoint
            return
        # This callback's state is updated *before* each write: the checkpoint holds it, and must
        # already list the file it is written to (or a resumed run would orphan that file). With
        # async_save, the previous write completes first, so these decisions see its files.
        self._finish_write(trainer)
        before = self._listing()
        metrics = self._candidates(trainer)
        self._last_global_step_saved = trainer.global_step
        self._saved_in_fit = True
        if not last_only:
            self._last_time = time.monotonic()
            self._saves += 1
        previous_last = self._next_last(trainer, metrics)
        written: str | None = None
        if not last_only:
            self._replaced = []
            if self.save_top_k != 0:
                written = self._save_top_k(trainer, metrics, at_epoch_end)
        self._put_files(trainer, written, previous_last, before)

    # ------------------------------------------------------------------ names
    def format_checkpoint_name(
        self, metrics: dict[str, Any], filename: str | None = None, ver: int | None = None, prefix: str | None = None
    ) -> str:
        """The file path for ``metrics`` under this callback's template (and version ``ver``); a ``prefix``
        goes in front of the name, joined with ``CHECKPOINT_JOIN_CHAR`` (as Lightning's)."""
        template = filename or self.filename or "{epoch}" + self.CHECKPOINT_JOIN_CHAR + "{step}"

        def field(match: re.Match[str]) -> str:
            name, spec = match.group(1).strip(), (match.group(2) or "")[1:]
            if name not in metrics:
                logged = sorted(k for k in metrics if k not in ("epoch", "step"))
                raise ValueError(
                    f"ModelCheckpoint(filename={template!r}) uses {{{name}}}, which was not logged. "
                    f"Available: epoch, step and the logged keys {logged}."
                )
            value = metrics[name]
            if isinstance(value, torch.Tensor):
                value = value.item()
            text = format(value, spec) if spec else str(value)
            safe = name.replace("/", "_").replace("\\", "_")
            return f"{safe}{self.CHECKPOINT_EQUALS_CHAR}{text}" if self.auto_insert_metric_name else text

        name = _FIELD.sub(field, template)
        if prefix is not None:
            name = self.CHECKPOINT_JOIN_CHAR.join([prefix, name])
        if ver is not None:
            name += f"{self.CHECKPOINT_JOIN_CHAR}v{ver}"
        return check_inside(os.path.join(self.dirpath or "", name + self.FILE_EXTENSION), self.dirpath, template)

    def _versioned(self, trainer: Trainer, metrics: dict[str, Any], filename: str | None, keep: str | None) -> str:
        """The path for ``metrics`` under ``filename`` (None: this callback's template). As Lightning's: a
        name that exists already gets ``-v1``, ``-v2``... unless it is ``keep``, this callback's own file
        that the new one replaces; so a second run in the same directory writes ``epoch=1-step=8-v1.ckpt``
        and ``last-v1.ckpt`` beside the first run's files. Rank zero looks; every rank gets its answer."""
        path = self.format_checkpoint_name(metrics, filename)
        if self.enable_version_counter and trainer.is_global_zero:
            version = self.STARTING_VERSION
            while os.path.lexists(path) and path != keep:
                path = self.format_checkpoint_name(metrics, filename, ver=version)
                version += 1
        return trainer.strategy.broadcast(path)


def _cpu(score: torch.Tensor | None) -> torch.Tensor | None:
    """A score as a checkpoint holds it: a tensor of its own on the CPU (None stays None). Scores are kept on
    the CPU already (``_score``), so a save copies nothing from a device here."""
    if score is None:
        return None
    score = torch.as_tensor(score).detach()
    return (score if score.device.type == "cpu" else score.to("cpu")).clone()
