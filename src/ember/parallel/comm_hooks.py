"""Gradient buckets as communication sees them: their layout, their flat storage, and the hooks
that reduce them across ranks.

Layout: ``compute_bucket_assignment`` groups parameters into buckets (the order gradients are
expected to become ready, a small first bucket so communication starts early, then up to the
cap); each bucket owns one flat buffer whose views are the parameters' gradients.

A hook receives a :class:`GradBucket` (the bucket's flat gradient buffer and what is in it) and
returns a ``torch.futures.Future`` whose value is the reduced buffer. The Reducer does not divide
by the world size when a hook is set: **the hook divides**, exactly as with PyTorch's
``register_comm_hook``. :class:`GradBucket` has the methods of ``torch.distributed.GradBucket``
(``buffer``, ``index``, ``is_last``, ``gradients``, ``parameters``, ``set_buffer``), so hooks
written for PyTorch's DDP (e.g. ``functools.partial(torch_hook, state)``) run here too.

Compression trade-off: ``"bf16"`` and ``"fp16"`` halve the bytes on the wire. Each rank's
gradient is divided by the world size in fp32 and rounded once to the half type; the sum is
accumulated in that type and written back into the fp32 buffer. ``bf16`` keeps fp32's range but
only 8 significant bits (relative error up to ~2**-8 per rounding, so expect ~0.5% per element);
``fp16`` keeps 11 bits (~0.05%) but flushes magnitudes below ~6e-8 to zero and overflows above
65504. Use them when communication dominates the step; keep fp32 when exact parity matters.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Union

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GradBucket", "CommHook", "allreduce_hook", "compress_hook", "resolve_comm_hook",
           "compute_bucket_assignment", "DEFAULT_FIRST_BUCKET_BYTES", "MiB"]

MiB = 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1 * MiB

# How many tensors share a storage. Private in torch, hence the fallback: without it a dropped
# gradient buffer is never reused (always correct, one allocation per step slower).
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _users(tensor: Tensor) -> int:
    storage = tensor.untyped_storage()  # held while counting: it is one of the users
    return _use_count(storage._cdata) if _use_count is not None else 1 << 30


_SOLE_OWNER = _users(torch.empty(1))  # the count of a tensor nobody else shares


def sole_owner(buffer: Tensor) -> bool:
    """Whether no other tensor shares ``buffer``'s memory (so it may be overwritten)."""
    return _users(buffer) <= _SOLE_OWNER


def compute_bucket_assignment(params: Sequence[Tensor], order: Iterable[int],
                              limits: Sequence[int]) -> list[list[int]]:
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
    """One flat buffer and the parameters whose gradients live in it (the Reducer's storage)."""

    __slots__ = ("indices", "params", "numel", "buffer", "views", "pending", "work", "lent")

    def __init__(self, indices: list[int], params: Sequence[Tensor]) -> None:
        self.indices = indices
        self.params = [params[i] for i in indices]
        self.numel = sum(p.numel() for p in self.params)
        self.pending = len(indices)
        self.work = None  # a Work (plain all-reduce) or a Future (comm hook)
        self.lent = False  # gradients currently point into `buffer`
        # Allocated at the first gradient of a backward: every slot is written before the
        # all-reduce (a gradient, or zeros), so no zero-fill is needed.
        self.buffer: Tensor | None = None
        self.views: list[Tensor] = []

    def release(self) -> None:
        self.buffer, self.views, self.lent = None, [], False

    def allocate(self, buffer: Tensor | None = None) -> None:
        first = self.params[0]
        self.buffer = buffer if buffer is not None else \
            torch.empty(self.numel, dtype=first.dtype, device=first.device)
        self.views, offset = [], 0
        for p in self.params:
            flat = self.buffer[offset:offset + p.numel()]
            # Match the parameter's layout (e.g. channels_last) so gradients keep their strides.
            if p.is_contiguous() or p.dim() < 2:
                self.views.append(flat.view(p.shape))
            else:
                self.views.append(flat.as_strided(p.shape, p.stride()))
            offset += p.numel()


class GradBucket:
    """One bucket as a communication hook sees it.

    Args:
        index: Position of the bucket in launch order (0 launches first).
        buffer: The flat gradient buffer; the gradients of :meth:`parameters` are views into it.
        parameters: The parameters whose gradients live in this bucket, in slot order.
        gradients: Views of ``buffer`` shaped like each parameter.
        is_last: Whether this is the last bucket launched in the iteration.
    """

    __slots__ = ("_index", "_buffer", "_parameters", "_gradients", "_is_last", "prescaled")

    def __init__(self, index: int, buffer: Tensor, parameters: Sequence[Tensor],
                 gradients: Sequence[Tensor], is_last: bool) -> None:
        self._index = index
        self._buffer = buffer
        self._parameters = parameters
        self._gradients = gradients
        self._is_last = is_last
        #: True when the Reducer already divided the buffer by the world size (only for hooks
        #: that declare ``accepts_prescaled``, like the built-in compression hooks).
        self.prescaled = False

    def index(self) -> int:
        """Position of this bucket in launch order."""
        return self._index

    def buffer(self) -> Tensor:
        """The flat gradient buffer to reduce (reducing it in place is allowed)."""
        return self._buffer

    def set_buffer(self, tensor: Tensor) -> None:
        """Overwrites the bucket's buffer with ``tensor`` (same numel and dtype)."""
        self._buffer.copy_(tensor.reshape(-1))

    def gradients(self) -> list[Tensor]:
        """The per-parameter views of :meth:`buffer`."""
        return list(self._gradients)

    def parameters(self) -> list[Tensor]:
        """The parameters whose gradients are in this bucket."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """Whether this bucket is the last one launched in the iteration."""
        return self._is_last


CommHook = Callable[[GradBucket], "torch.futures.Future[Tensor]"]


def allreduce_hook(process_group: dist.ProcessGroup | None = None) -> CommHook:
    """The default reduction written as a hook: divide by the world size, then sum.

    Args:
        process_group: Group to reduce over; ``None`` means the default group.
    """

    def hook(bucket: GradBucket) -> torch.futures.Future[Tensor]:
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size(process_group))
        fut = dist.all_reduce(buffer, group=process_group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    return hook


def compress_hook(dtype: torch.dtype, process_group: dist.ProcessGroup | None = None) -> CommHook:
    """All-reduce in a narrower float type and decompress into the bucket's buffer.

    Args:
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        process_group: Group to reduce over; ``None`` means the default group.
    """

    def hook(bucket: GradBucket) -> torch.futures.Future[Tensor]:
        buffer = bucket.buffer()
        # Divide in full precision, then round once into the narrow type: the division adds no
        # rounding error and fp16 sums cannot overflow. (A fused mul with a bf16 `out` would
        # compute into a hidden fp32 temporary: slower and a whole buffer more memory.)
        if not getattr(bucket, "prescaled", False):
            buffer.mul_(1.0 / dist.get_world_size(process_group))
        compressed = buffer.to(dtype)
        fut = dist.all_reduce(compressed, group=process_group, async_op=True).get_future()

        def decompress(f: torch.futures.Future[list[Tensor]]) -> Tensor:
            # In place into the fp32 buffer: gradients are views of it, so no further copy.
            buffer.copy_(f.value()[0])
            return buffer

        return fut.then(decompress)

    hook.accepts_prescaled = True  # type: ignore[attr-defined]
    return hook


_NAMED = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_comm_hook(spec: Union[str, CommHook, None],
                      process_group: dist.ProcessGroup | None) -> CommHook | None:
    """Turns the ``comm_hook`` option into a hook.

    Args:
        spec: ``None`` (plain all-reduce, pre-divided by the reducer), ``"bf16"``, ``"fp16"``,
            or a callable ``hook(bucket: GradBucket) -> Future[Tensor]`` that divides itself.
        process_group: The group the wrapper reduces over.

    Raises:
        ValueError: If ``spec`` is an unknown name or not callable.
    """
    if spec is None or callable(spec):
        return spec
    if isinstance(spec, str) and spec in _NAMED:
        return compress_hook(_NAMED[spec], process_group)
    raise ValueError(
        f"comm_hook={spec!r} is not a known communication hook. Expected None, one of "
        f"{sorted(_NAMED)}, or a callable hook(bucket) -> torch.futures.Future[Tensor] that "
        "divides by the world size itself."
    )
