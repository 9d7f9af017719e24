"""The before-fork wait for ending queue feeder threads (``ember/data/fork_safety.py``)."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import ember.data.resumable  # noqa: F401 (imports the hook, as every fit does)
from ember.data.fork_safety import _is_ending_feeder, settle_ending_feeders


def feeder_of(queue) -> threading.Thread:
    queue.put(1)  # starts the feeder thread
    return queue._thread


def test_a_closed_queues_feeder_is_waited_for_and_an_open_ones_is_not():
    ctx = multiprocessing.get_context("fork")
    open_queue, closing = ctx.Queue(), ctx.Queue()
    idle, ending = feeder_of(open_queue), feeder_of(closing)
    time.sleep(0.05)  # both have sent their item and wait for more
    closing.cancel_join_thread()
    # Hold the feeder where it waits: it cannot take the sentinel until the buffer's lock is free.
    with closing._notempty:
        closing._buffer.append(multiprocessing.queues._sentinel)
        closing._notempty.notify()
        assert _is_ending_feeder(ending) and ending.is_alive()
        assert not _is_ending_feeder(idle)
    start = time.monotonic()
    settle_ending_feeders()
    assert not ending.is_alive()
    assert idle.is_alive()  # an open queue's feeder: not ending, not waited for
    assert time.monotonic() - start < 0.5
    open_queue.close()
    open_queue.join_thread()


def test_the_wait_runs_before_every_fork_and_a_fork_after_it_works():
    ctx = multiprocessing.get_context("fork")
    closing = ctx.Queue()
    ending = feeder_of(closing)
    closing.cancel_join_thread()
    closing.close()  # the feeder ends on its own, as a finished DataLoader iterator's do
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert not ending.is_alive()  # joined by the hook, before the fork
    assert os.waitpid(pid, 0)[1] == 0
