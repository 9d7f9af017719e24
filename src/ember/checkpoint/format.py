"""What a checkpoint file is: its format tag and version, the rule that it holds plain data only, how to
tell one of PyTorch Lightning's from ember's, and the errors every reader raises."""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

import torch

FORMAT = "ember.checkpoint"
FORMAT_VERSION = 1
#: The file of plain data inside a sharded checkpoint's directory (``sharded.py``).
SHARDED_META = "meta.pt"
# Exact types: a subclass (e.g. torch's TorchVersion, a str) is pickled by class name and refused on load.
_SAFE_LEAVES = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size)
_SAFE_CONTAINERS = (dict, OrderedDict, Counter, list, tuple)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used, with what is wrong and what to do about it."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint file at the given path."""


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


def is_lightning_checkpoint(ckpt: Any) -> bool:
    """Whether ``ckpt`` (a loaded file) was written by PyTorch Lightning (``Trainer.save_checkpoint``)."""
    return isinstance(ckpt, dict) and any(str(k).endswith("lightning_version") for k in ckpt)
