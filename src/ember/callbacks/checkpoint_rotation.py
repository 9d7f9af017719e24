"""ModelCheckpoint's files at a save point (``CheckpointRotation``): which files it keeps (the best k by the
monitored value, with their scores), then the top-k file and ``last`` (a hard or symbolic link to the file
just written, each made atomically), then the removal of the previous ``last`` and of the files that left
the top k; with ``async_save``, all of it on the strategy's background writer (the save passes a
``BackgroundSave`` saying what to do once the file exists). Which files, and when, is decided here; the
file operations themselves are ``ember.checkpoint.files``. Also Lightning's public helpers on the top k:
``check_monitor_top_k``, ``file_exists`` and ``to_yaml``."""

from __future__ import annotations

import inspect
import math
import os
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ember.checkpoint.files import link_atomic, remove_checkpoint
from ember.checkpoint.writer import BackgroundSave
from ember.user_frames import user_stacklevel
from ember.yaml import to_yaml as yaml_text

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


# What names ModelCheckpoint's files: with async_save, the values after a save are published once its
# files exist (until then, those of the previous save point).
_LISTING = (
    "best_k_models",
    "kth_best_model_path",
    "kth_value",
    "best_model_path",
    "best_model_score",
    "current_score",
    "last_model_path",
    "_last_checkpoint_saved",
)


class CheckpointRotation:
    """ModelCheckpoint's files at a save point (a mixin; when to save is ``model_checkpoint.py``'s): name
    this save's ``last``, decide whether the save enters the top k (and which file leaves it), write the
    top-k file and ``last``, then remove the previous ``last`` and the files that left the top k; with
    ``async_save``, the writing and removing on the strategy's background writer, in that order, after one
    copy of the state."""

    # ModelCheckpoint's settings and state (``model_checkpoint.py``).
    CHECKPOINT_NAME_LAST: str
    monitor: str | None
    mode: str
    kth_best_model_path: str
    kth_value: torch.Tensor | None
    best_model_score: torch.Tensor | None
    current_score: torch.Tensor | None
    _validation_ran: bool
    _warned_missing: bool
    dirpath: str | None
    verbose: bool
    save_last: bool | str
    save_top_k: int
    save_weights_only: bool
    best_k_models: dict[str, torch.Tensor]
    best_model_path: str
    last_model_path: str
    _last_checkpoint_saved: str
    _replaced: list[str]
    async_save: bool

    def _listing(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name in _LISTING}
        state["best_k_models"] = dict(state["best_k_models"])
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, dict(value) if name == "best_k_models" else value)

    def _protected(self, trainer: Trainer) -> set[str]:
        return {os.path.abspath(p) for p in (trainer.ckpt_path, self.last_model_path, self.best_model_path) if p}

    def _say(self, trainer: Trainer, path: str, epoch: int | None = None, step: int | None = None) -> None:
        if self.verbose and trainer.is_global_zero:
            epoch = trainer.current_epoch if epoch is None else epoch
            step = trainer.global_step if step is None else step
            print(f"ModelCheckpoint: epoch {epoch}, step {step}: saved {path}")
        if trainer.is_global_zero:  # as Lightning: each logger hears of each file written
            for logger in trainer.loggers:
                logger.after_save_checkpoint(weakref.proxy(self))

    if TYPE_CHECKING:  # ModelCheckpoint's own: finish a write in flight, the values a file is named by, a name

        def _finish_write(self, trainer: Trainer) -> None: ...
        def _candidates(self, trainer: Trainer) -> dict[str, Any]: ...
        def _versioned(
            self, trainer: Trainer, metrics: dict[str, Any], filename: str | None, keep: str | None
        ) -> str: ...

    # ------------------------------------------------------------------ names
    def next_last_path(self, trainer: Trainer) -> str:
        """The path this callback's next ``last`` checkpoint gets now: ``CHECKPOINT_NAME_LAST`` formatted,
        with ``-v1``... beside an earlier run's file of that name (for a checkpoint written outside the
        callback, such as on preemption). Every process must call it (rank zero's answer is broadcast)."""
        self._finish_write(trainer)  # a last.ckpt still being written is this run's own, not an earlier run's
        return self._versioned(trainer, self._candidates(trainer), self.CHECKPOINT_NAME_LAST, keep=self.last_model_path)

    def _next_last(self, trainer: Trainer, metrics: dict[str, Any]) -> str:
        """Name this save's ``last`` (before any file is written, as every checkpoint holds
        ``last_model_path``); returns the previous one."""
        previous = self.last_model_path
        if self.save_last:
            self.last_model_path = self._versioned(trainer, metrics, self.CHECKPOINT_NAME_LAST, keep=previous)
        return previous

    # ------------------------------------------------------------------ the top k
    def check_monitor_top_k(self, trainer: Trainer, current: torch.Tensor | float | None = None) -> bool:
        """Whether a checkpoint scoring ``current`` would enter the top k now, as Lightning's.

        True while fewer than ``save_top_k`` are kept (always with -1); else whether ``current`` is better
        than the k-th best score, agreed by every process (all must say so). A NaN never beats it.

        Args:
            trainer: the trainer (its strategy agrees the answer across processes).
            current: the monitored value; None gives False.

        Returns:
            Whether ``current`` would enter the top k.
        """
        if current is None or self.save_top_k == 0:  # (Lightning raises a KeyError for save_top_k=0)
            return False
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        kth = self.best_k_models.get(self.kth_best_model_path)
        if kth is None:  # a top k listed by hand: its worst score is the k-th
            kth = self.best_k_models[self._worst()]
        op = torch.lt if self.mode == "min" else torch.gt
        better = bool(op(torch.as_tensor(current).detach().cpu(), torch.as_tensor(kth).cpu()))
        return trainer.strategy.reduce_boolean_decision(better)

    def file_exists(self, filepath: str | os.PathLike, trainer: Trainer) -> bool:
        """Whether ``filepath`` exists, as Lightning's: global rank zero looks, every process gets its answer.

        Args:
            filepath: the path to look at.
            trainer: the trainer (its strategy shares the answer).

        Returns:
            Whether the file exists (on rank zero's file system).
        """
        exists = os.path.exists(filepath) if trainer.is_global_zero else False
        return trainer.strategy.reduce_boolean_decision(exists, all=False)

    def to_yaml(self, filepath: str | os.PathLike | None = None) -> None:
        """Write ``best_k_models`` (checkpoint path: score) as YAML, as Lightning's.

        Args:
            filepath: the file to write; default ``<dirpath>/best_k_models.yaml``.

        Raises:
            ValueError: no ``filepath`` was given and ``dirpath`` is not known yet.
        """
        if filepath is None:
            if not self.dirpath:
                raise ValueError(
                    "ModelCheckpoint.to_yaml() has no file to write: this callback's dirpath is set when fit "
                    "starts. Pass to_yaml(filepath=...), or give ModelCheckpoint(dirpath=...)."
                )
            filepath = os.path.join(self.dirpath, "best_k_models.yaml")
        scores = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in self.best_k_models.items()}
        with open(filepath, "w", encoding="utf-8") as fh:
            fh.write(yaml_text(scores))

    def _monitored(self, trainer: Trainer, metrics: dict[str, Any], at_epoch_end: bool) -> float | None:
        if self.monitor in metrics:
            value = float(metrics[self.monitor])
            if math.isnan(value):  # a NaN never ranks as better
                value = math.inf if self.mode == "min" else -math.inf
            return value
        logged = sorted(k for k in metrics if k not in ("epoch", "step"))
        message = (
            f"ModelCheckpoint(monitor={self.monitor!r}) could not find {self.monitor!r} in the logged metrics. "
            f"Logged keys: {logged}. Log it with self.log({self.monitor!r}, value) in your module, or "
            "change monitor to one of the logged keys."
        )
        if self._validation_ran or at_epoch_end:
            raise ValueError(message)
        if not self._warned_missing:  # saving before the first validation: the key may not exist yet
            warnings.warn(message + " (Skipping top-k until it is logged.)", UserWarning, stacklevel=user_stacklevel())
            self._warned_missing = True
        return None

    def _save_top_k(self, trainer: Trainer, metrics: dict[str, Any], at_epoch_end: bool) -> str | None:
        if self.monitor is None:
            path = self._versioned(trainer, metrics, None, keep=self.best_model_path)
            previous = self.best_model_path
            self.best_model_path = path
            if self.save_top_k == 1 and previous and previous != path:
                self._replaced.append(previous)
            return path
        value = self._monitored(trainer, metrics, at_epoch_end)
        if value is None:
            return None
        full = self.save_top_k != -1 and len(self.best_k_models) >= self.save_top_k
        if full and not self._better(value, None if self.kth_value is None else float(self.kth_value)):
            return None
        self.current_score = self._score(metrics[self.monitor], value)
        path = self._versioned(trainer, metrics, None, keep=self._worst() if full else None)
        self.best_k_models[path] = self.current_score
        dropped = None
        if self.save_top_k != -1 and len(self.best_k_models) > self.save_top_k:
            dropped = self._worst()
            del self.best_k_models[dropped]
        if self.save_top_k == -1 or len(self.best_k_models) == self.save_top_k:  # as Lightning: once k are kept
            worst = self._worst()
            self.kth_best_model_path, self.kth_value = worst, self.best_k_models[worst]
        pick = min if self.mode == "min" else max
        best = pick(self.best_k_models, key=lambda k: float(self.best_k_models[k]))
        self.best_model_path = best
        self.best_model_score = self.best_k_models[best]
        if dropped is not None and dropped != path:
            self._replaced.append(dropped)
        return path

    @staticmethod
    def _score(logged: Any, value: float) -> torch.Tensor:
        """The monitored value as a tensor (as Lightning keeps it): the logged tensor itself, on the CPU;
        a NaN is kept as the +-inf it ranks as."""
        if isinstance(logged, torch.Tensor) and logged.numel() == 1 and not math.isnan(float(logged)):
            return logged.detach().to("cpu").reshape(())
        return torch.tensor(value)

    def _better(self, value: float, than: float | None) -> bool:
        if than is None:
            return True
        return value < than if self.mode == "min" else value > than

    def _worst(self) -> str:
        pick = max if self.mode == "min" else min
        return pick(self.best_k_models, key=lambda k: float(self.best_k_models[k]))

    # ------------------------------------------------------------------ the files
    def _put_files(self, trainer: Trainer, written: str | None, previous_last: str, before: dict[str, Any]) -> None:
        """Write this save point's files: the top-k file ``written`` (None: none) and ``last_model_path``
        (named by ``_next_last``, when ``save_last``), then remove ``previous_last`` and ``_replaced``.
        ``before`` is ``_listing()`` from before this save's decisions."""
        if written is not None:
            self._last_checkpoint_saved = written
        last = self.last_model_path if self.save_last else None
        link: tuple[str, bool] | None = None  # (source, symbolic): ``last`` as a link, not a second write
        if last is not None:
            if self.save_last == "link" and self._last_checkpoint_saved and self.save_top_k != 0:
                link = (self._last_checkpoint_saved, True)
            elif written is not None:
                link = (written, False)
        primary = written if written is not None else (last if link is None else None)
        # (Only a link to make: nothing to write in the background. A strategy whose ranks all write, fsdp's
        # sharded checkpoints, writes at once.)
        if not self.async_save or primary is None or not trainer.strategy.background_saves:
            self._put_files_now(trainer, written, previous_last)
            return
        # Decided here, with this save's lists; done on the background thread once ``primary`` is complete,
        # so a file is never linked or rotated out before the one replacing it exists.
        protected, dirpath = self._protected(trainer), self.dirpath
        gone = list(self._replaced)
        if last is not None and previous_last and previous_last != last and previous_last not in self.best_k_models:
            gone.insert(0, previous_last)

        def after(write: Callable[[str], None]) -> None:
            if last is not None and last != primary:
                if link is None or not link_atomic(link[0], last, symbolic=link[1]):
                    write(last)
            for path in gone:
                remove_checkpoint(path, dirpath, protected)

        published = self._listing()
        epoch, step = trainer.current_epoch, trainer.global_step

        def on_done() -> None:  # in the training thread, once the files exist
            self._restore(published)
            for path in dict.fromkeys(p for p in (primary, last) if p is not None):
                self._say(trainer, path, epoch, step)

        background = BackgroundSave(after, on_done)
        if not _takes_storage_options(trainer):
            raise RuntimeError(_BYPASSED.format(path=primary, cls=type(trainer).__name__))
        trainer.save_checkpoint(primary, weights_only=self.save_weights_only, storage_options=background)
        if trainer.is_global_zero and not background.submitted:
            raise RuntimeError(_BYPASSED.format(path=primary, cls=type(trainer).__name__))
        if trainer.strategy.background_writer.pending:  # until the write completes, the lists name the files that exist
            self._restore(before)

    def _put_files_now(self, trainer: Trainer, written: str | None, previous_last: str) -> None:
        if written is not None:
            trainer.save_checkpoint(written, weights_only=self.save_weights_only)
            self._say(trainer, written)
        if self.save_last:
            self._write_last(trainer, written, previous_last)
        # Files that left the top k go only now, once ``last`` no longer names (or links to) them.
        for path in self._replaced:
            self._remove(trainer, path)

    def _write_last(self, trainer: Trainer, written: str | None, previous: str) -> None:
        """Put ``last_model_path`` (named by ``_next_last``) in place, then remove this run's previous one."""
        last = self.last_model_path
        linked = False
        if trainer.is_global_zero:
            if self.save_last == "link" and self._last_checkpoint_saved and self.save_top_k != 0:
                linked = link_atomic(self._last_checkpoint_saved, last, symbolic=True)
            elif written is not None:
                linked = link_atomic(written, last)
        if not trainer.strategy.broadcast(linked):
            trainer.save_checkpoint(last, weights_only=self.save_weights_only)
        self._say(trainer, last)
        if previous and previous != last and previous not in self.best_k_models:
            self._remove(trainer, previous)

    def _remove(self, trainer: Trainer, path: str) -> None:
        if trainer.is_global_zero:
            remove_checkpoint(path, self.dirpath, self._protected(trainer))


_BYPASSED = (
    "ModelCheckpoint(async_save=True): the save of {path} did not go through ember's Trainer.save_checkpoint "
    "({cls}.save_checkpoint is overridden and does not pass storage_options on to it), so it was not written "
    "in the background and last.ckpt and top-k rotation could not follow it. Keep Trainer.save_checkpoint "
    "(or pass storage_options to super().save_checkpoint), or use async_save=False."
)


def _takes_storage_options(trainer: Trainer) -> bool:
    try:
        return "storage_options" in inspect.signature(trainer.save_checkpoint).parameters
    except (TypeError, ValueError):  # no signature to read: let the call say what is wrong
        return True
