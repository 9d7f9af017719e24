"""How ModelCheckpoint puts files in place beside ``trainer.save_checkpoint``: the save point's file,
``last`` as a hard or symbolic link to the file just written (each made atomically), the removal of
files that left the top k (``CheckpointFiles``), all of it on the strategy's background writer with
``async_save`` (the save passes a ``BackgroundSave`` saying what to do once the file exists); and the
checkpoints written when fit raises (``save_on_exception``, ``OnExceptionCheckpoint``). The file
operations themselves are ``ember.checkpoint.files``."""

from __future__ import annotations

import inspect
import os
import re
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.callback import Callback
from ember.checkpoint.files import inside, link_atomic, remove_checkpoint
from ember.checkpoint.writer import BackgroundSave
from ember.exceptions import Preempted

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer

FILE_EXTENSION = ".ckpt"


def check_template(what: str, template: str, field: re.Pattern[str]) -> None:
    """Raise unless the file names ``template`` makes stay inside the checkpoint directory: not
    absolute, no ``..`` above it (a folder such as ``"sub/{epoch}"`` is fine). Outside it, top-k
    rotation would never remove them, ``"last"``/``"auto"`` would never find them, and they might land
    among another run's files."""
    name = field.sub("x", template)
    if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == os.pardir:
        raise ValueError(
            f"ModelCheckpoint({what}={template!r}) names a file outside the checkpoint directory. "
            "Checkpoints are rotated (save_top_k) and found again (ckpt_path='last' / 'auto') only "
            "inside that directory. Choose the directory with dirpath= and keep the name relative to "
            "it, without '..' (folders inside it, such as 'sub/{epoch}', are fine)."
        )


def check_inside(path: str, dirpath: str | None, template: str) -> str:
    """``path`` (normalised) when it is inside ``dirpath``; else an error naming the logged values' fault."""
    path = os.path.normpath(path)
    if dirpath and not inside(path, dirpath):
        raise ValueError(
            f"ModelCheckpoint(filename={template!r}) with this save's values names {path}, outside the "
            f"checkpoint directory {dirpath}: a logged value in the name contains '..' or a path "
            "separator. Leave that value out of the file name, or log a number instead."
        )
    return path


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


class CheckpointFiles:
    """ModelCheckpoint's file operations (a mixin): write a save point's top-k file and ``last``, then
    remove the previous ``last`` and the files that left the top k; with ``async_save``, all of that on
    the strategy's background writer, in that order, after one copy of the state."""

    # Set by ModelCheckpoint.
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
        if not self.async_save or primary is None:  # (only a link to make: nothing to write in the background)
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


def save_on_exception(trainer: Trainer, dirpath: str, name: str, exception: BaseException) -> None:
    if isinstance(exception, Preempted) or trainer.module is None:
        return  # preemption already saved at a step boundary
    if trainer.world_size > 1:
        # Saving gathers state from every rank; a rank that raised alone would leave the others waiting.
        warnings.warn(
            "Exception checkpoints are only written in single-process runs; use preemption (SIGTERM) "
            "for multi-process runs.",
            UserWarning,
        )
        return
    trainer.save_checkpoint(os.path.join(dirpath, name + FILE_EXTENSION))


class OnExceptionCheckpoint(Callback):
    """Write ``<dirpath>/<filename>.ckpt`` when fit raises (Ctrl-C included).

    The state is whatever it was when the exception arrived, which may be mid-step; resuming from
    it is exact only if the exception was raised at a step boundary (for clean stops, send SIGTERM:
    see ``ember.trainer.preemption``).

    Args:
        dirpath: the directory.
        filename: the file name without extension.
    """

    def __init__(self, dirpath: str | os.PathLike, filename: str = "on_exception") -> None:
        self.dirpath = os.path.abspath(os.fspath(dirpath))
        self.filename = filename

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        save_on_exception(trainer, self.dirpath, self.filename, exception)
