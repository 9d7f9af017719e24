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


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is written. ``code`` is the exit status."""

    def __init__(self, signum: int, path: str) -> None:
        super().__init__(exit_code(signum))
        self.signum = signum
        self.checkpoint_path = path

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its own arguments, so that a ddp_spawn worker's reaches the caller as itself.
        return type(self), (self.signum, self.checkpoint_path)

    def __str__(self) -> str:
        return (f"Preempted by {signal.Signals(self.signum).name}: saved {self.checkpoint_path}; "
                f"exiting with status {self.code}. Resume with trainer.fit(..., ckpt_path='last').")
