"""Loaders checked where a mistake would otherwise pass without a word.

- A map-style ``Dataset``, a tensor or a list of samples given where a loader belongs (``fit``'s
  ``train_dataloaders`` / ``val_dataloaders``, the ``dataloaders`` of validate / test / predict, or what a
  ``*_dataloader()`` hook returns) is iterable, so a run would go through it one sample at a time, each
  without a batch dimension (Lightning 2.6.6 does). It is refused, with the ``DataLoader`` to wrap it in.
  A list or dict of loaders, a list of ready-made batches and an ``IterableDataset`` (a stream, which may
  yield batches itself) are loaders as before.
- A loader with a length that yields fewer batches than its ``len()`` (a dataset whose ``__getitem__``
  raises ``StopIteration``, a batch sampler shorter than its own length) ends its epoch early: a warning
  says so once per loader, with both counts.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Mapping
from numbers import Number
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from ember.batches import sized_len
from ember.user_frames import user_stacklevel
from ember.utilities.combined_loader import CombinedLoader

# The loaders already warned about (a loader is warned about once, in whichever run it comes short).
_warned_short: weakref.WeakSet[Any] = weakref.WeakSet()


def check_loaders(loaders: Any, where: str) -> None:
    """Raise a TypeError if ``loaders`` (what ``where`` names: ``"fit's train_dataloaders"``,
    ``"MyData.val_dataloader()"``) is, or holds where a loader belongs, a map-style dataset, a tensor or a
    list of samples."""
    if isinstance(loaders, CombinedLoader):
        for i, inner in enumerate(loaders.flattened):
            _check_one(inner, f"{where} (its loader {i})", tensors=False)
        return
    if isinstance(loaders, Mapping):
        for key, inner in loaders.items():
            _check_one(inner, f"{where}[{key!r}]", tensors=False)
        return
    if isinstance(loaders, (list, tuple)):
        if loaders and _is_sample(loaders[0]):
            raise TypeError(
                f"{where} is a {type(loaders).__name__} of samples (its first item, {_short(loaders[0])}, holds a "
                "number without a batch dimension), not a loader: each step would get one sample. Wrap the samples "
                "in a torch.utils.data.DataLoader, which batches them: DataLoader(samples, batch_size=32)."
            )
        for i, inner in enumerate(loaders):  # (a tensor in a list is a ready-made batch)
            _check_one(inner, f"{where}[{i}]", tensors=False)
        return
    _check_one(loaders, where, tensors=True)


def _check_one(loader: Any, where: str, tensors: bool) -> None:
    if isinstance(loader, Dataset) and not isinstance(loader, IterableDataset):
        raise TypeError(
            f"{where} is a {type(loader).__name__}, a Dataset, not a loader: iterating it gives one sample at a "
            "time, without a batch dimension. Wrap it in a torch.utils.data.DataLoader: DataLoader(dataset, "
            "batch_size=32, shuffle=True) for training (DataLoader(dataset, batch_size=None) if its items are "
            "batches already)."
        )
    if tensors and isinstance(loader, torch.Tensor):
        raise TypeError(
            f"{where} is a tensor of shape {tuple(loader.shape)}, not a loader: iterating it gives its rows one at "
            "a time, without a batch dimension. Wrap the data in a torch.utils.data.DataLoader: "
            "DataLoader(TensorDataset(inputs, targets), batch_size=32)."
        )


def _is_sample(item: Any) -> bool:
    """Whether a list's ``item`` is a sample rather than a batch or a loader: it is, or directly holds, a plain
    number or a tensor of no dimension (a batch from a DataLoader has a batch dimension throughout)."""
    values = item.values() if isinstance(item, Mapping) else item if isinstance(item, (list, tuple)) else (item,)
    return any(
        (isinstance(v, Number) and not isinstance(v, bool)) or (isinstance(v, torch.Tensor) and v.dim() == 0)
        for v in values
    )


def _short(item: Any) -> str:
    text = repr(item)
    return text if len(text) <= 60 else text[:57] + "..."


def warn_if_short(loader: Any, yielded: int, expected: float, name: str, consequence: str = "") -> None:
    """Once per loader: say that ``loader`` (``name``: "train dataloader", "val dataloader 1") ran out after
    ``yielded`` batches where its length promised ``expected`` (``len()``, or less under a limit), and what
    else that means (``consequence``, a sentence). Call it when the loader's iteration ended by itself."""
    length = sized_len(loader)
    if length is None or yielded >= expected or expected == math.inf:
        return
    try:
        if loader in _warned_short:
            return
        _warned_short.add(loader)
    except TypeError:  # (an object that cannot be referenced weakly: warned every time)
        pass
    warnings.warn(
        f"The {name} yielded {yielded} batches, but its len() is {length}: the epoch ended early.{consequence} "
        "Check its dataset (a __getitem__ that raises StopIteration ends the iteration) and its sampler or "
        "batch sampler (one that yields fewer indices than its __len__ says).",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
