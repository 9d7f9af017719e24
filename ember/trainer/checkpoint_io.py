"""Checkpoint files: atomic durable writes and validated loading.

Kept apart from ``checkpoint.py`` (what a checkpoint contains and how a run resumes from one):
this module only knows files. ``write_atomic`` writes under a temporary name in the same
directory, flushes and fsyncs, renames over the target and fsyncs the directory, so a crash
leaves either the previous file or the new one, never a truncated one. ``load`` refuses, with an
explanation, every kind of file it cannot use, before anything is changed.
"""
from __future__ import annotations

import glob
import os
import pickle
import tempfile
import threading
import zipfile
from collections import Counter, OrderedDict
from typing import Any, Callable

import torch

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
def write_atomic(obj: Any, path: str, before_rename: Callable[[str], None] | None = None) -> None:
    """``torch.save(obj)`` to ``path`` so that a crash never leaves a partial file under ``path``.

    Args:
        obj: what to save.
        path: the final file name.
        before_rename: called with the temporary file's name after it is durable and before the
            rename (tests use it to simulate a crash at the worst moment).
    """
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        # torch.save to a path uses its C++ writer (no Python callbacks per chunk): fastest. Meanwhile
        # a thread keeps flushing what is written so far, so the disk works while torch serialises and
        # the final fsync has little left to wait for (about 1.1x a bare torch.save instead of 1.4x).
        done = threading.Event()
        flusher = threading.Thread(target=_flush_until, args=(fd, done), name="ember-ckpt-flush", daemon=True)
        flusher.start()
        try:
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
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def _flush_until(fd: int, done: threading.Event) -> None:
    while not done.wait(0.01):
        try:
            os.fdatasync(fd)
        except OSError:  # the final fsync reports real errors
            return


def _fsync_dir(directory: str) -> None:
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
                raise CheckpointError(f"{where} has a key of type {type(k).__name__} ({k!r}); checkpoint keys must "
                                      "be strings or numbers.")
            check_plain_data(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which a checkpoint cannot hold: checkpoints "
        "contain only tensors, numbers, strings, lists and dicts so that loading one never runs code. Store plain "
        "data instead (e.g. its state_dict(), or a string naming it)."
    )


# ---------------------------------------------------------------------------------------------- loading
def load(path: str, map_location: Any = "cpu") -> dict[str, Any]:
    """Load and validate an ember checkpoint, with an explanatory error for every way it can be wrong."""
    path = os.fspath(path)
    if not os.path.exists(path):
        directory = os.path.dirname(os.path.abspath(path))
        nearby = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.ckpt")))
        hint = f" Checkpoints in {directory}: {nearby}." if nearby else ""
        raise CheckpointNotFoundError(f"No checkpoint file at {path!r}.{hint} Pass the path of an existing "
                                      "checkpoint, or ckpt_path='last' to resume from the latest one if any.")
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
            raise CheckpointError(f"Checkpoint {path!r} is corrupt: record {bad!r} fails its checksum. "
                                  "Use an earlier checkpoint.")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" in str(err):
            raise CheckpointError(
                f"{path!r} contains pickled Python objects that torch.load(weights_only=True) refuses "
                f"({_first_line_with(str(err), 'GLOBAL') or 'not plain data'}). ember only loads "
                "tensors, numbers, strings, lists and dicts, because unpickling an object can run arbitrary code. "
                "If you trust the file, load it with torch.load(path, weights_only=False) and keep only plain data."
            ) from None
        raise _corrupt(path, size, err) from None
    except (RuntimeError, EOFError, KeyError, ValueError, OSError) as err:
        raise _corrupt(path, size, err) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        what = f"a dict with keys {sorted(map(str, ckpt))[:12]}" if isinstance(ckpt, dict) else f"a {type(ckpt).__name__}"
        hint = ""
        if isinstance(ckpt, dict) and any("lightning" in str(k) for k in ckpt):
            hint = " It looks like a PyTorch Lightning checkpoint; load its 'state_dict' into the module instead."
        elif isinstance(ckpt, dict) and ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
            hint = " It looks like a bare state_dict: use module.load_state_dict(torch.load(path)) instead."
        raise CheckpointError(f"{path!r} is not an ember checkpoint: it holds {what}, without format={FORMAT!r}.{hint}")
    if not isinstance(ckpt.get("format_version"), int) or ckpt["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{path!r} has checkpoint format version {ckpt.get('format_version')!r}, newer than "
                              f"this ember reads ({FORMAT_VERSION}; written by ember {ckpt.get('ember_version')}). "
                              "Upgrade ember to load it.")
    missing = [k for k in _REQUIRED if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path!r} is an incomplete ember checkpoint: keys {missing} are missing.")
    return ckpt


def _first_line_with(text: str, needle: str) -> str:
    for line in text.splitlines():
        if needle in line:
            return line.strip().strip(".")
    return ""


def _corrupt(path: str, size: int, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint {path!r} ({size} bytes) cannot be read: it is truncated, corrupt, or not a torch file "
        f"({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else 'unexpected end of data'}). "
        "Use an earlier checkpoint."
    )


def check_state_dict(module: torch.nn.Module, state_dict: dict[str, Any], path: str) -> None:
    """Raise, changing nothing, unless ``state_dict`` has exactly ``module``'s keys and shapes."""
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    shapes = [f"{k}: checkpoint {tuple(state_dict[k].shape)} vs module {tuple(v.shape)}"
              for k, v in own.items() if k in state_dict and isinstance(state_dict[k], torch.Tensor)
              and isinstance(v, torch.Tensor) and state_dict[k].shape != v.shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys (in the module, not in the checkpoint): {_short(missing)}")
        if unexpected:
            parts.append(f"unexpected keys (in the checkpoint, not in the module): {_short(unexpected)}")
        if shapes:
            parts.append(f"shape mismatches: {_short(shapes)}")
        raise CheckpointError(f"Checkpoint {path!r} does not fit {type(module).__name__}: " + "; ".join(parts)
                              + ". Was it saved from a different model or configuration? Nothing was loaded.")


def _short(items: list[str], n: int = 10) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")
