"""Checkpoint writers: what the strategy hands a finished checkpoint dict to on global rank zero.

Two implementations of one small interface (:meth:`write`, :meth:`wait`, :meth:`collect`,
:meth:`close`), as Lightning Fabric's ``CheckpointIO`` and its ``AsyncCheckpointIO`` wrapper:

- :class:`CheckpointWriter` (this module) writes at once with ``write_atomic`` (temporary file,
  fsync, rename), then runs the caller's ``after`` and ``on_done`` steps;
- ``BackgroundWriter`` (``background.py``) copies the checkpoint off the live state and writes the
  copy on a thread, running ``after`` there and ``on_done`` in the training thread once the write
  is collected.

The strategy holds one of each (``Strategy.checkpoint_writer``, and ``Strategy.background_writer``
made on first use). A save picks the background one only when the caller asks for it, with a
:class:`BackgroundSave` passed as ``storage_options`` to ``Trainer.save_checkpoint`` (Lightning's
argument for "how to save to storage"): everything a writer needs travels as arguments, from the
callback that decides the save down to the writer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ember.checkpoint.atomic import write_atomic

#: ``after(write)`` runs once the checkpoint is complete on disk; ``write(path)`` writes the same
#: checkpoint atomically to another path.
After = Callable[[Callable[[str], None]], None]


@dataclass
class BackgroundSave:
    """``Trainer.save_checkpoint(path, storage_options=BackgroundSave(...))``: write this save on the
    strategy's background writer (``ModelCheckpoint(async_save=True)`` passes one).

    Args:
        after: run on the writer's thread once the file is complete (links, rotation), with a function
            that writes the same checkpoint to another path.
        on_done: run in the training thread when the write (and ``after``) is collected successfully.
    """

    after: After | None = None
    on_done: Callable[[], None] | None = None
    #: Set by the writer when it takes the save (rank zero), so the caller can tell that the save
    #: reached it rather than an override of ``Trainer.save_checkpoint`` that writes by itself.
    submitted: bool = field(default=False, init=False)


class CheckpointWriter:
    """Writes a checkpoint at once, atomically; the strategy's writer for every synchronous save."""

    def write(
        self,
        obj: Any,
        path: str,
        before_rename: Callable[[str], None] | None = None,
        after: After | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Write ``obj`` to ``path`` (``write_atomic``), then run ``after`` and ``on_done``.

        Args:
            obj: the checkpoint (tensors, numbers, strings, lists and dicts).
            path: the file to write, atomically.
            before_rename: passed to ``write_atomic`` (tests use it to stop at the worst moment).
            after: run once ``path`` is complete, with a function that writes ``obj`` to another path.
            on_done: run last, once the write and ``after`` succeeded.
        """
        write_atomic(obj, path, before_rename)
        if after is not None:
            after(lambda other: write_atomic(obj, other))
        if on_done is not None:
            on_done()

    @property
    def pending(self) -> bool:
        """Whether a write was submitted whose outcome has not been collected (never, here)."""
        return False

    def collect(self, raise_errors: bool = True) -> BaseException | None:
        """Publish a finished write, or raise its failure; nothing to do for a synchronous writer."""
        return None

    def wait(self, raise_errors: bool = True) -> BaseException | None:
        """Wait for the write in flight, then :meth:`collect` it; nothing to do for a synchronous writer."""
        return None

    def close(self, raise_errors: bool = False) -> BaseException | None:
        """Wait for the write in flight and free what the writer holds (the end of a fit)."""
        return None
