"""Reading a checkpoint file: ``verify`` (the file is whole) and ``load`` (it is an ember checkpoint this
version reads), each refusing, with an explanation, every kind of file it cannot use, before anything is
changed."""

from __future__ import annotations

import glob
import os
import pickle
import zipfile
from collections.abc import Callable
from typing import Any

import torch

from ember.checkpoint import sharded
from ember.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointNotFoundError,
    is_lightning_checkpoint,
)

_REQUIRED = ("format", "format_version", "state_dict")
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
        if sharded.is_sharded(path):
            sharded.verify(path)
            return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
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
    path: str,
    map_location: Any = "cpu",
    purpose: str | None = None,
    lightning: bool = False,
    weights_only: bool = True,
    read_sharded: Callable[[str], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Load and validate an ember checkpoint, with an explanatory error for every way it can be wrong.

    ``purpose`` ("fit", "evaluate" or None for ``load_from_checkpoint``) decides what a missing file's
    error suggests instead: only what that caller accepts. With ``lightning``, a PyTorch Lightning
    checkpoint is returned as it is (its ``state_dict`` and ``hyper_parameters`` are what ember reads).
    ``weights_only=False`` lets ``torch.load`` unpickle objects: only for files you trust.
    A sharded checkpoint (a directory, ``sharded.py``) is read by ``read_sharded`` (the strategy's: this rank's
    shards), by default whole on the CPU.
    """
    path = os.fspath(path)
    size = verify(path, purpose)
    try:
        if sharded.is_sharded(path):
            ckpt = (read_sharded or sharded.read)(path)
        else:
            ckpt = torch.load(path, map_location=map_location, weights_only=weights_only)
    except CheckpointError:
        raise
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
