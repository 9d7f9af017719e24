"""``DataParallel``: a drop-in for ``torch.nn.DataParallel`` on ember's engine.

Every forward splits the batch along ``dim`` (:func:`scatter_kwargs`), makes one replica of the
module per chunk (:class:`Replicator`), runs the replicas in threads (:func:`parallel_apply`)
and concatenates their outputs on ``output_device`` (:func:`gather`). Unlike PyTorch's, it also
runs on CPU "devices" (``device_ids=["cpu", "cpu"]``), with each replica's backward on its own
thread so that CPU replicas scale (see :mod:`ember.parallel.parallel_apply`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ember.parallel.parallel_apply import attach_replica_graphs, check_parallel_backward_devices, parallel_apply
from ember.parallel.replicate import DeviceMismatchError, Replicator
from ember.parallel.scatter_gather import DeviceLike, as_device, copy_to, flatten, gather, scatter_kwargs, unflatten
from ember.user_frames import user_stacklevel

__all__ = ["DataParallel", "data_parallel", "run_replicas"]


def _default_devices() -> list[torch.device]:
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def _check_balance(devices: list[torch.device]) -> None:
    if len(devices) < 2 or devices[0].type != "cuda":
        return
    props = [torch.cuda.get_device_properties(d) for d in devices]
    for what in ("total_memory", "multi_processor_count"):
        values = [getattr(p, what) for p in props]
        low, high = min(values), max(values)
        if low / high < 0.75:
            warnings.warn(
                f"There is an imbalance between your GPUs. You may want to exclude GPU "
                f"{devices[values.index(low)].index} which has less than 75% of the memory or "
                f"cores of GPU {devices[values.index(high)].index}. You can do so by setting the "
                "device_ids argument to DataParallel, or by setting the CUDA_VISIBLE_DEVICES "
                "environment variable.",
                stacklevel=user_stacklevel(),
            )
            return


def _to_device(batch: Any, device: torch.device) -> Any:
    # Through scatter's own flatten rather than apply_to_collection: the one-device path must walk
    # exactly the containers a multi-device scatter walks, and hand back the batch itself when no
    # tensor has to move.
    leaves, spec = flatten(batch)
    if not any(isinstance(t, Tensor) and t.device != device for t in leaves):
        return batch
    # The scatter's copy: from the host on a side stream the current one waits for, so a
    # one-device forward never blocks the host (as PyTorch's _to_kwargs does).
    return unflatten(spec, [copy_to(t, device) if isinstance(t, Tensor) else t for t in leaves])


def _leafify(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[Tensor], list[Tensor]]:
    """Swap input tensors that require grad for fresh leaves (their replica's own graph)."""
    leaves_, spec = flatten((args, kwargs))
    sources, leaves = [], []
    for k, t in enumerate(leaves_):
        if isinstance(t, Tensor) and t.requires_grad:
            leaf = t.detach().requires_grad_(True)
            sources.append(t)
            leaves.append(leaf)
            leaves_[k] = leaf
    new_args, new_kwargs = unflatten(spec, leaves_)
    return new_args, new_kwargs, sources, leaves


def run_replicas(
    module: nn.Module,
    replicator: Replicator,
    inputs: Sequence[tuple],
    kwargs: Sequence[dict[str, Any]],
    devices: Sequence[DeviceLike],
    *,
    method: str | None = None,
    parallel_backward: bool = False,
    threads_per_replica: int | None = None,
    check_leaves: bool = False,
    on_replicas: Callable[[list[nn.Module]], None] | None = None,
) -> list[Any]:
    """Replicate ``module`` onto ``devices[:len(inputs)]`` and run it on the scattered inputs.

    This is DataParallel's forward between scatter and gather, for callers (the ``dp``
    strategy) that call another method than ``forward`` or combine the outputs themselves.

    Args:
        module: the original module, on ``devices[0]``.
        replicator: keeps the module's structure between calls.
        inputs: per-replica positional arguments (from :func:`scatter_kwargs`).
        kwargs: per-replica keyword arguments.
        devices: the replicas' devices.
        method: the method to call on each replica (default: the module itself).
        parallel_backward: give each replica its own autograd graph and run their backward
            passes in parallel threads (see :func:`attach_replica_graphs`); otherwise one graph
            spans the replicas, as in PyTorch.
        threads_per_replica: intra-op threads for each replica's thread.
        check_leaves: with ``parallel_backward``, check once that the replicas' graphs reach no
            tensor requiring grad other than the module's parameters/buffers and the inputs.
        on_replicas: called with the replicas before they run (not when a single chunk runs on
            ``module`` itself), e.g. to give each replica its own place to log to.

    Returns:
        One output per replica, in replica order.
    """
    n = len(inputs)
    devs = [as_device(d) for d in devices[:n]]
    if n == 1:
        # One chunk: the first replica would share everything with the module, so skip it.
        return parallel_apply([module], inputs, kwargs, devs, method=method)
    if not torch.is_grad_enabled() or not parallel_backward:
        mode = "graph" if torch.is_grad_enabled() else "detached"
        replicas = replicator.replicate(module, devs, mode).modules
        if on_replicas is not None:
            on_replicas(replicas)
        return parallel_apply(replicas, inputs, kwargs, devs, method=method, threads_per_replica=threads_per_replica)
    reps = replicator.replicate(module, devs, "leaf")
    if on_replicas is not None:
        on_replicas(reps.modules)
    sources, leaves = list(reps.sources), [list(row) for row in reps.leaves]
    new_inputs, new_kwargs = [], []
    for i in range(n):
        args, kw, input_sources, input_leaves = _leafify(tuple(inputs[i]), dict(kwargs[i]))
        new_inputs.append(args)
        new_kwargs.append(kw)
        for src, leaf in zip(input_sources, input_leaves):
            # An input chunk belongs to one replica: its column is empty for the others.
            sources.append(src)
            for r, row in enumerate(leaves):
                row.append(leaf if r == i else None)
    outputs = parallel_apply(
        reps.modules, new_inputs, new_kwargs, devs, method=method, threads_per_replica=threads_per_replica
    )
    return attach_replica_graphs(
        outputs, sources, leaves, devs, threads_per_replica=threads_per_replica, check_leaves=check_leaves
    )


class DataParallel(nn.Module):
    """Split the batch across devices and run one replica of ``module`` per chunk.

    Behaves as ``torch.nn.DataParallel`` documents: the batch is split along ``dim`` (chunk size
    ``ceil(B/N)``, so a small batch uses fewer devices), the module is replicated every forward,
    gradients from every replica sum into ``module``'s parameters, parameters and buffers must be
    on ``device_ids[0]``, in-place updates on the first device persist while other replicas'
    are lost, forward hooks run once per replica, a 0-dim output per replica is gathered into a
    vector (with a warning), and inputs may come from any device.

    Beyond PyTorch: ``device_ids`` may name CPU devices (``["cpu", "cpu"]`` gives two replicas
    in threads), dataclasses in the batch are split too, a batch that cannot be split is an error
    rather than a silent copy, ``self.parameters()`` inside a replica's forward lists the
    replica's tensors (PyTorch's replicas have none), and replicas are cheaper to make (the module
    tree is cached). Random ops (dropout) in replicas draw from the one global generator in
    whatever order the threads reach it, so they are not bit-reproducible from run to run.

    Args:
        module: the module to parallelise.
        device_ids: devices as CUDA indices, strings or ``torch.device`` (default: every CUDA
            device; without CUDA, the CPU alone, where forward just calls ``module``).
        output_device: where outputs are gathered (default: ``device_ids[0]``).
        dim: the batch dimension of inputs and outputs.
        parallel_backward: give each replica its own autograd graph and run the replicas'
            backward passes in parallel threads. Default: on when every device is a CPU
            (PyTorch's engine already runs each GPU's backward on its own thread); refused on
            CUDA devices, where it would deadlock. Higher-order gradients (``create_graph=True``)
            need it off.
        threads_per_replica: intra-op threads for each replica's thread. Default: for CPU
            devices, the caller's ``torch.get_num_threads()`` divided among the replicas.

    Example::

        model = ember.parallel.DataParallel(model, device_ids=["cpu", "cpu"])
        loss = F.cross_entropy(model(x), y)   # each half of x on its own replica
        loss.backward()                        # both replicas' gradients land in model.module
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        parallel_backward: bool | None = None,
        threads_per_replica: int | None = None,
    ) -> None:
        super().__init__()
        devices = [as_device(d) for d in device_ids] if device_ids else _default_devices()
        if len({d.type for d in devices}) > 1:
            raise ValueError(
                f"device_ids must all be of one type (all CUDA or all CPU), got {[str(d) for d in devices]}"
            )
        devices = [
            torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d
            for d in devices
        ]
        self.module = module
        self.devices = devices
        # PyTorch keeps CUDA device_ids as indices; CPU devices have none, so they stay devices.
        self.device_ids: list[Any] = [d.index if d.type == "cuda" else d for d in devices]
        self.output_device = as_device(output_device) if output_device is not None else devices[0]
        self.src_device_obj = devices[0]
        self.dim = dim
        if parallel_backward:
            check_parallel_backward_devices(devices)
        self.parallel_backward = (
            all(d.type == "cpu" for d in devices) if parallel_backward is None else parallel_backward
        )
        self.threads_per_replica = threads_per_replica
        self._replicator = Replicator()
        self._leaves_checked = False
        _check_balance(devices)
        if len(devices) == 1:
            self.module.to(devices[0])

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with torch.autograd.profiler.record_function("DataParallel.forward"):
            if len(self.devices) == 1:
                # Nothing to split: move the tensors over (if needed) and call the module.
                self._check_single_device()
                args, kw = _to_device((inputs, kwargs), self.src_device_obj)
                return self.module(*args, **kw)
            args, kw = self.scatter(inputs, kwargs, self.devices)
            if not args and not kw:
                args, kw = [()], [{}]
            if self._classic_path():
                replicas = self.replicate(self.module, self.devices[: len(args)])
                outputs = self.parallel_apply(replicas, args, kw)
            else:
                check = self.parallel_backward and not self._leaves_checked
                outputs = run_replicas(
                    self.module,
                    self._replicator,
                    args,
                    kw,
                    self.devices,
                    parallel_backward=self.parallel_backward,
                    threads_per_replica=self._threads_per_replica(len(args)),
                    check_leaves=check,
                )
                if check and torch.is_grad_enabled():
                    self._leaves_checked = True
            return self.gather(outputs, self.output_device)

    # The four steps as overridable methods, with PyTorch's signatures: subclasses written for
    # torch.nn.DataParallel (a custom scatter for ragged inputs, say) keep working.
    def scatter(
        self, inputs: tuple, kwargs: dict[str, Any] | None, device_ids: Sequence[DeviceLike]
    ) -> tuple[list[tuple], list[dict[str, Any]]]:
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        mode = "graph" if torch.is_grad_enabled() else "detached"
        return self._replicator.replicate(module, device_ids, mode).modules

    def parallel_apply(
        self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Sequence[dict[str, Any]] | None
    ) -> list[Any]:
        return parallel_apply(
            replicas,
            inputs,
            kwargs,
            self.devices[: len(replicas)],
            threads_per_replica=self._threads_per_replica(len(replicas)),
        )

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike) -> Any:
        return gather(outputs, output_device, dim=self.dim)

    def _classic_path(self) -> bool:
        # A subclass that replaces replicate or parallel_apply gets exactly those calls, in one
        # graph; otherwise run_replicas does both (with the parallel backward where enabled).
        cls = type(self)
        return cls.replicate is not DataParallel.replicate or cls.parallel_apply is not DataParallel.parallel_apply

    def _threads_per_replica(self, n: int) -> int | None:
        if self.threads_per_replica is not None or self.devices[0].type != "cpu":
            return self.threads_per_replica
        return max(1, torch.get_num_threads() // n)

    def _check_single_device(self) -> None:
        device = self.src_device_obj
        for kind, tensors in (("parameter", self.module.parameters()), ("buffer", self.module.buffers())):
            for t in tensors:
                if t.device != device:
                    raise DeviceMismatchError(
                        f"module must have its parameters and buffers on device {device} "
                        f"(device_ids[0]) but found a {kind} of shape {tuple(t.shape)} on "
                        f"device {t.device}. Move the module first, e.g. "
                        f"module.to({str(device)!r})."
                    )


def data_parallel(
    module: nn.Module,
    inputs: Any,
    device_ids: Sequence[DeviceLike] | None = None,
    output_device: DeviceLike | None = None,
    dim: int = 0,
    module_kwargs: dict[str, Any] | None = None,
) -> Any:
    """Evaluate ``module(*inputs, **module_kwargs)`` in parallel over ``device_ids`` once.

    The functional form of :class:`DataParallel` (same signature as PyTorch's).
    """
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    wrapper = DataParallel(module, device_ids, output_device, dim)
    return wrapper(*inputs, **(module_kwargs or {}))
