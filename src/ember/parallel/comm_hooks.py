"""Communication hooks: how a gradient bucket is reduced across ranks (the buckets' layout and
storage are in ``buckets.py``).

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

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GradBucket", "CommHook", "allreduce_hook", "compress_hook", "resolve_comm_hook"]


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

    def __init__(
        self, index: int, buffer: Tensor, parameters: Sequence[Tensor], gradients: Sequence[Tensor], is_last: bool
    ) -> None:
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


def resolve_comm_hook(spec: str | CommHook | None, process_group: dist.ProcessGroup | None) -> CommHook | None:
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
