"""``DirectoryLock``: one run at a time writes checkpoints into a directory; a second one gets a clear
error at start-up instead of the two overwriting (or deleting) each other's files."""

from __future__ import annotations

import errno
import os
import socket
import threading


class DirectoryLock:
    """An exclusive, advisory lock on a directory for the lifetime of one run.

    ``flock`` on the directory itself: no lock file is left behind, and the lock dies with its
    process, so a killed run never leaves a directory locked. Where the platform or the file
    system has no ``flock``, locking is skipped.

    The lock excludes other processes, never this one: a process holds each directory's lock once
    (see ``_HELD``), and every ``DirectoryLock`` of it on that directory shares it (two
    ModelCheckpoints writing into one directory, a second fit after the first). A flock belongs to
    the open file, which a forked child (a DataLoader worker) shares: closing the parent's
    descriptor would leave the lock held as long as the child lives. So ``release`` unlocks
    explicitly (``LOCK_UN`` releases it for every sharer), and a forked child closes its copies at
    once (``_forget_in_child``), so that neither a worker that outlives the fit nor an orphaned one
    keeps the directory locked.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._key: tuple[int, int] | None = None

    def acquire(self) -> str | None:
        """Take the lock; return None, or a description of the process that holds it."""
        try:
            import fcntl
        except ImportError:
            return None
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.directory, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with _HELD_LOCK:
            held = _HELD.get(key)
            if held is not None:  # this process holds it already: share it
                os.close(fd)
                held[1] += 1
                self._key = key
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return None  # a file system without locks: nothing to enforce
                return _lock_holder(st.st_ino)
            _HELD[key] = [fd, 1]
        self._key = key
        return None

    def release(self) -> None:
        key, self._key = self._key, None
        if key is None:
            return
        import fcntl

        with _HELD_LOCK:
            held = _HELD.get(key)
            if held is None:  # a forked child's copy: the lock is its parent's
                return
            held[1] -= 1
            if held[1] > 0:
                return
            del _HELD[key]
            try:
                fcntl.flock(held[0], fcntl.LOCK_UN)  # for every copy of the descriptor, a child's included
            finally:
                os.close(held[0])


# The directory locks this process holds: (device, inode) -> [descriptor, users].
_HELD: dict[tuple[int, int], list[int]] = {}
_HELD_LOCK = threading.Lock()


def _forget_in_child() -> None:
    """In a forked child: close the copies of the parent's lock descriptors (without unlocking, which
    would release the parent's lock), so the locks never outlive the parent's fit."""
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()  # another thread of the parent may have held it at the fork
    for fd, _ in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _lock_holder(inode: int) -> str:
    """``"pid N on host H"`` for the process holding a flock on ``inode``, from /proc/locks (Linux)."""
    try:
        with open("/proc/locks", encoding="ascii") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == str(inode):
                    return f"pid {parts[4]} on host {socket.gethostname()}"
    except OSError:
        pass
    return "another process"
