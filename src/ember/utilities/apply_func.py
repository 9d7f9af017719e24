"""``move_data_to_device``: a batch (a tensor, or a collection of them) moved to a device."""

from __future__ import annotations

import abc
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

__all__ = ["move_data_to_device"]

# Copies to these are not issued non-blocking: the caller may read the result at once.
_BLOCKING_DEVICE_TYPES = ("cpu", "mps")


class _Movable(abc.ABC):
    """Matches (in ``isinstance``) any object whose class has a callable ``to``: tensors, modules, user types."""

    @abc.abstractmethod
    def to(self, device: torch.device | str | int) -> Any:
        """Return the object on ``device`` (or move it in place and return ``None``)."""

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        return callable(getattr(subclass, "to", None))


def move_data_to_device(batch: Any, device: torch.device | str | int) -> Any:
    """Return ``batch`` with every tensor, and every other object that has a ``to(device)`` method, moved.

    Walks what lightning-utilities' ``apply_to_collection`` walks (mappings, sequences, namedtuples,
    dataclasses); other leaves are returned as they are. A ``to`` that returns ``None`` (one that moves its
    object in place) leaves the object itself in the result. Tensor copies to an accelerator are
    non-blocking. The Trainer moves batches with its own walker (``TrainModule.transfer_batch_to_device``);
    this is Lightning's public helper for user code.

    Args:
        batch: a tensor, an object with a ``to`` method, or a collection of them.
        device: where to move them: a :class:`torch.device`, a string such as ``"cuda:0"``, or an index.

    Returns:
        A collection of the same structure on ``device``.
    """
    if isinstance(device, str):
        device = torch.device(device)

    def move(data: Any) -> Any:
        non_blocking = (
            isinstance(data, torch.Tensor)
            and isinstance(device, torch.device)
            and device.type not in _BLOCKING_DEVICE_TYPES
        )
        moved = data.to(device, non_blocking=True) if non_blocking else data.to(device)
        return data if moved is None else moved

    return apply_to_collection(batch, dtype=_Movable, function=move)
