"""Forking a DataLoader's workers while a queue's feeder thread is ending: a deadlock in the child, avoided.

CPython before 3.12 re-initialises the thread states of a forked child under the interpreter's thread-list
lock without first making sure no other thread held it at the moment of the fork. A thread that is ending
(or starting) takes that lock as it removes (adds) itself: a fork at that instant gives a child whose only
thread waits forever on a lock no thread will release. A DataLoader worker born that way never runs; its
rank waits for its batch until the job's watchdog ends the job.

The threads that end around worker forks are the feeder threads of ``multiprocessing`` queues: each
DataLoader iterator's index and result queues have one, and when an epoch's iterator is shut down its
queues are closed and their feeders end on their own, shortly after, while the next epoch's (or the
validation loop's) workers are forked. :func:`settle_ending_feeders`, registered to run in the parent before
every ``os.fork`` (``os.register_at_fork``), waits (at most a second in all) for the feeder threads that are
ending to be gone. A feeder that is not ending (its queue still open: an iterator in use, a persistent
worker's queue) is not waited for.

torch and multiprocessing have no public way to this: a feeder thread is recognised by its name and its
target, and whether it is ending by the queue's sentinel in its buffer or its pipe's reading end already
closed (what the feeder does after taking the sentinel).
"""

from __future__ import annotations

import multiprocessing.queues
import os
import threading
import time
from typing import Any

__all__ = ["settle_ending_feeders"]

#: The longest a fork waits for ending feeder threads, in all.
BUDGET_S = 1.0


def _is_ending_feeder(thread: threading.Thread) -> bool:
    if thread.name != "QueueFeederThread" or not thread.is_alive():
        return False
    if getattr(thread, "_target", None) is not getattr(multiprocessing.queues.Queue, "_feed", None):
        return False
    args: tuple[Any, ...] = tuple(getattr(thread, "_args", ()))
    if len(args) < 5:
        return False
    buffer, reader_close = args[0], args[4]
    sentinel = getattr(multiprocessing.queues, "_sentinel", None)
    try:
        if any(item is sentinel for item in list(buffer)):
            return True
        reader = getattr(reader_close, "__self__", None)
        return bool(getattr(reader, "closed", False))
    except RuntimeError:  # the buffer changed while read: look again at the next fork
        return False


def settle_ending_feeders(budget: float = BUDGET_S) -> int:
    """Wait (at most ``budget`` seconds in all) until the queue feeder threads that are ending have ended;
    returns how many were waited for. Run before every fork of this process."""
    if threading.active_count() <= 1:
        return 0
    ending = [t for t in threading.enumerate() if t is not threading.current_thread() and _is_ending_feeder(t)]
    deadline = time.monotonic() + budget
    for thread in ending:
        thread.join(max(0.0, deadline - time.monotonic()))
    return len(ending)


def _before_fork() -> None:
    try:
        settle_ending_feeders()
    except Exception:  # never stop a fork over this
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork)
