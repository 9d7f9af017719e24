"""Run replicas in threads: forward with :func:`parallel_apply`, backward with
:func:`attach_replica_graphs`.

``parallel_apply`` calls one callable per replica on its own thread (inline when there is one),
with the caller's thread-local state re-applied in each thread: grad mode, inference mode,
autocast (enabled flag *and* dtype, CPU and CUDA), and the current CUDA device and stream.
An exception in a replica is re-raised in the caller, of the same type where possible, naming the
replica and its device and carrying the original traceback text. Every thread is joined before it
returns or raises.

Why the backward needs help on CPU: PyTorch's autograd engine runs all CPU work of one
``backward()`` on the calling thread, so one backward over a graph that spans two CPU replicas
runs their backward passes one after the other. ``attach_replica_graphs`` keeps each replica's
graph separate (its parameters are its own leaves) and ties the replicas' outputs into the
caller's graph through one autograd node. When the caller's backward reaches that node, each
replica's backward runs on its own thread, and the leaves' gradients are summed into the
gradients of the tensors they stand for (the original parameters, the input chunks).
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor

from ember.parallel.scatter_gather import DeviceLike, as_device, flatten, unflatten

__all__ = ["attach_replica_graphs", "check_parallel_backward_devices", "parallel_apply"]


class _CallerState:
    """The caller's thread-local settings, captured once and re-entered in every worker."""

    def __init__(self, devices: Sequence[torch.device | None]) -> None:
        self.grad_enabled = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = {}
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                self.autocast[device_type] = torch.get_autocast_dtype(device_type)
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.streams: dict[torch.device, Any] = {}
        for d in devices:
            if d is not None and d.type == "cuda" and d not in self.streams:
                self.streams[d] = torch.cuda.current_stream(d)

    def enter(self, stack: ExitStack, device: torch.device | None) -> None:
        stack.enter_context(torch.inference_mode(self.inference))
        stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        for device_type, dtype in self.autocast.items():
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=self.autocast_cache))
        if device is not None and device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
            stack.enter_context(torch.cuda.stream(self.streams[device]))


class _Failure:
    """What a replica raised, kept until every thread has been joined."""

    def __init__(self, index: int, device: torch.device | None, exc: BaseException) -> None:
        self.index, self.device, self.exc = index, device, exc
        self.text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))

    def reraise(self, others: list[int]) -> None:
        where = f"replica {self.index} on device {self.device}"
        also = f" (replicas {others} failed too)" if others else ""
        msg = (
            f"Caught {type(self.exc).__name__} in {where}{also}.\n"
            f"Original traceback (in the replica's thread):\n{self.text}"
        )
        try:
            err = type(self.exc)(_KeyErrorText(msg) if isinstance(self.exc, KeyError) else msg)
        except Exception:  # noqa: BLE001 - exception types whose constructor needs other args
            err = RuntimeError(msg)
        err.replica, err.device = self.index, self.device  # type: ignore[attr-defined]
        raise err from None


class _KeyErrorText(str):
    # KeyError prints repr() of its argument, which would turn the traceback into one long line.
    def __repr__(self) -> str:
        return str(self)


def _infer_device(args: Any, kwargs: dict) -> torch.device | None:
    leaves, _ = flatten((args, kwargs))
    return next((leaf.device for leaf in leaves if isinstance(leaf, Tensor)), None)


def parallel_apply(
    modules: Sequence[Callable[..., Any]],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[DeviceLike | None] | None = None,
    *,
    method: str | None = None,
    threads_per_replica: int | None = None,
) -> list[Any]:
    """Call ``modules[i](*inputs[i], **kwargs_tup[i])`` for every ``i``, one thread each.

    Args:
        modules: the replicas, or any callables.
        inputs: one positional-argument tuple per replica; a value that is not a list or tuple
            is passed as the single argument.
        kwargs_tup: one keyword-argument dict per replica (default: none).
        devices: the device of each replica, for the CUDA device/stream context (default:
            the device of the first tensor in its arguments).
        method: call ``getattr(modules[i], method)`` instead of the module itself, e.g.
            ``"training_step"``.
        threads_per_replica: intra-op threads for each replica's thread (``torch.set_num_threads``
            is per thread under OpenMP); the caller's setting is restored afterwards. Default:
            leave as is. With one replica nothing is changed: it runs inline in the caller.

    Returns:
        The replicas' results, in replica order.

    Raises:
        The first failing replica's exception type (``RuntimeError`` if that type cannot be
        rebuilt from a message), naming the replica and its device, with its traceback text.
    """
    n = len(modules)
    kwargs_tup = list(kwargs_tup) if kwargs_tup is not None else [{} for _ in range(n)]
    devs = list(devices) if devices is not None else [None] * n
    if not (len(inputs) == len(kwargs_tup) == len(devs) == n):
        raise ValueError(
            f"parallel_apply needs one entry per replica: got {n} modules, "
            f"{len(inputs)} inputs, {len(kwargs_tup)} kwargs and {len(devs)} devices"
        )
    calls = []
    for i in range(n):
        args = inputs[i] if isinstance(inputs[i], (list, tuple)) else (inputs[i],)
        kw = kwargs_tup[i] or {}
        dev = devs[i]
        device = as_device(dev) if dev is not None else _infer_device(args, kw)
        fn = getattr(modules[i], method) if method else modules[i]
        calls.append((fn, args, kw, device))
    state = _CallerState([c[3] for c in calls])
    results: list[Any] = [None] * n

    def work(i: int, pin_threads: bool) -> None:
        fn, args, kw, device = calls[i]
        try:
            if pin_threads and threads_per_replica is not None:
                torch.set_num_threads(threads_per_replica)
            with ExitStack() as stack:
                state.enter(stack, device)
                results[i] = fn(*args, **kw)
        except BaseException as exc:  # noqa: BLE001 - everything must reach the caller
            results[i] = _Failure(i, device, exc)

    if n == 1:
        work(0, pin_threads=False)
    else:
        caller_threads = torch.get_num_threads()
        threads = [
            threading.Thread(target=work, args=(i, threads_per_replica is not None), name=f"ember-replica-{i}")
            for i in range(n)
        ]
        try:
            for t in threads:
                t.start()
        finally:
            for t in threads:
                if t.is_alive() or t.ident is not None:
                    t.join()
            if threads_per_replica is not None:
                # set_num_threads also sets the process-wide default that new threads start
                # from (and MKL's global count); give the caller's value back.
                torch.set_num_threads(caller_threads)
    failures = [r for r in results if isinstance(r, _Failure)]
    if failures:
        failures[0].reraise([f.index for f in failures[1:]])
    return results


# ---------------------------------------------------------------------------------------------
# Parallel backward
# ---------------------------------------------------------------------------------------------
class _ReplicaGraphs:
    """Everything the joint backward node needs: replica outputs, their leaves and devices."""

    def __init__(
        self,
        sources: list[Tensor],
        leaves: list[list[Tensor | None]],
        outputs: list[list[Tensor]],
        devices: list[torch.device | None],
        threads_per_replica: int | None,
    ) -> None:
        self.sources, self.leaves, self.outputs = sources, leaves, outputs
        self.devices, self.threads_per_replica = devices, threads_per_replica
        self.released = False

    def release(self) -> None:
        # Dropping the references frees the replicas' graphs (and their saved activations).
        self.leaves, self.outputs, self.released = [], [], True


def _keep_graph() -> bool:
    get = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if get is None else bool(get())


class _JoinReplicaGraphs(torch.autograd.Function):
    """Identity on the replicas' outputs whose backward runs each replica's backward on its own
    thread and returns, for every source, the sum of its leaves' gradients."""

    @staticmethod
    def forward(ctx: Any, graphs: _ReplicaGraphs, *sources: Tensor) -> tuple[Tensor, ...]:
        ctx.graphs = graphs
        ctx.set_materialize_grads(False)  # an unused output needs no backward at all
        flat = [o for outs in graphs.outputs for o in outs]
        return tuple(o.detach() for o in flat)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        graphs: _ReplicaGraphs = ctx.graphs
        if graphs.released:
            raise RuntimeError(
                "Trying to backward through the data-parallel replicas a second time: their "
                "graphs were freed by the first backward. Pass retain_graph=True to the first "
                "backward if you need to backward twice."
            )
        if torch.is_grad_enabled():
            raise RuntimeError(
                "create_graph=True (higher-order gradients) is not supported through replicas "
                "whose backward runs in parallel threads. Build DataParallel(..., "
                "parallel_backward=False) to use one autograd graph across the replicas."
            )
        keep = _keep_graph()
        n_sources = len(graphs.sources)  # the last input is the anchor, which needs nothing
        wanted = [j for j, need in enumerate(ctx.needs_input_grad[1 : 1 + n_sources]) if need]
        jobs, pos = [], 0
        for i, outs in enumerate(graphs.outputs):
            pairs = [(o, g) for o, g in zip(outs, grads[pos : pos + len(outs)]) if g is not None]
            pos += len(outs)
            targets = [t for t in (graphs.leaves[i][j] for j in wanted) if t is not None]
            # One job per replica, even an empty one, so an error names the right replica.
            jobs.append(_replica_backward(pairs, targets, keep))
        parallel_apply(jobs, [()] * len(jobs), devices=graphs.devices, threads_per_replica=graphs.threads_per_replica)
        # Leaves shared by replicas on one device already hold those replicas' sum.
        summed: list[Tensor | None] = [None] * n_sources
        for j in wanted:
            seen: set[int] = set()
            found = []
            for row in graphs.leaves:
                leaf = row[j]
                if leaf is None or id(leaf) in seen:
                    continue
                seen.add(id(leaf))
                if leaf.grad is not None:
                    found.append(leaf.grad.to(graphs.sources[j].device))
                    leaf.grad = None  # a retained graph may be run again: start from zero
            summed[j] = _sum(found)
        if not keep:
            graphs.release()
        return (None, *summed, None)


def _sum(grads: list[Tensor]) -> Tensor | None:
    if not grads:
        return None
    total = grads[0]
    for g in grads[1:]:
        total = total + g
    return total


def _replica_backward(pairs: list[tuple[Tensor, Tensor]], targets: list[Tensor], keep: bool) -> Callable[[], None]:
    def run() -> None:
        if not pairs or not targets:
            return
        # inputs= limits accumulation to this replica's leaves: tensors outside the replicas
        # are left alone, and only gradients somebody asked for are computed.
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], retain_graph=keep, inputs=targets)

    return run


def check_parallel_backward_devices(devices: Sequence[torch.device]) -> None:
    """Raise if the parallel backward cannot run on ``devices`` (it is for CPU replicas only).

    On CUDA it would deadlock: the joint node's backward runs on the device's autograd worker
    thread and joins the replicas' backward threads, whose CUDA work is queued for that very
    worker thread. PyTorch's engine already runs each GPU's backward on its own thread anyway.
    """
    on_gpu = sorted({str(d) for d in devices if d.type != "cpu"})
    if on_gpu:
        raise ValueError(
            f"parallel_backward=True runs the replicas' backward passes in threads, which is for "
            f"CPU replicas only; on {', '.join(on_gpu)} it would deadlock (each GPU's backward "
            "already runs on its own autograd thread). Leave parallel_backward unset (it is on for "
            "CPU devices and off otherwise) or set it to False."
        )


def attach_replica_graphs(
    outputs: list[Any],
    sources: list[Tensor],
    leaves: list[list[Tensor | None]],
    devices: Sequence[DeviceLike | None],
    *,
    threads_per_replica: int | None = None,
    check_leaves: bool = False,
) -> list[Any]:
    """Tie replica outputs computed from private leaves back to the tensors the leaves stand for.

    Args:
        outputs: one output structure per replica, computed on that replica's own graph.
        sources: tensors of the caller's graph (original parameters, input chunks) that the
            replicas used through copies.
        leaves: ``leaves[i][j]`` is replica ``i``'s leaf standing for ``sources[j]`` (or None).
        devices: each replica's device (for the CUDA context of its backward thread).
        threads_per_replica: intra-op threads for each backward thread (see parallel_apply).
        check_leaves: walk the replicas' graphs once and raise if they reach a tensor that
            requires grad and is not one of ``leaves`` (it would get no gradient).

    Returns:
        The outputs with every tensor that requires grad replaced by one in the caller's graph.
        When the caller's backward reaches them, each replica's backward runs on its own thread,
        and every source receives the sum of its leaves' gradients.
    """
    devs = [as_device(d) if d is not None else None for d in devices]
    check_parallel_backward_devices([d for d in devs if d is not None])
    flat = [flatten(out) for out in outputs]
    diff = [[t for t in leaves_ if isinstance(t, Tensor) and t.requires_grad] for leaves_, _ in flat]
    if not any(diff):
        return outputs
    if check_leaves:
        _check_no_foreign_leaves(diff, leaves)
    graphs = _ReplicaGraphs(list(sources), leaves, diff, devs, threads_per_replica)
    # An anchor that requires grad keeps the node in the caller's graph even with no sources.
    anchor = torch.empty(0, requires_grad=True)
    joined = iter(_JoinReplicaGraphs.apply(graphs, *sources, anchor))
    rebuilt = []
    for leaves_, spec in flat:
        swapped = [next(joined) if isinstance(t, Tensor) and t.requires_grad else t for t in leaves_]
        rebuilt.append(unflatten(spec, swapped))
    return rebuilt


def _check_no_foreign_leaves(outputs: list[list[Tensor]], leaves: list[list[Tensor | None]]) -> None:
    known = {id(t) for row in leaves for t in row if t is not None}
    seen: set[int] = set()
    stack = [o.grad_fn for outs in outputs for o in outs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) not in known:
            raise RuntimeError(
                f"a replica's forward used a tensor that requires grad (shape "
                f"{tuple(variable.shape)}) which is neither a parameter or buffer of the module "
                "nor part of its inputs; with the parallel CPU backward it would get no "
                "gradient. Register it as a parameter, pass it as an input, or build "
                "DataParallel(..., parallel_backward=False)."
            )
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
