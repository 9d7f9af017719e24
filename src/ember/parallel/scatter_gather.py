"""Scatter a nested batch across devices and gather replica outputs back.

A batch is any nesting of tuples, lists, dicts (the dict type is kept), namedtuples, torch's
structseq return types and dataclasses, with tensors and other objects at the leaves. Scatter
splits every tensor along ``dim`` with :func:`torch.chunk` semantics (chunk size ``ceil(B / N)``,
so a small batch yields fewer chunks than devices) and shares every other leaf by reference;
gather concatenates tensors back along ``dim`` on one device.

Both work on a flattened view of the structure (``flatten`` / ``unflatten``) so that one
recursive walk serves scatter, gather and their error messages.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

from ember.user_frames import user_stacklevel

DeviceLike = torch.device | str | int

__all__ = [
    "DeviceLike",
    "Gather",
    "Scatter",
    "as_device",
    "chunk_sizes",
    "flatten",
    "gather",
    "scatter",
    "scatter_kwargs",
    "unflatten",
]


def as_device(device: DeviceLike) -> torch.device:
    """Turn ``0`` / ``"cuda:1"`` / ``"cpu"`` / ``torch.device`` into a ``torch.device``.

    Integers mean CUDA device indices, as in ``torch.nn.DataParallel(device_ids=[0, 1])``;
    ``-1`` means the CPU, as for PyTorch's ``output_device`` / ``gather(target_device=-1)``.
    """
    if isinstance(device, torch.device):
        return device
    if isinstance(device, int):
        return torch.device("cpu") if device == -1 else torch.device("cuda", device)
    if isinstance(device, str):
        return torch.device(device)
    raise TypeError(f"expected a device (torch.device, 'cpu', 'cuda:0' or an int), got {device!r}")


# ---------------------------------------------------------------------------------------------
# Structure walking
# ---------------------------------------------------------------------------------------------
# Own walker, not lightning-utilities' ``apply_to_collection`` (a one-to-one map of leaves):
# scatter maps one structure to N replicas (each tensor to N chunks, every replica rebuilt
# around its own chunks), gather maps N structures to one and must first check that they match,
# and the error messages name a leaf by its path. The leaves-plus-spec view gives all three.
# It also rebuilds what the library does not: frozen dataclasses (``dataclasses.replace``; the
# library raises) and mappings with state of their own (``copy.copy`` keeps a UserDict
# subclass's attributes; the library rebuilds from the items alone and drops them).
class Spec(NamedTuple):
    """How to rebuild one container level: its kind, type, keys, child specs and a template."""

    kind: str  # "tuple" | "list" | "namedtuple" | "structseq" | "dict" | "mapping" | "dataclass"
    type: type
    keys: tuple
    children: tuple  # one Spec, or None for a leaf, per key
    template: Any  # the original object (for copying a mapping or replacing dataclass fields)


def _dataclass_fields(obj: Any) -> tuple[str, ...]:
    # Only fields that __init__ takes: dataclasses.replace() rebuilds through __init__, and fields
    # with init=False are left to __post_init__, as for any freshly made instance.
    return tuple(f.name for f in dataclasses.fields(obj) if f.init)


def _container(obj: Any) -> tuple[str, tuple, list] | None:
    """(kind, keys, values) if ``obj`` is a container we walk, else None (a leaf).

    Empty containers are leaves: like any other non-tensor leaf they go to every replica by
    reference, which is also what lets gather(scatter(x)) give them back unchanged.
    """
    if isinstance(obj, Tensor):
        return None
    if isinstance(obj, tuple):
        if not obj:
            return None
        if hasattr(obj, "_fields") and hasattr(obj, "_asdict"):
            return "namedtuple", tuple(range(len(obj))), list(obj)
        if type(obj) is tuple:
            return "tuple", tuple(range(len(obj))), list(obj)
        if hasattr(type(obj), "n_fields"):  # torch.return_types.* (structseq)
            return "structseq", tuple(range(len(obj))), list(obj)
        return None
    if isinstance(obj, list):
        return ("list", tuple(range(len(obj))), list(obj)) if obj else None
    if isinstance(obj, Mapping):
        # Read-only mappings cannot be rebuilt item by item, so they stay leaves.
        if not obj or not isinstance(obj, MutableMapping):
            return None
        kind = "dict" if type(obj) in (dict, OrderedDict) else "mapping"
        return kind, tuple(obj.keys()), list(obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = _dataclass_fields(obj)
        return ("dataclass", names, [getattr(obj, n) for n in names]) if names else None
    return None


def flatten(obj: Any) -> tuple[list[Any], Spec | None]:
    """Flatten ``obj`` into its leaves (tensors and other objects) and a :class:`Spec`.

    The spec is ``None`` when ``obj`` is itself a leaf.
    """
    leaves: list[Any] = []
    return leaves, _flatten(obj, leaves)


def _flatten(obj: Any, leaves: list[Any]) -> Spec | None:
    found = _container(obj)
    if found is None:
        leaves.append(obj)
        return None
    kind, keys, values = found
    children = tuple(_flatten(v, leaves) for v in values)
    return Spec(kind, type(obj), keys, children, obj)


def unflatten(spec: Spec | None, leaves: Sequence[Any]) -> Any:
    """Rebuild the structure described by ``spec`` around ``leaves`` (the inverse of flatten)."""
    it = iter(leaves)
    return _unflatten(spec, it)


def _unflatten(spec: Spec | None, it: Any) -> Any:
    if spec is None:
        return next(it)
    values = [_unflatten(child, it) for child in spec.children]
    kind, typ = spec.kind, spec.type
    if kind in ("tuple", "list"):
        return typ(values)
    if kind == "namedtuple":
        return typ(*values)
    if kind == "structseq":
        return typ(values)
    if kind == "dict":
        return typ(zip(spec.keys, values))
    if kind == "mapping":
        # copy.copy keeps what the constructor alone would lose (defaultdict's factory, a
        # UserDict subclass's attributes), then the items are swapped for the new ones.
        new = copy.copy(spec.template)
        new.clear()
        new.update(zip(spec.keys, values))
        return new
    return dataclasses.replace(spec.template, **dict(zip(spec.keys, values)))


def leaf_paths(spec: Spec | None, root: str = "batch") -> list[str]:
    """Human-readable paths of the leaves, in flatten order, for error messages."""
    if spec is None:
        return [root]
    out: list[str] = []
    for key, child in zip(spec.keys, spec.children):
        if spec.kind == "dataclass":
            sub = f"{root}.{key}"
        elif spec.kind == "namedtuple":
            sub = f"{root}.{cast(Any, spec.type)._fields[key]}"
        else:
            sub = f"{root}[{key!r}]"
        out.extend(leaf_paths(child, sub))
    return out


def _spec_mismatch(a: Spec | None, b: Spec | None, path: str) -> str | None:
    """Where two specs differ (as a sentence), or None when they describe the same structure."""
    if a is None or b is None:
        return None if a is b else f"at {path} one is a container and the other a leaf"
    if a.kind != b.kind or a.type is not b.type:
        return f"at {path} the types differ: {a.type.__name__} vs {b.type.__name__}"
    if a.keys != b.keys:
        if a.kind in ("dict", "mapping"):
            return f"at {path} the dict keys differ: {list(a.keys)} vs {list(b.keys)}"
        return f"at {path} the lengths or fields differ: {len(a.keys)} vs {len(b.keys)}"
    for key, ca, cb in zip(a.keys, a.children, b.children):
        found = _spec_mismatch(ca, cb, f"{path}[{key!r}]")
        if found:
            return found
    return None


# ---------------------------------------------------------------------------------------------
# Autograd functions
# ---------------------------------------------------------------------------------------------
_background_streams: dict[torch.device, Any] = {}


def _background_stream(device: torch.device) -> Any:
    # One long-lived side stream per CUDA device so host-to-device copies of the chunks do not
    # queue behind compute already on the current stream.
    if device not in _background_streams:
        _background_streams[device] = torch.cuda.Stream(device)
    return _background_streams[device]


def copy_to(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``; host-to-GPU copies go on a side stream and never block the host."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        # A CPU source has no GPU work to wait for, so the copy goes on a side stream without
        # waiting for the current one: a pinned chunk then lands while the GPU still computes.
        # Only the current stream waits for the copy (PyTorch's Scatter does the same).
        stream = _background_stream(device)
        with torch.cuda.stream(stream):
            out = t.to(device, non_blocking=True)
        main = torch.cuda.current_stream(device)
        main.wait_stream(stream)
        out.record_stream(main)  # the allocator must not reuse it before ``main`` is done
        return out
    # GPU to GPU: on the current streams, which orders the copy after the work producing ``t``.
    # Towards the CPU: blocking, since the caller reads the result at once.
    return t.to(device, non_blocking=device.type == "cuda")


class Scatter(torch.autograd.Function):
    """Split ``input`` along ``dim`` into chunks of ``sizes`` on ``devices``; backward gathers."""

    @staticmethod
    def forward(
        ctx: Any, devices: Sequence[torch.device], sizes: Sequence[int], dim: int, input: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.dim, ctx.input_device = dim, input.device
        chunks = input.split(list(sizes), dim)
        return tuple(copy_to(c, d) for c, d in zip(chunks, devices))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        return (None, None, None, Gather.apply(ctx.input_device, ctx.dim, *grads))


class Gather(torch.autograd.Function):
    """Concatenate ``inputs`` along ``dim`` on ``device`` (0-dim inputs become a vector)."""

    @staticmethod
    def forward(ctx: Any, device: torch.device, dim: int, *inputs: Tensor) -> Tensor:
        ctx.dim, ctx.devices = dim, [t.device for t in inputs]
        ctx.scalars = all(t.dim() == 0 for t in inputs)
        if ctx.scalars:
            inputs = tuple(t.view(1) for t in inputs)
            ctx.dim = dim = 0
        ctx.sizes = [t.size(dim) for t in inputs]
        # Asynchronous only towards a GPU: torch.cat would read a CPU copy before it landed.
        async_copy = device.type == "cuda"
        return torch.cat([t.to(device, non_blocking=async_copy) for t in inputs], dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        grads = Scatter.apply(ctx.devices, ctx.sizes, ctx.dim, grad)
        if ctx.scalars:
            grads = tuple(g.view(()) for g in grads)
        return (None, None, *grads)


# ---------------------------------------------------------------------------------------------
# scatter / gather
# ---------------------------------------------------------------------------------------------
def chunk_sizes(batch_size: int, num_devices: int) -> list[int]:
    """Chunk sizes :func:`torch.chunk` gives: ``ceil(B/N)`` each, the remainder last.

    Fewer than ``num_devices`` chunks come back when the batch is small (5 over 4 -> [2, 2, 1]).
    """
    if num_devices < 1:
        raise ValueError(f"need at least one device to scatter to, got {num_devices}")
    if batch_size == 0:
        return [0] * num_devices
    size = math.ceil(batch_size / num_devices)
    return [size] * (batch_size // size) + ([batch_size % size] if batch_size % size else [])


def scatter(inputs: Any, target_devices: Sequence[DeviceLike], dim: int = 0) -> list[Any]:
    """Split every tensor in ``inputs`` along ``dim`` across ``target_devices``.

    Args:
        inputs: a tensor or a nesting of tuples/lists/dicts/namedtuples/dataclasses.
        target_devices: where the chunks go, one chunk per device (fewer when the batch is small).
        dim: the batch dimension.

    Returns:
        One structure like ``inputs`` per chunk. Non-tensor leaves are the same objects in every
        copy. On CPU the chunks are views; to CUDA they are copied on a side stream.

    Raises:
        ValueError: ``inputs`` holds no tensor, or its tensors differ in size along ``dim``.
    """
    devices = [as_device(d) for d in target_devices]
    leaves, spec = flatten(inputs)
    split = _split_leaves(leaves, spec, devices, dim)
    return [unflatten(spec, replica_leaves) for replica_leaves in split]


def _split_leaves(leaves: list[Any], spec: Spec | None, devices: list[torch.device], dim: int) -> list[list[Any]]:
    tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
    if not tensor_at:
        kinds = sorted({type(leaf).__name__ for leaf in leaves}) or ["nothing"]
        raise ValueError(
            f"cannot scatter a batch that holds no tensor (found only: {', '.join(kinds)}); "
            f"data parallelism splits tensors along dim {dim} across devices. Pass the batch as "
            "tensors, or call the wrapped module directly for inputs that cannot be split."
        )
    sizes = {}
    for i in tensor_at:
        t = leaves[i]
        if t.dim() <= dim:
            raise ValueError(
                f"cannot split {leaf_paths(spec)[i]} (a {t.dim()}-dim tensor) along dim {dim}. "
                f"Give it a batch dimension, or pass it as a Python number or a module attribute."
            )
        sizes[i] = t.size(dim)
    if len(set(sizes.values())) > 1:
        paths = leaf_paths(spec)
        listed = ", ".join(f"{paths[i]}: {s}" for i, s in sizes.items())
        raise ValueError(
            f"every tensor in the batch must have the same size along dim {dim} to be split "
            f"into matching chunks, got {listed}. Move tensors that are not per-sample (lookup "
            f"tables, masks shared by the batch) into the module, or give them a batch dimension."
        )
    per_chunk = chunk_sizes(next(iter(sizes.values())), len(devices))
    n = len(per_chunk)
    out: list[list[Any]] = [list(leaves) for _ in range(n)]
    for i in tensor_at:
        for r, chunk in enumerate(_split_tensor(leaves[i], devices[:n], per_chunk, dim)):
            out[r][i] = chunk
    return out


def _split_tensor(t: Tensor, devices: list[torch.device], sizes: list[int], dim: int) -> Sequence[Tensor]:
    if all(d == t.device for d in devices) and not (t.requires_grad and torch.is_grad_enabled()):
        # The common case (CPU batch, CPU replicas, no grad through the input): plain views.
        return t.split(sizes, dim)
    return Scatter.apply(devices, sizes, dim, t)


def scatter_kwargs(
    inputs: tuple, kwargs: dict[str, Any] | None, target_devices: Sequence[DeviceLike], dim: int = 0
) -> tuple[list[tuple], list[dict[str, Any]]]:
    """Scatter positional and keyword arguments together, into equally long lists.

    Both are split as one batch, so their tensors must agree in size along ``dim`` and every
    replica gets a positional tuple and a kwargs dict. With neither, two empty lists come back.
    """
    kwargs = kwargs or {}
    if not inputs and not kwargs:
        return [], []
    pairs = scatter((tuple(inputs), dict(kwargs)), target_devices, dim)
    return [args for args, _ in pairs], [kw for _, kw in pairs]


def gather(
    outputs: Sequence[Any],
    target_device: DeviceLike,
    dim: int = 0,
    *,
    warn_on_scalars: bool = True,
    combine_scalars: Callable[[list[Tensor]], Tensor] | None = None,
) -> Any:
    """Concatenate replica outputs along ``dim`` on ``target_device``.

    Args:
        outputs: one output per replica, all with the same structure.
        target_device: where the result lives.
        dim: the dimension to concatenate along.
        warn_on_scalars: warn when 0-dim tensors are turned into a vector (one value per replica).
        combine_scalars: if given, turns the replicas' 0-dim tensors at one place into one
            tensor (e.g. a weighted mean) instead of a vector.

    Returns:
        One structure like each output. ``None`` stays ``None``; another non-tensor leaf is kept
        when every replica returned the same object and becomes a list of values otherwise.

    Raises:
        ValueError: the replicas returned different structures (e.g. different dict keys).
    """
    if not outputs:
        raise ValueError("gather needs at least one replica output, got an empty list")
    device = as_device(target_device)
    flat = [flatten(out) for out in outputs]
    spec = flat[0][1]
    for r, (_, other) in enumerate(flat[1:], start=1):
        problem = _spec_mismatch(spec, other, "output")
        if problem:
            raise ValueError(
                f"replica 0 and replica {r} returned different structures: "
                f"{problem}. Every replica must return the same structure."
            )
    columns = zip(*(leaves for leaves, _ in flat))
    return unflatten(spec, [_gather_leaf(list(col), device, dim, warn_on_scalars, combine_scalars) for col in columns])


def _gather_leaf(
    values: list[Any], device: torch.device, dim: int, warn: bool, combine: Callable[[list[Tensor]], Tensor] | None
) -> Any:
    first = values[0]
    if isinstance(first, Tensor):
        if not all(isinstance(v, Tensor) for v in values):
            raise ValueError(
                f"replica 0 returned a tensor where another returned "
                f"{[type(v).__name__ for v in values]}; outputs must match"
            )
        scalars = all(v.dim() == 0 for v in values)
        if scalars and combine is not None:
            return combine(values)
        if warn and scalars:
            warnings.warn(
                f"Was asked to gather along dimension {dim}, but all input tensors "
                "were scalars; will instead unsqueeze and return a vector.",
                stacklevel=user_stacklevel(),
            )
        if len(values) == 1 and first.device == device and first.dim() > 0:
            return first  # nothing to concatenate: skip a copy
        return Gather.apply(device, dim, *values)
    return first if all(v is first or _equal(v, first) for v in values) else values


def _equal(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an == that is not a bool (arrays): not "the same"
        return False
