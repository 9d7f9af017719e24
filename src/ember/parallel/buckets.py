"""Gradient buckets' layout and storage.

``compute_bucket_assignment`` groups parameters into buckets (the order gradients are expected to
become ready, a small first bucket so communication starts early, then up to the cap); each
bucket owns one flat buffer (:class:`FlatBucket`) whose views are the parameters' gradients. The
buffers are slices of one allocation per dtype and device (``allocate_missing``).
How a bucket is reduced across ranks is in ``comm_hooks.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "FlatBucket",
    "compute_bucket_assignment",
    "allocate_missing",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "MiB",
    "LARGE_NUMEL",
]

MiB = 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1 * MiB

# How many tensors share a storage. Private in torch, hence the fallback: without it a dropped
# gradient buffer is never reused (always correct, one allocation per step slower).
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _users(tensor: Tensor) -> int:
    storage = tensor.untyped_storage()  # held while counting: it is one of the users
    return _use_count(storage._cdata) if _use_count is not None else 1 << 30


_SOLE_OWNER = _users(torch.empty(1))  # the count of a tensor nobody else shares
_VIEW_REFS = 2  # sys.getrefcount(views[k]) of a view only its bucket's list holds
LARGE_NUMEL = 1 << 16  # 256 KiB of fp32: an op's fixed cost is small next to a pass over it


def dense(tensor: Tensor) -> bool:
    """Whether the tensor's elements fill ``numel`` consecutive slots in some dimension order
    (no gaps, no overlaps): strides sorted ascending are the running products of their sizes."""
    expected = 1
    for size, stride in sorted((d for d in zip(tensor.shape, tensor.stride()) if d[0] != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def compute_bucket_assignment(params: Sequence[Tensor], order: Iterable[int], limits: Sequence[int]) -> list[list[int]]:
    """Groups parameter indices into buckets, walking them in ``order``.

    Each (dtype, device) fills its own buckets. A parameter is added before the size check, so a
    bucket may exceed its limit by one tensor and a tensor larger than the limit is a bucket of
    its own. The k-th bucket of a key uses ``limits[k]`` (the last limit repeats).

    Args:
        params: The parameters, indexed by position.
        order: The indices in the order gradients are expected to become ready.
        limits: Byte limits, e.g. ``[1 MiB, 25 MiB]``.

    Returns:
        Lists of indices, ordered by where their first index appears in ``order``.
    """
    open_: dict[tuple, tuple[list[int], int, int]] = {}  # key -> (indices, bytes, n closed)
    done: list[list[int]] = []
    position: dict[int, int] = {}
    for pos, i in enumerate(order):
        position[i] = pos
        p = params[i]
        key = (p.dtype, p.device)
        indices, size, closed = open_.get(key, ([], 0, 0))
        indices.append(i)
        size += p.numel() * p.element_size()
        if size >= limits[min(closed, len(limits) - 1)]:
            done.append(indices)
            indices, size, closed = [], 0, closed + 1
        open_[key] = (indices, size, closed)
    done.extend(indices for indices, _, _ in open_.values() if indices)
    return sorted(done, key=lambda b: position[b[0]])


class FlatBucket:
    """One flat buffer and the parameters whose gradients live in it (the Reducer's storage).

    The views are made once per buffer and kept: the gradients are set to them and accumulate
    there in place, so no step pays for slicing the buffer again. Parameters of at least
    :data:`LARGE_NUMEL` elements are marked ``large``: for them one op per step costs nothing next
    to the data, so the Reducer copies their gradients in (dividing while copying, one pass)
    rather than pre-zeroing and accumulating in place (three passes). The small slots come first
    in the buffer, so they are zeroed and divided as one contiguous prefix.
    """

    __slots__ = ("indices", "params", "numel", "large", "small_numel", "buffer", "views", "pending", "work")

    def __init__(self, indices: list[int], params: Sequence[Tensor]) -> None:
        self.indices = indices
        self.params = [params[i] for i in indices]
        self.numel = sum(p.numel() for p in self.params)
        self.large = bytearray(p.numel() >= LARGE_NUMEL for p in self.params)
        self.small_numel = sum(p.numel() for p in self.params if p.numel() < LARGE_NUMEL)
        self.pending = len(indices)
        self.work: Any = None  # a Work (plain all-reduce) or a Future (comm hook)
        self.buffer: Tensor | None = None  # allocated at the first backward that needs it
        self.views: list[Tensor] = []

    def allocate(self, buffer: Tensor | None = None) -> None:
        """Gives the bucket a buffer and views of it.

        Args:
            buffer: ``numel`` uninitialised elements (a slice of a larger allocation), or
                ``None`` for a fresh allocation of its own.
        """
        first = self.params[0]
        self.buffer = buffer if buffer is not None else torch.empty(self.numel, dtype=first.dtype, device=first.device)
        self.views = [first] * len(self.params)  # placeholders, all replaced below
        offset = 0
        for large in (0, 1):  # small slots first: a contiguous prefix
            for k, p in enumerate(self.params):
                if self.large[k] != large:
                    continue
                flat = self.buffer[offset : offset + p.numel()]
                # Match the parameter's layout (e.g. channels_last) so gradients keep strides,
                # but only a dense one: the strides of a parameter with gaps (a slice such as
                # ``w[:, ::2]``) would reach past its slot into its neighbours' (PyTorch's
                # ``initialize_bucket_views`` falls back to a contiguous view the same way).
                if p.is_contiguous() or p.dim() < 2 or not dense(p):
                    self.views[k] = flat.view(p.shape)
                else:
                    self.views[k] = flat.as_strided(p.shape, p.stride())
                offset += p.numel()

    def shared(self, dropped: Iterable[int], buckets: Sequence[FlatBucket]) -> bool:
        """Whether memory of the buffer is held outside the reducer and the gradients.

        Args:
            dropped: Slots whose parameter no longer has its view as gradient.
            buckets: All the reducer's buckets (some may be slices of the same allocation).
        """
        buffer = self.buffer
        if buffer is None:
            return False
        # Our tensors on this memory: the allocation the buffers are slices of, and each
        # bucket's buffer and views. Anything more (a tensor derived from a gradient, say) is
        # someone else's.
        here = buffer.untyped_storage().data_ptr()
        ours = int(buffer._base is not None)
        for b in buckets:
            if b.buffer is not None and b.buffer.untyped_storage().data_ptr() == here:
                ours += 1 + len(b.views)
        if _users(buffer) > _SOLE_OWNER - 1 + ours:
            return True
        # A dropped view still referenced (from Python, or from C++, which keeps its Python
        # object alive with one reference) would see its values overwritten.
        views = self.views
        return any(sys.getrefcount(views[k]) > _VIEW_REFS for k in dropped)


def allocate_missing(buckets: Sequence[FlatBucket], spare: Sequence[Tensor]) -> None:
    """Gives the buckets without a buffer one: one allocation per dtype and device.

    Args:
        buckets: All the reducer's buckets.
        spare: Allocations from before a bucket rebuild; one of the right size that nothing
            holds any more (the gradients were dropped) is reused, so the rebuild costs no
            memory and leaves no hole in the heap.
    """
    groups: dict[tuple, list[FlatBucket]] = {}
    for b in buckets:
        if b.buffer is None:
            first = b.params[0]
            groups.setdefault((first.dtype, first.device), []).append(b)
    for (dtype, device), group in groups.items():
        total = sum(b.numel for b in group)
        arena = next(
            (
                t
                for t in spare
                if t.dtype == dtype and t.device == device and t.numel() == total and _users(t) <= _SOLE_OWNER
            ),
            None,
        )
        if arena is None:
            arena = torch.empty(total, dtype=dtype, device=device)
        offset = 0
        for b in group:
            b.allocate(arena[offset : offset + b.numel])
            offset += b.numel
