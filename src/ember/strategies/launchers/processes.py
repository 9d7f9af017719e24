"""The processes of a job on this machine: each dies with its parent, a stopped job leaves none behind, and a
forked child lets go of the process group's connections.

Apart from ``launcher.py`` (how a job starts, and how its ranks report a failure) because this is about
processes, not ranks. The launchers stop the ranks they started with :func:`stop_processes`; a rank ember
started calls :func:`die_with_parent`, so that none outlives the process that started it; and a process
that ends with ``os._exit`` (:func:`exit_now`, the watchdog, ``exit_with_stacks``), which runs none of the
shutdown that would stop its children, first ends them with :func:`end_children`. Process trees are read
from ``/proc`` (Linux); without it these functions do what they can.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import stat as statmod
import subprocess
import sys
import time
from typing import Any

__all__ = [
    "die_with_parent",
    "stop_processes",
    "descendants",
    "kill_processes",
    "end_children",
    "exit_now",
    "socket_fds",
    "record_group_sockets",
    "forget_group_sockets",
]

_STOP_GRACE_S = 2.0  # between SIGTERM and SIGKILL


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when ``parent_pid`` exits (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def stop_processes(procs: list[Any], grace: float = _STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL what still runs after ``grace`` seconds; reap all (Popen or Process)."""

    def poll(p: Any) -> int | None:
        return p.poll() if isinstance(p, subprocess.Popen) else p.exitcode

    alive = [p for p in procs if poll(p) is None]
    below = [d for p in alive for d in descendants(p.pid)]  # their loader workers: see end_children
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
        deadline = time.monotonic() + grace
        while any(poll(p) is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.02)
        alive = [p for p in alive if poll(p) is None]
    kill_processes(below)
    for p in procs:
        p.wait() if isinstance(p, subprocess.Popen) else p.join()


def process_table() -> dict[int, tuple[int, int]]:
    """Every running process's ``(parent, session)`` by pid, read from /proc (ended-but-unreaped ones left out);
    empty without /proc."""
    table: dict[int, tuple[int, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if fields[0] != "Z":
            table[int(entry)] = (int(fields[1]), int(fields[3]))
    return table


def descendants(pid: int, table: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """The running processes below ``pid`` (children, theirs, ...), parents first; empty without /proc.
    ``table``: a :func:`process_table` already read."""
    parents = {p: parent for p, (parent, _) in (process_table() if table is None else table).items()}
    found: list[int] = []
    level = [pid]
    while level:
        level = [p for p, parent in parents.items() if parent in level]
        found.extend(level)
    return found


def kill_processes(pids: list[int]) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def end_children() -> None:
    """SIGKILL every process below this one (the ranks it started, every rank's DataLoader workers) before it
    ends with ``os._exit``, which runs none of the shutdown that would stop them.

    A rank this process started dies with it (``die_with_parent``), but that rank's loader workers do not: a
    worker notices its parent's death only while it waits for work, so one stuck in a dataset's
    ``__getitem__`` (or in a deadlock inherited through ``fork`` from a threaded rank) would outlive the job
    for good, holding the job's output pipe open: whatever waits for that output to end waits too.
    """
    kill_processes(descendants(os.getpid()) or [c.pid for c in multiprocessing.active_children() if c.pid])


def exit_now(status: int) -> None:
    """Ends this process now with ``status``, and every process below it (:func:`end_children`), its output
    flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    end_children()
    os._exit(status)


# ---------------------------------------------------------------------------------------------- forks
# A process forked after the group exists (a DataLoader worker, say) holds copies of the group's
# connections. When this rank is killed, its peers see the connection close only once every copy is
# closed: the orphaned loader workers notice their parent's death only at their next status check, and
# until then the peers wait, and a restart (torchrun) waits with them. A forked child never uses its
# parent's group, so it drops its copies at once (pointing the descriptors at /dev/null, so that nothing
# in the child can close or reuse a number the parent's objects still name).
_group_sockets: dict[int, int] = {}  # descriptor -> inode of the sockets the process group opened


def socket_fds() -> dict[int, int]:
    """This process's socket descriptors and their inodes (Linux; empty where /proc is missing)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            st = os.fstat(int(name))
        except (OSError, ValueError):
            continue
        if statmod.S_ISSOCK(st.st_mode):
            out[int(name)] = st.st_ino
    return out


def _drop_group_sockets_in_child() -> None:
    if not _group_sockets:
        return
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd, ino in _group_sockets.items():
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_ino == ino:
                    os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    _group_sockets.clear()


def record_group_sockets(before: dict[int, int]) -> None:
    """Notes the sockets opened since ``before`` (:func:`socket_fds` taken just before the process group was
    made) as the group's: a child forked from now on drops them."""
    _group_sockets.update({fd: ino for fd, ino in socket_fds().items() if before.get(fd) != ino})


def forget_group_sockets() -> None:
    """The process group is gone: a forked child has none of its sockets to drop."""
    _group_sockets.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_group_sockets_in_child)
