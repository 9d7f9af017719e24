"""The directory lock (ember/checkpoint/lock.py): other processes are excluded, this one never is, and a
forked child never keeps it after its parent released it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ember.checkpoint import DirectoryLock

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="flock and fork are POSIX")

ROOT = Path(__file__).resolve().parents[1]


def holder_seen_by_another_process(directory: Path) -> str:
    """Whether a fresh process can flock ``directory`` ("free") or not ("locked"): the question another
    run's DirectoryLock asks (a bare interpreter, so that no torch import slows the test)."""
    code = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
        "except BlockingIOError:\n    print('locked')"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code, str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_another_process_is_excluded_until_release(tmp_path: Path) -> None:
    lock = DirectoryLock(str(tmp_path))
    assert lock.acquire() is None
    try:
        assert holder_seen_by_another_process(tmp_path) == "locked"
    finally:
        lock.release()
    assert holder_seen_by_another_process(tmp_path) == "free"
    assert os.listdir(tmp_path) == []  # no lock file left behind


def test_one_process_never_locks_itself_out(tmp_path: Path) -> None:
    a, b = DirectoryLock(str(tmp_path)), DirectoryLock(str(tmp_path / "." / ""))
    assert a.acquire() is None
    assert b.acquire() is None  # the same directory, the same process: shared, not refused
    a.release()
    c = DirectoryLock(str(tmp_path))
    assert c.acquire() is None  # still held through b, and shared again
    b.release()
    c.release()
    a.release()  # releasing twice is harmless


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_forked_child_does_not_keep_the_lock(tmp_path: Path) -> None:
    # A DataLoader worker forked during the fit: it shares the lock's open file. Released by the
    # parent, the directory is free at once for any process, while the child still lives.
    lock = DirectoryLock(str(tmp_path))
    assert lock.acquire() is None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: wait until told to go
        os.close(write)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        lock.release()
        assert holder_seen_by_another_process(tmp_path) == "free"
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the child should still be alive"
    finally:
        os.close(write)  # the child reads EOF and exits
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_child_forked_while_the_lock_is_held_does_not_hold_it_after_its_parent_dies(tmp_path: Path) -> None:
    # The parent killed outright (no release): its orphaned child must not keep the directory locked.
    code = """if True:
        import os, sys, time
        from ember.checkpoint import DirectoryLock
        assert DirectoryLock(sys.argv[1]).acquire() is None
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
        time.sleep(60)
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        assert holder_seen_by_another_process(tmp_path) == "free"
    finally:
        parent.kill()
        parent.wait()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
