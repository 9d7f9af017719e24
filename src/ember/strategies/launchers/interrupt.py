"""Ctrl-C under ddp: one line for the whole job, and no traceback from any rank.

Ctrl-C in a terminal sends SIGINT to every process of the job: the launching process and the ranks it started
share the terminal's process group. In each rank the Trainer runs the callbacks' ``on_exception`` and finalizes
the loggers, and the ``KeyboardInterrupt`` then reaches the launcher. Left to Python, every rank would print its
traceback (torch prefixes each line with ``[rankN]:``), and a rank whose collective failed because an
interrupted peer had left would report that as the job's failure. Instead:

- the launching process says so once, in Lightning's words (:data:`INTERRUPTED`): rank 0 of a re-run script
  (or of a torchrun or SLURM job), the caller of ``ddp_spawn``;
- every process still ends as Python ends a script on Ctrl-C, killed by SIGINT (which a shell reports as 130,
  and which stops a shell loop that runs the script), only without the traceback (:func:`end_quietly`);
- the job's store records that it was interrupted (``FailureRecord.interrupt``), so a rank whose collective
  fails because an interrupted peer has left ends the same way, quietly, rather than as a failure;
- the launching process gives the ranks it started :data:`GRACE_S` to end on their own (they got the same
  Ctrl-C and are running their ``on_exception``) before it stops them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["INTERRUPTED", "GRACE_S", "say_interrupted", "end_quietly", "run_in_this_process"]

INTERRUPTED = "Detected KeyboardInterrupt, attempting graceful shutdown ..."
T = TypeVar("T")
GRACE_S = 5.0  # how long the launching process waits, after Ctrl-C, for its ranks to end on their own


def say_interrupted() -> None:
    """The job's one line about Ctrl-C, on a line of its own (a progress bar may be mid-line), as Lightning's."""
    print("\n" + INTERRUPTED, file=sys.stderr, flush=True)


def end_quietly(exc: KeyboardInterrupt) -> None:
    """Let ``exc``, once uncaught, end the script without its traceback.

    Python prints an uncaught exception through ``sys.excepthook`` and then, for a ``KeyboardInterrupt``, ends
    the process by SIGINT. The hook is wrapped to print nothing for this one exception: the process still ends
    by SIGINT, and any other exception (or this one caught, and another raised) prints as before.
    """
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if value is not exc:
            previous(kind, value, tb)

    sys.excepthook = hook


def run_in_this_process(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` for a job of this one process (single device, dp): Ctrl-C ends it as it ends a
    ddp job, with the one line and without the traceback, still by SIGINT."""
    try:
        return fn(*args, **kwargs)
    except KeyboardInterrupt as exc:
        say_interrupted()
        end_quietly(exc)
        raise
