"""Checkpoint files: atomic durable writes and validated loading.

Kept apart from ``contents.py`` and ``restore.py`` (what a checkpoint contains and how a run resumes
from one): this module only knows files, and imports nothing of ember but ``hparams``, so that every
layer may use it (``TrainModule.load_from_checkpoint`` reads through ``read_for_module`` here, not
through the trainer). ``write_atomic`` writes under a temporary name in the same
directory, flushes and fsyncs, renames over the target and fsyncs the directory, so a crash
leaves either the previous file or the new one, never a truncated one. ``load`` refuses, with an
explanation, every kind of file it cannot use, before anything is changed.

Temporary files are named ``.<target>~<host>~<pid>~<random>.tmp``, so that a later run can tell
whether their writer is still alive: ``remove_stale_temporaries`` deletes only those whose writer
was on this host and no longer exists. Another live job's file in flight is never touched.
``DirectoryLock`` lets one run at a time write checkpoints into a directory; a second one gets a
clear error at start-up instead of the two overwriting (or deleting) each other's files.
"""

from __future__ import annotations

import errno
import glob
import os
import pickle
import re
import shutil
import socket
import tempfile
import threading
import warnings
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ember.hparams import build_from_hparams

if TYPE_CHECKING:
    from ember.module import TrainModule

_M = TypeVar("_M", bound="TrainModule")

FORMAT = "ember.checkpoint"
FORMAT_VERSION = 1
_REQUIRED = ("format", "format_version", "state_dict")
# Exact types: a subclass (e.g. torch's TorchVersion, a str) is pickled by class name and refused on load.
_SAFE_LEAVES = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size)
_SAFE_CONTAINERS = (dict, OrderedDict, Counter, list, tuple)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used, with what is wrong and what to do about it."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint file at the given path."""


# ---------------------------------------------------------------------------------------------- writing
_umask_lock = threading.Lock()


def _file_mode(path: str) -> int:
    """The mode ``open(path, "wb")`` would leave: an existing file's own, else 0o666 less the umask (so a team
    sharing a filesystem reads the checkpoints as it reads any other file the job writes)."""
    try:
        return os.stat(path).st_mode & 0o777
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
        os.replace(tmp, path)
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


# ---------------------------------------------------------------------------------------------- temporaries
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
# .<name>~<host>~<pid>~<random>.tmp (a write) and .<name>~<host>~<pid>~link.tmp (a hard link)
_TEMPORARY = re.compile(r"^\.(?P<name>.+)~(?P<host>[A-Za-z0-9_-]+)~(?P<pid>\d+)~[^~/]+\.tmp$")
# What ember 0.1 named its hard-link temporaries: <name>.<pid>.link.tmp
_OLD_LINK = re.compile(r"^(?P<name>.+\.ckpt)\.(?P<pid>\d+)\.link\.tmp$")


def temporary_prefix(path: str) -> str:
    """The start of the name of a temporary file written by this process on the way to ``path``."""
    return f".{os.path.basename(path)}~{_HOST}~{os.getpid()}~"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(directory: str) -> list[str]:
    """Delete the temporary files in ``directory`` whose writer provably died; return their names.

    A file is stale only when its name says it was written on this host by a process that no
    longer exists. Files of live processes, and of other hosts (whose processes cannot be checked
    from here), are left alone.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _TEMPORARY.match(name)
        host = m.group("host") if m else _HOST
        m = m or _OLD_LINK.match(name)
        if m is None or host != _HOST or int(m.group("pid")) == os.getpid() or _pid_alive(int(m.group("pid"))):
            continue
        try:
            os.remove(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


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


def check_plain_data(obj: Any, where: str = "checkpoint") -> None:
    """Raise if ``obj`` holds anything ``torch.load(weights_only=True)`` would refuse."""
    if type(obj) in _SAFE_LEAVES or isinstance(obj, torch.Tensor):
        return
    if type(obj) in _SAFE_CONTAINERS:
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            if isinstance(obj, dict) and type(k) not in (str, int, float, bool, type(None), tuple):
                raise CheckpointError(
                    f"{where} has a key of type {type(k).__name__} ({k!r}); checkpoint keys must be strings or numbers."
                )
            check_plain_data(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which a checkpoint cannot hold: checkpoints "
        "contain only tensors, numbers, strings, lists and dicts so that loading one never runs code. Store plain "
        "data instead (e.g. its state_dict(), or a string naming it)."
    )


# ---------------------------------------------------------------------------------------------- loading
_ALTERNATIVES = {
    "fit": ", or ckpt_path='last' to resume from the latest one if any",
    "evaluate": ", or ckpt_path='best' / 'last' for this Trainer's best / latest checkpoint",
}


def verify(path: str, purpose: str | None = None) -> int:
    """Raise a ``CheckpointError`` unless ``path`` is a whole file; return its size.

    Whole: it exists (a symbolic link to a file that does not is named as such), is not empty, and,
    being a zip archive as torch writes them, every record's CRC32 matches (this reads the whole
    file). A flipped byte inside a tensor passes ``torch.load``, so only this check finds it.
    """
    if not os.path.exists(path):
        if os.path.islink(path):
            raise CheckpointNotFoundError(
                f"{path!r} is a symbolic link to {os.readlink(path)!r}, which does not exist: the checkpoint it "
                f"pointed to was removed. Pass the path of an existing "
                f"checkpoint{_ALTERNATIVES.get(purpose or '', '')}."
            )
        directory = os.path.dirname(os.path.abspath(path))
        nearby = sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(directory), "*.ckpt")))
        hint = f" Checkpoints in {directory}: {nearby}." if nearby else ""
        raise CheckpointNotFoundError(
            f"No checkpoint file at {path!r}.{hint} Pass the path of an existing "
            f"checkpoint{_ALTERNATIVES.get(purpose or '', '')}."
        )
    if os.path.isdir(path):
        raise CheckpointError(f"{path!r} is a directory; pass the path of a .ckpt file inside it.")
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(f"Checkpoint {path!r} is empty (0 bytes): it is truncated. Use an earlier checkpoint.")
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as zf:
                bad = zf.testzip()  # reads every record and checks its CRC32
        except (zipfile.BadZipFile, OSError, EOFError) as err:
            raise CheckpointError(f"Checkpoint {path!r} is corrupt ({err}). Use an earlier checkpoint.") from err
        if bad is not None:
            raise CheckpointError(
                f"Checkpoint {path!r} is corrupt: record {bad!r} fails its checksum. Use an earlier checkpoint."
            )
    return size


def load(
    path: str, map_location: Any = "cpu", purpose: str | None = None, lightning: bool = False, weights_only: bool = True
) -> dict[str, Any]:
    """Load and validate an ember checkpoint, with an explanatory error for every way it can be wrong.

    ``purpose`` ("fit", "evaluate" or None for ``load_from_checkpoint``) decides what a missing file's
    error suggests instead: only what that caller accepts. With ``lightning``, a PyTorch Lightning
    checkpoint is returned as it is (its ``state_dict`` and ``hyper_parameters`` are what ember reads).
    ``weights_only=False`` lets ``torch.load`` unpickle objects: only for files you trust.
    """
    path = os.fspath(path)
    size = verify(path, purpose)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" in str(err):
            raise CheckpointError(
                f"{path!r} contains pickled Python objects that torch.load(weights_only=True) refuses "
                f"({_first_line_with(str(err), 'GLOBAL') or 'not plain data'}). ember only loads "
                "tensors, numbers, strings, lists and dicts, because unpickling an object can run arbitrary code. "
                "If you trust the file, pass weights_only=False (load_from_checkpoint / load_lightning_checkpoint), or "
                "load it with torch.load(path, weights_only=False) and keep only plain data."
            ) from None
        raise _corrupt(path, size, err) from None
    except (RuntimeError, EOFError, KeyError, ValueError, OSError) as err:
        raise _corrupt(path, size, err) from None
    if lightning and is_lightning_checkpoint(ckpt):
        if not isinstance(ckpt.get("state_dict"), dict):
            raise CheckpointError(f"{path!r} is a Lightning checkpoint without a 'state_dict' dict: nothing to load.")
        return ckpt
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        what = (
            f"a dict with keys {sorted(map(str, ckpt))[:12]}" if isinstance(ckpt, dict) else f"a {type(ckpt).__name__}"
        )
        hint = ""
        if is_lightning_checkpoint(ckpt):
            hint = (
                " It is a PyTorch Lightning checkpoint: YourModule.load_from_checkpoint(path) builds the module "
                "from its hyper-parameters and weights (then fit it anew); ember cannot resume Lightning's "
                "optimizer and loop state."
            )
        elif isinstance(ckpt, dict) and ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
            hint = " It looks like a bare state_dict: use module.load_state_dict(torch.load(path)) instead."
        raise CheckpointError(f"{path!r} is not an ember checkpoint: it holds {what}, without format={FORMAT!r}.{hint}")
    if not isinstance(ckpt.get("format_version"), int) or ckpt["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{path!r} has checkpoint format version {ckpt.get('format_version')!r}, newer than "
            f"this ember reads ({FORMAT_VERSION}; written by ember {ckpt.get('ember_version')}). "
            "Upgrade ember to load it."
        )
    missing = [k for k in _REQUIRED if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path!r} is an incomplete ember checkpoint: keys {missing} are missing.")
    return ckpt


def is_lightning_checkpoint(ckpt: Any) -> bool:
    """Whether ``ckpt`` (a loaded file) was written by PyTorch Lightning (``Trainer.save_checkpoint``)."""
    return isinstance(ckpt, dict) and any(str(k).endswith("lightning_version") for k in ckpt)


def load_lightning_checkpoint(path: str, map_location: Any = "cpu", weights_only: bool = True) -> dict[str, Any]:
    """Read a PyTorch Lightning ``.ckpt`` file as it is, checked: a dict with its ``state_dict`` (the module's
    weights), ``hyper_parameters`` (from ``save_hyperparameters``), ``epoch``, ``global_step`` and the rest.

    To build a module from it, use ``YourModule.load_from_checkpoint(path)``, which accepts Lightning files.

    Args:
        path: the ``.ckpt`` file.
        map_location: where tensors are loaded (as in ``torch.load``).
        weights_only: refuse pickled Python objects (the default); ``False`` only for files you trust.
    """
    ckpt = load(path, map_location=map_location, lightning=True, weights_only=weights_only)
    if not is_lightning_checkpoint(ckpt):
        raise CheckpointError(
            f"{path!r} is an ember checkpoint, not a Lightning one: use "
            "YourModule.load_from_checkpoint(path) or Trainer(...).fit(..., ckpt_path=path)."
        )
    return ckpt


def _first_line_with(text: str, needle: str) -> str:
    for line in text.splitlines():
        if needle in line:
            return line.strip().strip(".")
    return ""


def _corrupt(path: str, size: int, err: BaseException) -> CheckpointError:
    # torch's reason: its first sentence, whole (its later advice is about pickles, not about this file).
    text = str(err).strip()
    reason = text.splitlines()[0].split(". ")[0].rstrip(".") if text else "unexpected end of data"
    return CheckpointError(
        f"Checkpoint {path!r} ({size} bytes) cannot be read: it is truncated, corrupt, or not a torch file "
        f"({type(err).__name__}: {reason}). Use an earlier checkpoint."
    )


def check_state_dict(module: torch.nn.Module, state_dict: dict[str, Any], path: str, exact_dtype: bool = False) -> None:
    """Raise, changing nothing, unless ``state_dict`` has exactly ``module``'s keys and shapes, and
    dtypes of the same kind (floating, complex, integer, bool; with ``exact_dtype`` the same dtypes).

    ``load_state_dict`` would silently cast an int64 tensor into a float32 parameter (or round a
    float into an integer buffer); a resume that claims to be exact must not.
    """
    if not isinstance(state_dict, dict):
        raise CheckpointError(
            f"Checkpoint {path!r} has a 'state_dict' entry that is a {type(state_dict).__name__}, "
            "not a dict of tensors. Nothing was loaded."
        )
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    shapes, dtypes = [], []
    for k, v in own.items():
        saved = state_dict.get(k)
        if k not in state_dict or not isinstance(v, torch.Tensor):
            continue
        if not isinstance(saved, torch.Tensor):
            dtypes.append(f"{k}: checkpoint holds a {type(saved).__name__}, not a tensor")
        elif saved.shape != v.shape:
            shapes.append(f"{k}: checkpoint {tuple(saved.shape)} vs module {tuple(v.shape)}")
        elif saved.dtype != v.dtype and (exact_dtype or _kind(saved.dtype) != _kind(v.dtype)):
            dtypes.append(f"{k}: checkpoint {saved.dtype} vs module {v.dtype}")
    if missing or unexpected or shapes or dtypes:
        parts = []
        if missing:
            parts.append(f"missing keys (in the module, not in the checkpoint): {_short(missing)}")
        if unexpected:
            parts.append(f"unexpected keys (in the checkpoint, not in the module): {_short(unexpected)}")
        if shapes:
            parts.append(f"shape mismatches: {_short(shapes)}")
        if dtypes:
            parts.append(f"dtype mismatches: {_short(dtypes)}")
        raise CheckpointError(
            f"Checkpoint {path!r} does not fit {type(module).__name__}: "
            + "; ".join(parts)
            + ". Was it saved from a different model or configuration (precision=...)? "
            "Nothing was loaded."
        )


def match_compiled_keys(module: torch.nn.Module, state_dict: Any) -> Any:
    """``state_dict`` with its keys renamed to ``module``'s where they differ only by ``torch.compile``'s
    ``_orig_mod`` level (a submodule compiled when the checkpoint was saved and not now, or the reverse);
    otherwise ``state_dict`` as it is (``check_state_dict`` then names what does not fit)."""
    own = list(module.state_dict())
    if not isinstance(state_dict, dict) or set(state_dict) == set(own):
        return state_dict

    def plain(key: str) -> str:
        return key.replace("._orig_mod.", ".").removeprefix("_orig_mod.")

    by_plain = {plain(k): k for k in own}
    renamed = {by_plain.get(plain(k), k): v for k, v in state_dict.items()}
    return renamed if len(by_plain) == len(own) and set(renamed) == set(own) else state_dict


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"


def _short(items: list[str], n: int = 10) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def read_for_module(
    path: str,
    cls: type[_M],
    overrides: dict[str, Any],
    strict: bool | None = True,
    map_location: Any = "cpu",
    weights_only: bool = True,
) -> _M:
    """Build ``cls`` from the hyper-parameters saved in ``path`` (``overrides`` win) and load its weights.

    As Lightning: the saved hyper-parameters updated with ``overrides`` are the constructor's keyword
    arguments; those it does not accept are left out (unless it takes ``**kwargs``), with a warning
    for the overrides; when ``save_hyperparameters(cfg)`` saved one dict argument (the checkpoint's
    ``hparams_name``), they are passed as that argument.
    """
    ckpt = load(path, map_location=map_location, lightning=True, weights_only=weights_only)
    try:
        module = build_from_hparams(
            cls, ckpt.get("hyper_parameters"), ckpt.get("hparams_name"), overrides, stacklevel=3
        )
    except TypeError as err:
        raise CheckpointError(
            f"Could not build {cls.__name__} from the hyper-parameters saved in {path!r}: {err}. "
            "Pass the missing arguments as keyword overrides to load_from_checkpoint, or call "
            "save_hyperparameters() in __init__."
        ) from err
    if strict is None:  # the module's own choice (TrainModule.strict_loading)
        strict = module.strict_loading
    elif strict and not module.strict_loading:
        raise ValueError(
            f"load_from_checkpoint(..., strict=True) conflicts with {cls.__name__}.strict_loading=False. "
            "Pass the same value as the module sets, or leave strict out."
        )
    module.configure_model()  # layers made there exist before the weights are loaded (a no-op by default)
    module.on_load_checkpoint(ckpt)  # first, as Lightning: it may rewrite ckpt["state_dict"]
    ckpt["state_dict"] = match_compiled_keys(module, ckpt["state_dict"])
    if strict:
        check_state_dict(module, ckpt["state_dict"], path)
    keys = module.load_state_dict(ckpt["state_dict"], strict=strict)
    if not strict and (keys.missing_keys or keys.unexpected_keys):  # as Lightning: said, not silent
        warnings.warn(
            f"load_from_checkpoint(strict=False) on {path!r}: keys of {cls.__name__} not in the checkpoint "
            f"(left as built): {keys.missing_keys}; keys of the checkpoint not in {cls.__name__} (ignored): "
            f"{keys.unexpected_keys}.",
            UserWarning,
            stacklevel=3,
        )
    return module
