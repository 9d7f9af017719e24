"""Suite-wide guards: a test that leaks a thread, a child process or a process group fails."""
from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch


def _live_children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


@pytest.fixture(autouse=True)
def _no_leaks():
    torch.manual_seed(0)
    threads_before = _threads()
    children_before = _live_children()
    yield
    # Give threads that are finishing up a moment to exit before calling them leaked.
    deadline = time.monotonic() + 2.0
    while True:
        leaked_threads = [
            t for t in _threads() - threads_before
            if not t.daemon or not t.name.startswith(("pydevd", "QueueFeederThread"))
        ]
        leaked_children = _live_children() - children_before
        if not leaked_threads and not leaked_children or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    problems = []
    if leaked_threads:
        problems.append(f"threads left running: {[t.name for t in leaked_threads]}")
    if leaked_children:
        problems.append(f"child processes left running: {sorted(leaked_children)}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        problems.append("a torch.distributed process group was left initialised")
    if problems:
        pytest.fail("; ".join(problems))
