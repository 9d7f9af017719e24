"""Walking the nested batches a loader yields (tuples, lists, dicts, namedtuples, dataclasses of tensors):
moving them to a device, finding their first tensor and their batch size; and the length of an iterable
that may have none.

A leaf, kept import-light: it is on ``import ember``'s path. These are ember's own walkers rather than
lightning-utilities' ``apply_to_collection`` where the results must differ (each says why).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

_CPU = torch.device("cpu")


def move_to_device(batch: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> Any:
    """Return ``batch`` with every tensor moved to ``device`` (and floats cast to ``dtype``).

    Walks tuples, lists, dicts, namedtuples and dataclasses; other leaves are returned as they are.
    Copies towards an accelerator are asynchronous (from pinned memory they overlap the device's
    work); copies towards the CPU are not, because the caller may read (or pickle) the result at
    once, before an asynchronous copy would have landed.
    """
    if not isinstance(device, torch.device):
        device = torch.device(device)
    # ``!= _CPU`` first: comparing two devices is much cheaper than reading ``device.type``.
    return _move(batch, device, dtype, device != _CPU and device.type != "cpu")


def _move(batch: Any, device: torch.device, dtype: torch.dtype | None, non_blocking: bool) -> Any:
    # Own walker, not lightning-utilities' ``apply_to_collection``, because the results differ
    # (speed is no reason: the two take about as long). Dataclasses are rebuilt with
    # ``dataclasses.replace``, so a frozen one is moved (the library raises, or with ``allow_frozen``
    # returns it unmoved) and ``__post_init__`` recomputes ``init=False`` fields from the moved tensors
    # (the library keeps the old ones). Only dicts, lists and tuples are walked: the library also walks
    # any Mapping or Sequence and fails to rebuild some (a ``range`` leaf raises TypeError).
    if isinstance(batch, torch.Tensor):
        if dtype is not None and batch.is_floating_point():
            return batch.to(device=device, dtype=dtype, non_blocking=non_blocking)
        return batch.to(device, non_blocking=True) if non_blocking else batch.to(device)
    if isinstance(batch, (list, tuple)):
        moved = [_move(b, device, dtype, non_blocking) for b in batch]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):
            return type(batch)(*moved)
        return moved if type(batch) is list else type(batch)(moved)
    if isinstance(batch, dict):
        items = [(k, _move(v, device, dtype, non_blocking)) for k, v in batch.items()]
        if isinstance(batch, defaultdict):  # its first constructor argument is the factory
            return type(batch)(batch.default_factory, items)
        return type(batch)(items)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: _move(getattr(batch, f.name), device, dtype, non_blocking)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    return batch


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor found in a nested batch, or ``None``."""
    # Own walker: a search that stops at the first tensor and builds nothing, whereas
    # ``apply_to_collection`` visits every leaf and rebuilds the collection; self.log runs it once per batch.
    if isinstance(batch, torch.Tensor):
        return batch
    items: Iterable[Any]
    if isinstance(batch, (list, tuple)):
        items = batch
    elif isinstance(batch, dict):
        items = batch.values()
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    else:
        return None
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def infer_batch_size(batch: Any) -> int:
    """Length of the first dimension of the first tensor in ``batch`` (1 when there is none)."""
    t = first_tensor(batch)
    if t is None or t.ndim == 0:
        return 1
    return int(t.shape[0])


def sized_len(obj: Any) -> int | None:
    """``len(obj)``, or None for an object without a length: no ``__len__`` (TypeError) or one that raises
    NotImplementedError, as some iterable wrappers do (Lightning treats both as unsized)."""
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None
