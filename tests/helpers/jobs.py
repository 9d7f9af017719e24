"""Run a program the way a user does (``python script.py``), and when it does not end in time, show
where every one of its processes stood before it is killed.

A job that hangs inside the suite is the hardest failure to chase: the test only knows that the
program did not end, and the program is gone by the time anyone looks. ``start_job`` starts the
program in a session of its own with Python's fault handler on (``PYTHONFAULTHANDLER``, which every
process it starts inherits: ranks re-run by the launcher, DataLoader workers, torchrun's children).
``finish_job`` waits for it; past the limit it sends SIGABRT to each of the job's processes, the
deepest first (a child's stacks reach the pipe before its parent is gone), so each prints every thread's
Python stack, then kills what is left and fails the test with the job's whole output: what it had
printed so far, then the stacks. A job that ends in time is left as it ended, so a test can still check
that it left no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence

import pytest

from ember.strategies.launchers.processes import descendants, process_table

__all__ = ["start_job", "finish_job", "complete_job", "run_job", "kill_job", "job_processes"]

_OUTPUT_TAIL = 40_000  # characters of a timed-out job's output shown in the failure


def start_job(
    command: Sequence[str], *, env: dict[str, str] | None = None, split: bool = False, **popen_kwargs
) -> subprocess.Popen:
    """``command`` (``[sys.executable, "script.py", ...]``) in a session of its own, its output piped as text:
    stdout and stderr together, or apart with ``split``."""
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen(
        list(command),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if split else subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
        **popen_kwargs,
    )


def job_processes(pid: int) -> list[int]:
    """``pid``'s running descendants and the members of its session, parents before their children."""
    table = process_table()
    found = descendants(pid, table)
    # Orphans (a killed rank's loader workers) left the tree but not the session.
    found.extend(p for p, (_, session) in table.items() if session == pid and p != pid and p not in found)
    return found


def _signal(pids: Sequence[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the job and every process it started."""
    _signal([*job_processes(proc.pid), proc.pid], signal.SIGKILL)


def finish_job(proc: subprocess.Popen, limit: float, kill_the_rest: bool = False) -> tuple[int, str]:
    """The job's exit status and output once it ends; past ``limit`` seconds, fail with its stacks.

    Args:
        proc: a job from :func:`start_job`.
        limit: seconds to wait for it.
        kill_the_rest: once it has ended, kill what it left running (a SIGKILLed rank's orphaned loader
            workers); left False where the test checks that nothing was left.
    """
    done = complete_job(proc, limit, kill_the_rest)
    return done.returncode, done.stdout


def complete_job(proc: subprocess.Popen, limit: float, kill_the_rest: bool = False) -> subprocess.CompletedProcess:
    """As :func:`finish_job`, for a job started with ``split``: its stdout and stderr apart."""
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not end within {limit:g} s; its output, then every process's stacks:\n{_dump(proc)}")
    except BaseException:
        kill_job(proc)
        raise
    if kill_the_rest:
        kill_job(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_job(command: Sequence[str], limit: float, kill_the_rest: bool = False, **kwargs) -> tuple[int, str]:
    """:func:`start_job` then :func:`finish_job`."""
    return finish_job(start_job(command, **kwargs), limit, kill_the_rest)


def _dump(proc: subprocess.Popen) -> str:
    descendants = job_processes(proc.pid)
    shown = f"processes: {proc.pid} (the job) and {descendants}\n"
    _signal(list(reversed(descendants)), signal.SIGABRT)
    time.sleep(1.0)
    _signal([proc.pid], signal.SIGABRT)
    try:
        out, err = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # the handler could not run: nothing more will come
        kill_job(proc)
        out, err = proc.communicate()
    kill_job(proc)  # a forked child the abort left behind
    out = (out or "") + (f"\n--- stderr ---\n{err}" if err else "")
    return shown + (out if len(out) <= _OUTPUT_TAIL else "...\n" + out[-_OUTPUT_TAIL:])
