"""Jobs the test session starts as soon as it has collected the test that checks them.

The watchdog's default deadline is a minute: a test that started its job and waited for it would hold a
pytest-xdist worker idle for most of that minute. Instead the process that runs the session (pytest
itself, or xdist's controller once a worker has collected) starts the job when it sees the test among
those collected, and the test reads the outcome whenever a worker gets to it.

Each job runs in a folder of its own under ``$EMBER_TEST_SESSION_JOBS`` (a temporary folder the session
names before xdist starts its workers, which inherit the variable): ``log`` (its output), ``began`` (its
start time) and, once it has ended, ``status`` (exit status and end time, written by a thread of the
session as soon as the job ends). At the end of the session a job still running is killed with its
process group, and the folder is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = "EMBER_TEST_SESSION_JOBS"

# The end of a test's node id -> the name of its job and the job's command line after ``python``.
JOBS: dict[str, tuple[str, list[str]]] = {
    "test_watchdog.py::test_a_hung_rank_ends_the_job_about_a_minute_later_by_default": (
        "default_deadline",
        ["tests/strategies/hang_script.py", "--hang-rank", "1"],
    ),
}


class SessionJobs:
    """Lives in the session's process: starts the jobs of the collected tests, and stops them at the end."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="ember-session-jobs-"))
        os.environ[ENV] = str(self.root)
        self.procs: dict[str, subprocess.Popen] = {}
        self.waiters: list[threading.Thread] = []

    def start_for(self, nodeids: list[str]) -> None:
        for nodeid in nodeids:
            for suffix, (name, args) in JOBS.items():
                if nodeid.endswith(suffix) and name not in self.procs:
                    self._start(name, args)

    def _start(self, name: str, args: list[str]) -> None:
        out = self.root / name
        out.mkdir()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        began = time.time()
        with open(out / "log", "w") as log:
            proc = subprocess.Popen(
                [sys.executable, str(ROOT / args[0]), "--out", str(out), *args[1:]],
                cwd=out,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[name] = proc
        (out / "began").write_text(repr(began))
        waiter = threading.Thread(target=self._note_end, args=(proc, out), name=f"session job {name}", daemon=True)
        waiter.start()
        self.waiters.append(waiter)

    @staticmethod
    def _note_end(proc: subprocess.Popen, out: Path) -> None:
        code = proc.wait()
        ended = time.time()
        (out / "status.tmp").write_text(json.dumps({"code": code, "ended": ended}))
        os.replace(out / "status.tmp", out / "status")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the job's launcher and every rank it started
                except ProcessLookupError:
                    pass
                proc.wait()
        for waiter in self.waiters:
            waiter.join(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class Outcome:
    out: Path
    code: int
    log: str
    began: float
    ended: float


def outcome(name: str, limit: float) -> Outcome:
    """In a test: the outcome of the session's job ``name``, waiting until ``limit`` s after its start at the
    most (the test fails if the session never started it, or it does not end in time)."""
    root = os.environ.get(ENV)
    assert root, f"${ENV} is not set: tests/conftest.py sets it when the session starts"
    out = Path(root) / name
    give_up = time.monotonic() + 60
    while not (out / "began").exists():
        if time.monotonic() > give_up:
            pytest.fail(f"the session did not start the job {name!r} (tests/helpers/session_jobs.py)")
        time.sleep(0.1)
    began = float((out / "began").read_text())
    while not (out / "status").exists():
        if time.time() > began + limit:
            pytest.fail(f"job {name!r} did not end within {limit} s of its start:\n{(out / 'log').read_text()}")
        time.sleep(0.2)
    status = json.loads((out / "status").read_text())
    return Outcome(out, status["code"], (out / "log").read_text(), began, status["ended"])
