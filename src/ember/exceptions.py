"""Exceptions that cross layers: raised by the trainer, recognised by callbacks and launchers.

A leaf (it imports nothing of ember), so that a callback can tell a preemption from a crash
without importing the trainer.
"""

from __future__ import annotations

import signal
from typing import Any


def exit_code(signum: int) -> int:
    """The exit status of a run preempted by ``signum``."""
    return 128 + int(signum)


class PossibleUserWarning(UserWarning):
    """A warning about something that may be intended (few batches for the logging interval, ...); silence
    them all with ``ember.utilities.disable_possible_user_warnings()``."""


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is written. ``code`` is the exit status:
    ``128 + signum``, or 0 when the job was requeued (``requeued`` says how) and will resume on its own."""

    def __init__(self, signum: int, path: str, requeued: str | None = None) -> None:
        super().__init__(0 if requeued else exit_code(signum))
        self.signum = signum
        self.checkpoint_path = path
        self.requeued = requeued

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its own arguments, so that a ddp_spawn worker's reaches the caller as itself.
        return type(self), (self.signum, self.checkpoint_path, self.requeued)

    def __str__(self) -> str:
        then = (
            f"{self.requeued}; the requeued job resumes from it on its own"
            if self.requeued
            else "Resume with trainer.fit(..., ckpt_path='last')"
        )
        return (
            f"Preempted by {signal.Signals(self.signum).name}: saved {self.checkpoint_path}; "
            f"exiting with status {self.code}. {then}."
        )
