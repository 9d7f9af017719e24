"""Differentiable replicas of a module, one per device.

A replica is a shallow copy of every submodule (same class, same attributes, hooks shared with
the original) whose parameters are plain tensors, not ``Parameter`` objects (they are not
leaves). Unlike PyTorch's replicas, whose ``parameters()`` is empty, ember's list these tensors
in ``_parameters`` too, so ``self.parameters()``, ``next(self.parameters()).device`` or
``TrainModule.device`` inside a replica's forward or step see the replica's own tensors (and a
penalty computed from them gets its gradient). How those tensors relate to the original
parameters depends on the mode:

- ``"graph"``: outputs of :class:`Broadcast`, whose backward (:class:`ReduceAdd`) sums every
  replica's gradient into the original parameter's ``.grad``: one autograd graph spans the
  replicas. This is PyTorch's DataParallel design.
- ``"leaf"``: the replicas on each device share leaf tensors standing for the originals, so each
  replica has its own graph; :func:`ember.parallel.parallel_apply.attach_replica_graphs` ties
  them back and runs their backward passes in parallel threads (what makes CPU replicas scale).
- ``"detached"``: no autograd at all (inference under ``no_grad``).

On the first device the replica shares storage with the original: in-place buffer updates there
(BatchNorm running statistics) persist. Buffers of the other replicas are copies, so their
updates are lost. Parameters of another replica on the same (CPU) device are aliases of the
originals: a copy would cost time and memory and buy nothing.

:class:`Replicator` caches the traversal of the module tree (which modules, which parameter and
buffer names, which children) between calls and checks it cheaply each time. The tensors are
re-read on every call, so parameters replaced or moved (``load_state_dict``, ``.to()``, a new
``Parameter``) are always seen, and the shallow module copies are made afresh each call:
reusing them would need the same dict copy to pick up attribute changes (``train()``/``eval()``),
and fresh copies cannot be disturbed by a caller that keeps a replica from an earlier step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ember.parallel.scatter_gather import DeviceLike, as_device

__all__ = ["Broadcast", "DeviceMismatchError", "ReduceAdd", "Replicas", "Replicator", "replicate"]

_COALESCE_BYTES = 10 * 1024 * 1024  # per copy when sending many small tensors to another GPU


class DeviceMismatchError(ValueError, RuntimeError):
    """A parameter or buffer is not on the first device (a ``RuntimeError`` as in PyTorch too)."""


# ---------------------------------------------------------------------------------------------
# Copies
# ---------------------------------------------------------------------------------------------
def _layout(t: Tensor) -> tuple[list[int], tuple[int, ...]]:
    """``t``'s dimensions from outermost to innermost in memory, and the strides a copy gets.

    A tensor that covers its memory densely without overlap (contiguous, channels_last, a
    transpose) keeps its strides, so ``.permute(order)`` is a view of it laid out contiguously.
    Any other (a strided slice, an expanded tensor) gets contiguous strides, as ``.contiguous()``.
    """
    strides_now = t.stride()
    order = sorted(range(t.dim()), key=lambda d: -strides_now[d])  # stable: ties keep their order
    if not t.permute(order).is_contiguous():
        order = list(range(t.dim()))
    strides = [0] * t.dim()
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(t.size(d), 1)
    return order, tuple(strides)


def _pieces(
    flat: Tensor,
    like: Sequence[Tensor],
    layouts: Sequence[tuple[list[int], tuple]],
) -> list[Tensor]:
    """Cut ``flat`` into tensors shaped (and strided) as ``like``, each its own tensor.

    ``.data`` rather than a view: views of one flat tensor would share its autograd version
    counter, so an in-place update of one (a replica's BatchNorm statistics) would make backward
    fail for any other that autograd saved ("modified by an inplace operation"). PyTorch's
    ``broadcast_coalesced`` and ``reduce_add_coalesced`` detach their outputs so for that reason.
    """
    out, start = [], flat.storage_offset()
    for t, (_, strides) in zip(like, layouts):
        out.append(flat.as_strided(t.shape, strides, start).data)
        start += t.numel()
    return out


def _copy_to(tensors: Sequence[Tensor], device: torch.device) -> list[Tensor]:
    """Copy ``tensors`` to ``device``, coalesced into few large copies per dtype.

    Every copy keeps its source's memory layout (channels_last stays channels_last) and has its
    own autograd version counter, as a separate ``.to()`` per tensor would give.
    """
    out: list[Any] = [None] * len(tensors)
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            out[i] = t.to(device)
        else:
            groups.setdefault(t.dtype, []).append(i)
    for bucket in _buckets(tensors, groups.values()):
        layouts = [_layout(tensors[j]) for j in bucket]
        flat = torch.cat([tensors[j].permute(order).reshape(-1) for j, (order, _) in zip(bucket, layouts)])
        moved = flat.to(device, non_blocking=device.type == "cuda")
        for j, piece in zip(bucket, _pieces(moved, [tensors[j] for j in bucket], layouts)):
            out[j] = piece
    return out


def _buckets(tensors: Sequence[Tensor], groups: Any) -> list[list[int]]:
    """Indices of ``tensors`` (already grouped by dtype) in buckets of about ``_COALESCE_BYTES``."""
    out = []
    for idx in groups:
        bucket: list[int] = []
        size = 0
        for i in idx:
            bucket.append(i)
            size += tensors[i].numel() * tensors[i].element_size()
            if size >= _COALESCE_BYTES:
                out.append(bucket)
                bucket, size = [], 0
        if bucket:
            out.append(bucket)
    return out


def _reduce_add_coalesced(rows: Sequence[Sequence[Tensor]], destination: torch.device) -> list[Tensor]:
    """``sum(row[j] for row in rows)`` on ``destination`` for every ``j``, moving each replica's
    tensors in few large copies per dtype instead of one copy per tensor (PyTorch's
    ``reduce_add_coalesced``). The sums keep the first row's memory layout."""
    first = rows[0]
    out: list[Any] = [None] * len(first)
    groups: dict[torch.dtype, list[int]] = {}
    for j, t in enumerate(first):
        if t.layout != torch.strided or any(r[j].layout != torch.strided for r in rows):
            out[j] = _sum_parts([r[j] for r in rows], destination)
        else:
            groups.setdefault(t.dtype, []).append(j)
    async_copy = destination.type == "cuda"  # towards the CPU the sum reads the copy at once
    for bucket in _buckets(first, groups.values()):
        layouts = [_layout(first[j]) for j in bucket]
        total: Tensor | None = None
        for row in rows:
            flat = torch.cat([row[j].permute(order).reshape(-1) for j, (order, _) in zip(bucket, layouts)])
            flat = flat.to(destination, non_blocking=async_copy)
            if total is None:
                total = flat  # torch.cat made it: ours to add into
            else:
                total.add_(flat)
        assert total is not None
        for j, piece in zip(bucket, _pieces(total, [first[j] for j in bucket], layouts)):
            out[j] = piece
    return out


def _sum_parts(parts: Sequence[Tensor], destination: torch.device) -> Tensor:
    # Only towards a GPU may the copy be asynchronous: a CPU result is read at once.
    moved = [g.to(destination, non_blocking=destination.type == "cuda") for g in parts]
    total = moved[0] + moved[1] if len(moved) > 1 else moved[0].clone()
    for g in moved[2:]:
        total.add_(g)
    return total


class Broadcast(torch.autograd.Function):
    """Copies of ``inputs`` on every device (aliases where the device is the source's).

    Outputs are flat: all inputs for ``devices[0]``, then all for ``devices[1]``, and so on.
    The backward sums each input's gradients from every device (:class:`ReduceAdd`).
    """

    @staticmethod
    def forward(ctx: Any, devices: Sequence[torch.device], *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.devices, ctx.num_inputs = list(devices), len(inputs)
        ctx.source = inputs[0].device
        outputs: list[Tensor] = []
        for device in devices:
            if device == ctx.source:
                outputs.extend(t.view_as(t) for t in inputs)
            else:
                outputs.extend(_copy_to(inputs, device))
        frozen = [not need for need in ctx.needs_input_grad[1:]]
        ctx.mark_non_differentiable(*(o for k, o in enumerate(outputs) if frozen[k % len(inputs)]))
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        return (None, *ReduceAdd.apply(ctx.source, ctx.num_inputs, *grads))


class ReduceAdd(torch.autograd.Function):
    """Sum per-device gradients (laid out as :class:`Broadcast` outputs) onto ``destination``."""

    @staticmethod
    def forward(ctx: Any, destination: torch.device, num_inputs: int, *grads: Tensor) -> tuple[Tensor, ...]:
        ctx.devices = [grads[k].device for k in range(0, len(grads), num_inputs)]
        if all(g.device == destination for g in grads):
            # Nothing to move: one add per tensor (a coalesced sum would only add two copies).
            return tuple(_sum_parts(grads[j::num_inputs], destination) for j in range(num_inputs))
        rows = [grads[k : k + num_inputs] for k in range(0, len(grads), num_inputs)]
        return tuple(_reduce_add_coalesced(rows, destination))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        return (None, None, *Broadcast.apply(ctx.devices, *grads))


# ---------------------------------------------------------------------------------------------
# Module structure
# ---------------------------------------------------------------------------------------------
class _Plan:
    """The module tree flattened once: modules, their parameter/buffer names and children."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.modules = list(root.modules())  # de-duplicated, root first
        index = {id(m): k for k, m in enumerate(self.modules)}
        self.children = [
            [(name, None if c is None else index[id(c)]) for name, c in m._modules.items()] for m in self.modules
        ]
        self.params = [tuple(m._parameters) for m in self.modules]
        self.buffers = [tuple(m._buffers) for m in self.modules]

    def matches(self, root: nn.Module) -> bool:
        if root is not self.root:
            return False
        modules = self.modules
        for m, children, params, buffers in zip(modules, self.children, self.params, self.buffers):
            if len(m._modules) != len(children) or len(m._parameters) != len(params) or len(m._buffers) != len(buffers):
                return False
            got = m._modules
            for name, k in children:
                child = got.get(name, root)  # ``root`` never is a child: a missing name fails
                if child is not (None if k is None else modules[k]):
                    return False
        return True


def _collect(
    modules: list[nn.Module],
    names: list[tuple[str, ...]],
    attr: str,
) -> tuple[list[Tensor], list[list[tuple[str, int | None]]]]:
    """Unique tensors (shared ones once) and, per module, (name, index into them or None)."""
    unique: dict[int, int] = {}
    tensors: list[Tensor] = []
    slots = []
    for m, keys in zip(modules, names):
        table = getattr(m, attr)
        row: list[tuple[str, int | None]] = []
        for name in keys:
            t = table[name]  # KeyError: renamed since the plan was made; the caller re-plans
            if t is None:
                row.append((name, None))
                continue
            j = unique.get(id(t))
            if j is None:
                j = unique[id(t)] = len(tensors)
                tensors.append(t)
            row.append((name, j))
        slots.append(row)
    return tensors, slots


class Replicas(NamedTuple):
    """What :meth:`Replicator.replicate` returns.

    Attributes:
        modules: one replica per device.
        sources: in ``"leaf"`` mode, the original tensors that require grad (parameters and
            buffers); empty otherwise.
        leaves: in ``"leaf"`` mode, ``leaves[i][j]`` is replica ``i``'s leaf for ``sources[j]``;
            replicas on the same device share their leaves.
    """

    modules: list[nn.Module]
    sources: list[Tensor]
    leaves: list[list[Tensor | None]]


class Replicator:
    """Makes replicas of a module, caching the module tree's structure between calls.

    Pickling or deep-copying a Replicator gives an empty one: the cache is rebuilt on demand.
    """

    def __init__(self) -> None:
        self._plan: _Plan | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"_plan": None}

    def __deepcopy__(self, memo: dict) -> Replicator:
        return Replicator()

    def replicate(self, module: nn.Module, devices: Sequence[DeviceLike], mode: str = "graph") -> Replicas:
        """Replicas of ``module`` on ``devices``; ``mode`` is "graph", "leaf" or "detached".

        Raises:
            DeviceMismatchError: a parameter or buffer is not on ``devices[0]``.
        """
        if mode not in ("graph", "leaf", "detached"):
            raise ValueError(f"mode must be 'graph', 'leaf' or 'detached', got {mode!r}")
        devs = [as_device(d) for d in devices]
        plan = self._plan
        if plan is None or not plan.matches(module):
            plan = self._plan = _Plan(module)
        try:
            params, pslots = _collect(plan.modules, plan.params, "_parameters")
            buffers, bslots = _collect(plan.modules, plan.buffers, "_buffers")
        except KeyError:  # same counts, other names: traverse again
            plan = self._plan = _Plan(module)
            params, pslots = _collect(plan.modules, plan.params, "_parameters")
            buffers, bslots = _collect(plan.modules, plan.buffers, "_buffers")
        _check_devices(params, buffers, devs[0])
        diff_buffers = [b for b in buffers if b.requires_grad] if mode != "detached" else []
        per, sources, leaves = _tensor_copies(params + diff_buffers, devs, mode)
        n_params = len(params)
        bcopies = _buffer_copies(buffers, devs, [row[n_params:] for row in per])
        replicas = [_build(plan, pslots, bslots, per[r][:n_params], bcopies[r]) for r in range(len(devs))]
        return Replicas(replicas, sources, leaves)


def _check_devices(params: list[Tensor], buffers: list[Tensor], device: torch.device) -> None:
    for kind, tensors in (("parameter", params), ("buffer", buffers)):
        for t in tensors:
            if t.device != device:
                raise DeviceMismatchError(
                    f"module must have its parameters and buffers on device {device} "
                    f"(device_ids[0]) but found a {kind} of shape {tuple(t.shape)} on device "
                    f"{t.device}. Move the module first, e.g. module.to({str(device)!r}), or "
                    f"put that device first in device_ids."
                )


def _tensor_copies(
    tensors: list[Tensor],
    devs: list[torch.device],
    mode: str,
) -> tuple[list[list[Tensor]], list[Tensor], list[list[Any]]]:
    """Per-replica copies of parameters (and buffers that require grad); in leaf mode also the
    sources (originals that require grad) and each replica's leaves for them."""
    n = len(tensors)
    if mode == "graph" and torch.is_grad_enabled() and n:
        flat = Broadcast.apply(devs, *tensors)
        return [list(flat[r * n : (r + 1) * n]) for r in range(len(devs))], [], []
    per: list[list[Tensor]] = []
    on_device: dict[torch.device, list[Tensor]] = {}
    for d in devs:
        if d in on_device:
            # Replicas on one device share their tensors. In leaf mode each replica's backward
            # then adds its gradient into the same .grad (AccumulateGrad holds a lock), so the
            # sum over replicas happens inside the parallel backward, not after it.
            per.append(on_device[d])
            continue
        if d == devs[0]:
            row = [t.detach() for t in tensors]
        else:
            with torch.no_grad():
                row = _copy_to(tensors, d)
        on_device[d] = row
        per.append(row)
    if mode != "leaf":
        return per, [], []
    wanted = [j for j, t in enumerate(tensors) if t.requires_grad]
    for row in on_device.values():
        for j in wanted:
            row[j].requires_grad_(True)
    return per, [tensors[j] for j in wanted], [[row[j] for j in wanted] for row in per]


def _buffer_copies(buffers: list[Tensor], devs: list[torch.device], diff: list[list[Tensor]]) -> list[list[Tensor]]:
    """Per-replica buffers: the originals on the first replica, copies elsewhere (so their
    in-place updates are lost); buffers that require grad come from ``diff``."""
    plain = [b for b in buffers if not b.requires_grad] if diff[0] else buffers
    out = []
    for r, d in enumerate(devs):
        if r == 0:
            copies = iter(plain)
        else:
            with torch.no_grad():
                copies = iter([b.clone() for b in plain] if d == devs[0] else _copy_to(plain, d))
        grads = iter(diff[r])
        out.append([next(grads) if diff[0] and b.requires_grad else next(copies) for b in buffers])
    return out


def _build(plan: _Plan, pslots: list, bslots: list, params: list[Tensor], buffers: list[Tensor]) -> nn.Module:
    copies = []
    new_object, set_attr = object.__new__, object.__setattr__
    for m, prow, brow in zip(plan.modules, pslots, bslots):
        replica = new_object(type(m))
        d = m.__dict__.copy()
        set_attr(replica, "__dict__", d)  # nn.Module.__setattr__ would take its slow path
        # The tensors go in _parameters (for parameters()) and in __dict__ too, where attribute
        # lookup finds them without nn.Module.__getattr__.
        table = d["_parameters"] = {}
        for name, j in prow:
            d[name] = table[name] = None if j is None else params[j]
        d["_buffers"] = {name: None if j is None else buffers[j] for name, j in brow}
        d["_is_replica"] = True
        copies.append(replica)
    for replica, children in zip(copies, plan.children):
        replica.__dict__["_modules"] = {name: None if k is None else copies[k] for name, k in children}
    return copies[0]


def replicate(network: nn.Module, devices: Sequence[DeviceLike], detach: bool = False) -> list[nn.Module]:
    """Replicas of ``network`` on ``devices`` (PyTorch's ``replicate`` signature).

    Args:
        network: the module; its parameters and buffers must be on ``devices[0]``.
        devices: one replica per device.
        detach: make replicas without autograd (for inference).

    Returns:
        The replicas. Gradients flowing into their parameters sum into ``network``'s.
    """
    return Replicator().replicate(network, devices, "detached" if detach else "graph").modules
