"""``OnExceptionCheckpoint``: write a checkpoint when fit raises; ``save_on_exception`` is what it (and
``ModelCheckpoint(save_on_exception=True)``) write."""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

from ember.callbacks.checkpoint_base import Checkpoint
from ember.checkpoint.files import FILE_EXTENSION
from ember.exceptions import Preempted
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer


def save_on_exception(trainer: Trainer, path: str, exception: BaseException) -> None:
    """Write the fit's state to ``path`` for ``exception`` (not for a preemption, which saved at a step boundary)."""
    if isinstance(exception, Preempted) or trainer.module is None:
        return  # preemption already saved at a step boundary
    if trainer.world_size > 1:
        # Saving gathers state from every rank; a rank that raised alone would leave the others waiting.
        warnings.warn(
            "Exception checkpoints are only written in single-process runs; use preemption (SIGTERM) "
            "for multi-process runs.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return
    trainer.save_checkpoint(path)


class OnExceptionCheckpoint(Checkpoint):
    """Write ``<dirpath>/<filename>.ckpt`` when fit raises (Ctrl-C included).

    The state is whatever it was when the exception arrived, which may be mid-step; resuming from
    it is exact only if the exception was raised at a step boundary (for clean stops, send SIGTERM:
    see ``ember.trainer.preemption``).

    Args:
        dirpath: the directory.
        filename: the file name without extension (not empty).
    """

    FILE_EXTENSION = FILE_EXTENSION

    def __init__(self, dirpath: str | os.PathLike, filename: str = "on_exception") -> None:
        if not filename:
            raise ValueError(
                "OnExceptionCheckpoint(filename=''): the file name cannot be empty; pass a name without the "
                "extension, such as 'on_exception' (the default)."
            )
        self.dirpath = os.path.abspath(os.path.expanduser(os.fspath(dirpath)))
        self.filename = filename

    @property
    def ckpt_path(self) -> str:
        """The file written on an exception: ``<dirpath>/<filename>.ckpt`` (as Lightning's)."""
        return os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        save_on_exception(trainer, self.ckpt_path, exception)
