"""A process's Python stacks, printed on demand, and an exit that prints them first.

The watchdog prints a stuck rank's stacks from its own thread, while the main thread sleeps or blocks in
I/O; ``DDPStrategy.abort_job`` and ``ember/trainer/preemption.py`` (a stop signal that found no step
boundary in time) end the process with them. Apart from ``watchdog.py`` because this is not watching:
anything that must end a process now, and say where it was, uses it. :mod:`faulthandler` prints them; it
reads no source file, so it works even when the stuck thing is the file system.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from typing import NoReturn

from ember.strategies.launchers.processes import end_children

__all__ = ["print_stacks", "exit_with_stacks"]


def print_stacks(header: str) -> None:
    """Print ``header`` and the Python stack of every thread of this process to stderr."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    print(header, file=sys.stderr, flush=True)
    try:
        fd = sys.stderr.fileno()
    except Exception:  # stderr replaced by an object without a descriptor
        fd = 2
    faulthandler.dump_traceback(file=fd, all_threads=True)


def exit_with_stacks(header: str, code: int) -> NoReturn:
    """Print ``header`` and every thread's stack, then end this process now with status ``code`` (and its
    DataLoader workers with it: ``end_children``)."""
    print_stacks(header)
    end_children()
    os._exit(code)
