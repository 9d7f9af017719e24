"""Writing a checkpoint file atomically and durably, and the probe that a directory takes files at all.

``write_atomic`` writes under a temporary name in the same directory (``temporaries.py`` names it),
flushes and fsyncs, renames over the target and fsyncs the directory, so a crash leaves either the
previous file or the new one under the checkpoint's name, never a truncated one. A full disk is
reported as such, with the space left, even where torch's writer hides the errno.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch

from ember.checkpoint.format import SHARDED_META
from ember.checkpoint.temporaries import temporary_prefix

_umask_lock = threading.Lock()


def _file_mode(path: str) -> int:
    """The mode ``open(path, "wb")`` would leave: an existing file's own, else 0o666 less the umask (so a team
    sharing a filesystem reads the checkpoints as it reads any other file the job writes)."""
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):  # (not a sharded checkpoint's directory this file replaces)
            return st.st_mode & 0o777
    except OSError:
        pass
    try:  # Linux: the umask, read without changing it (another thread may be creating files)
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _umask_lock:  # elsewhere: set and restore it (only this module's writers are serialised by the lock)
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def write_atomic(
    obj: Any, path: str, before_rename: Callable[[str], None] | None = None, background: bool = False
) -> None:
    """``torch.save(obj)`` to ``path`` so that a crash never leaves a partial file under ``path``.

    Args:
        obj: what to save.
        path: the final file name.
        before_rename: called with the temporary file's name after it is durable and before the
            rename (tests use it to simulate a crash at the worst moment).
        background: the caller is a background thread beside a training thread: write through a
            Python file object, whose writes release the GIL (torch's writer for a path holds it
            while it copies each tensor's bytes, which stops every other Python thread).
    """
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(path), suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, _file_mode(path))  # mkstemp's 0600 would hide the file from the user's group
        # torch.save to a path uses its C++ writer (no Python callbacks per chunk): fastest. Meanwhile
        # a thread keeps flushing what is written so far, so the disk works while torch serialises and
        # the final fsync has little left to wait for (about 1.1x a bare torch.save instead of 1.4x).
        done = threading.Event()
        flusher = threading.Thread(target=_flush_until, args=(fd, done), name="ember-ckpt-flush", daemon=True)
        flusher.start()
        try:
            if background:
                with open(fd, "wb", closefd=False) as fh:
                    torch.save(obj, fh)
            else:
                torch.save(obj, tmp)
        finally:
            done.set()
            flusher.join()
        os.fsync(fd)
        os.close(fd)
        fd = -1
        if before_rename is not None:
            before_rename(tmp)
        rename_over(tmp, path)
    except BaseException as err:
        full = _out_of_space(err, fd)
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if full:
            raise _no_space_error(path) from err
        raise
    fsync_dir(directory)


def _out_of_space(err: BaseException, fd: int) -> bool:
    """Whether a failed write failed because the file system is full.

    torch's writer reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc]
    unexpected pos ...`` without the errno, so when the error does not carry ENOSPC itself, the
    still-open temporary file is probed with one more write of a few blocks at its end.
    """
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    if not isinstance(err, RuntimeError) or fd < 0:
        return False
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        os.write(fd, b"\0" * 65536)
        os.fsync(fd)
        os.ftruncate(fd, end)
    except OSError as probe:
        return probe.errno in (errno.ENOSPC, errno.EDQUOT)
    return False


def _no_space_error(path: str) -> OSError:
    directory = os.path.dirname(path)
    try:
        free = f"{shutil.disk_usage(directory).free / 2**20:.1f} MiB free there now"
    except OSError:
        free = "free space unknown"
    return OSError(
        errno.ENOSPC,
        f"No space left on device while writing {path} ({free}). Free some space or "
        "write checkpoints elsewhere (ModelCheckpoint(dirpath=...)); the file previously under that "
        "name, if any, is intact",
    )


def unwritable(directory: str) -> OSError | None:
    """Why files cannot be written into ``directory`` (made if missing), or None when they can.

    A real write, not a permission check: the owner's mode bits say nothing on a read-only mount,
    and root passes every ``access()`` check. The probe is named as this process's temporary files
    are, so one left by a crash is removed by a later run.
    """
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(
            prefix=temporary_prefix(os.path.join(directory, "probe")), suffix=".tmp", dir=directory
        )
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return err
    return None


def _flush_until(fd: int, done: threading.Event) -> None:
    while not done.wait(0.01):
        try:
            os.fdatasync(fd)
        except OSError:  # the final fsync reports real errors
            return


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def rename_over(source: str, target: str) -> None:
    """``os.replace(source, target)``, also where ``target`` is a sharded checkpoint's directory (a file or a
    directory taking the place of one): the two are swapped in one step where the system can
    (``renameat2(RENAME_EXCHANGE)``, Linux), else the old one is first renamed aside under a temporary's name;
    then the old one is deleted. Any other directory at ``target`` is an error, never deleted."""
    if not (os.path.isdir(target) and not os.path.islink(target)):
        if os.path.isdir(source) and os.path.lexists(target):  # a directory over a file
            if not _exchange(source, target):
                os.remove(target)
                os.rename(source, target)
                return
            os.remove(source)
            return
        os.replace(source, target)
        return
    if not os.path.isfile(os.path.join(target, SHARDED_META)):
        raise IsADirectoryError(
            errno.EISDIR,
            f"{target!r} is a directory that is not a checkpoint: ember will not replace it. Move it away, or save "
            "the checkpoint under another name",
            target,
        )
    if _exchange(source, target):
        shutil.rmtree(source, ignore_errors=True) if os.path.isdir(source) else os.remove(source)
        return
    aside = source.removesuffix(".tmp") + "-previous.tmp"  # a temporary's name: reaped if we die now
    os.rename(target, aside)
    os.rename(source, target)
    shutil.rmtree(aside, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` in one step (Linux's ``renameat2``); False where that is not available."""
    try:  # the C library this process already has loaded (no search, no subprocess)
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # this filesystem or kernel cannot: rename instead
        return False
    raise OSError(err, os.strerror(err), b)
