"""The ``dp`` strategy: one process, one replica of the TrainModule per device, run in threads.

Every step splits the batch along its first dimension (``torch.chunk`` sizes), replicates the
module onto as many devices as there are chunks, runs ``training_step`` (or ``validation_step``,
``test_step``, ``predict_step``) of each replica on its own thread, and combines the results:

- the loss is the chunk-size-weighted mean of the replicas' losses, so that with a per-sample
  mean loss the gradients equal those of one device on the whole batch, uneven last batches
  included; on CPU replicas each replica's backward runs on its own thread too;
- other 0-dim tensors in the step output are combined the same way, tensors with a batch
  dimension are concatenated (predictions), other values kept when every replica agrees;
- values that replicas ``self.log`` are combined per name into one logged value: weighted by
  chunk size for ``reduce_fx="mean"`` (or by the ``batch_size`` given to ``log``), summed for
  "sum", max/min for "max"/"min". Hooks other than the ``*_step`` methods run once, on the
  original module;
- a ``torchmetrics.Metric`` in the module gets, in each replica, a state of its own that starts
  empty, on the replica's device; after the step the replicas' states are merged into the original
  Metric in replica order, so its epoch ``compute()`` equals one device's, and a Metric logged per step
  shows what its last forward gives on the whole batch (:mod:`ember.strategies.dp_metrics`). A
  ``MetricCollection`` gets compute groups of its own in each replica. (A shallow replica would share
  the original's states, with ``update`` bound to the original, and the replica threads would race on
  them: what PyTorch's DataParallel does with a Metric.) Items that several ``update`` calls in one
  step add to a list state come replica by replica, as rank by rank under ddp.

When this is not one device on the whole batch: whatever depends on the whole batch at once.
BatchNorm in train mode normalises each chunk with that chunk's statistics (and only the first
replica's running statistics are kept); a loss that is not a per-sample mean (a sum, a
contrastive loss over the batch) is combined as a weighted mean of per-chunk values.
Random ops (dropout) draw from the one global generator in whatever order the replica threads
reach it, so a dp run is not bit-reproducible, and does not draw the same masks as "single".
Manual optimization is not supported (the replicas would each step the optimizer).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ember.module import TrainModule, redirect_log
from ember.parallel.data_parallel import run_replicas
from ember.parallel.parallel_apply import check_parallel_backward_devices
from ember.parallel.replicate import Replicator
from ember.parallel.scatter_gather import flatten, gather, scatter_kwargs
from ember.strategies.dp_metrics import States, batch_value, give_own_groups, give_own_state, merge_into, states_of
from ember.strategies.strategy import Strategy
from ember.utils import is_torchmetric

__all__ = ["DataParallelStrategy"]


class _ReplicaLog:
    """Takes the place of the metric collector inside one replica: records, publishes nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    def log(self, name: str, value: Any, **options: Any) -> None:
        self.calls.append((name, value.detach() if isinstance(value, Tensor) else value, options))


def _chunk_size(args: tuple) -> int:
    first = next(t for t in flatten(args[0])[0] if isinstance(t, Tensor))
    return int(first.shape[0])


def _weighted_sum(values: list[Any], weights: list[float], device: torch.device) -> Any:
    """``sum(w * v)``: on ``device`` when any value is a tensor (values may sit on several). Python
    numbers are summed on the host and added as a scalar: never copied to the device (a copy from
    host memory would make the host wait for the device)."""
    numbers = [(v, w) for v, w in zip(values, weights) if not isinstance(v, Tensor)]
    host = sum(v * w for v, w in numbers)
    out = None
    for v, w in zip(values, weights):
        if isinstance(v, Tensor):
            part = v.to(device) * w
            out = part if out is None else out + part
    if out is None:
        return host
    return out + host if numbers else out


def _extreme(values: list[Any], fx: str, device: torch.device) -> Any:
    """The max (``fx="max"``) or min of ``values``: Python numbers compared on the host, tensors on
    ``device``, a NaN anywhere making it NaN (as ``torch.max``). No number is copied to the device."""
    numbers = [float(v) for v in values if not isinstance(v, Tensor)]
    host = None
    if numbers:
        host = math.nan if any(math.isnan(n) for n in numbers) else (max if fx == "max" else min)(numbers)
    tensors = [v.to(device).reshape(()) for v in values if isinstance(v, Tensor)]
    if not tensors:
        return host
    stacked = torch.stack(tensors)
    out = stacked.max() if fx == "max" else stacked.min()
    if host is None:
        return out
    return torch.clamp(out, min=host) if fx == "max" else torch.clamp(out, max=host)  # a scalar: no copy


def _weighted_mean(values: list[Any], weights: list[float], device: torch.device) -> Any:
    total = float(sum(weights))
    return _weighted_sum(values, [w / total for w in weights], device)


def _merge_metrics(
    module: nn.Module,
    replicas: list[nn.Module],
    paths: list[str],
    forwards: dict[int, States],
    batch_values: dict[int, Any],
) -> dict[int, Any]:
    """Merge every replica's Metric state into the original Metric; returns {id(replica metric): original}.

    ``batch_values`` gets {id(original): the whole batch's value} for each Metric the replicas called forward
    on, from ``forwards`` (what each replica's last forward saw, see :func:`give_own_state`)."""
    originals: dict[int, Any] = {}
    for path in paths:
        original: Any = module.get_submodule(path)
        reps: list[Any] = [replica.get_submodule(path) for replica in replicas]
        originals.update((id(r), original) for r in reps)
        merge_into(original, [states_of(r) for r in reps if r.update_count])
        ran_forward = [r for r in reps if id(r) in forwards]
        if ran_forward:  # the step value Lightning logs: what the last forward gives on the whole batch
            batch_values[id(original)] = batch_value(ran_forward[0], [forwards[id(r)] for r in ran_forward])
    return originals


def _combine_logs(
    module: TrainModule, sinks: list[_ReplicaLog], weights: list[int], device: torch.device, metrics: dict[int, Any]
) -> None:
    """Log, on ``module``, one value per name (and per repeated call) from all replicas."""
    order: list[str] = []
    by_name: dict[str, list[list[tuple[Any, dict, int]]]] = {}
    for sink, weight in zip(sinks, weights):
        seen: dict[str, int] = {}
        for name, value, options in sink.calls:
            k = seen[name] = seen.get(name, -1) + 1
            if name not in by_name:
                order.append(name)
                by_name[name] = []
            per_call = by_name[name]
            while len(per_call) <= k:
                per_call.append([])
            per_call[k].append((value, options, weight))
    for name in order:
        for calls in by_name[name]:
            values = [v for v, _, _ in calls]
            options = dict(calls[0][1])
            if id(values[0]) in metrics:  # a replica's Metric: log the original, which holds the merged state
                module.log(name, metrics[id(values[0])], **options)
                continue
            given = [o.get("batch_size") for _, o, _ in calls]
            fx = options.get("reduce_fx", "mean")
            if fx == "mean":
                sizes = [g if g is not None else w for g, (_, _, w) in zip(given, calls)]
                value = _weighted_mean(values, sizes, device)
                if all(g is not None for g in given):
                    options["batch_size"] = sum(given)
            elif fx == "sum":
                value = _weighted_sum(values, [1.0] * len(values), device)
            else:
                value = _extreme(values, fx, device)
            module.log(name, value, **options)


class DataParallelStrategy(Strategy):
    """One process, N replicas of the module in threads, one per device (CPU devices allowed).

    Args:
        accelerator: "cpu" or "cuda"; filled in by the Trainer when not given.
        devices: the devices, one replica each; filled in by the Trainer (``devices=N``).
        parallel_backward: run each replica's backward on its own thread. Default: on when all
            devices are CPUs (each GPU's backward already runs on its own engine thread); refused
            on CUDA devices, where it would deadlock.
        threads_per_replica: intra-op threads for each replica's thread. Default on CPU: this
            process's ``torch.get_num_threads()`` divided among the replicas.
    """

    strategy_name = "dp"

    def __init__(
        self,
        accelerator: str | None = None,
        devices: list[torch.device] | None = None,
        *,
        parallel_backward: bool | None = None,
        threads_per_replica: int | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, devices=devices)
        self.parallel_backward = parallel_backward
        self.threads_per_replica = threads_per_replica
        self._replicator = Replicator()
        self._leaves_checked = False
        self._cpu_only = False
        self._metric_paths: list[str] = []
        self._collection_paths: list[str] = []
        # {id(original Metric): its value for the whole batch of the last step the replicas ran}.
        self._batch_values: dict[int, Any] = {}

    def setup(self, trainer: Any, module: Any) -> None:
        devices = self.parallel_devices or [self.root_device]
        if self.parallel_backward:  # before the module moves: a refused setting changes nothing
            check_parallel_backward_devices(devices)
        super().setup(trainer, module)
        self._cpu_only = all(d.type == "cpu" for d in devices)
        if self.parallel_backward is None:
            self.parallel_backward = self._cpu_only
        self._replicator = Replicator()
        self._leaves_checked = False
        # Where the module holds torchmetrics Metrics and MetricCollections (their replicas get states and
        # compute groups of their own each step).
        self._metric_paths = [name for name, m in module.named_modules() if is_torchmetric(m)]
        self._collection_paths = [name for name, m in module.named_modules() if is_torchmetric(m, "MetricCollection")]

    def teardown(self) -> None:
        self._replicator = Replicator()  # drop the cached structure (and the module it holds)
        self._batch_values = {}

    def metric_batch_value(self, metric: Any) -> Any:
        # A Metric the replicas ran forward on this step: its value for the whole batch (merged from the
        # replicas), kept until the next step as the original's own last forward would be.
        if id(metric) in self._batch_values:
            return self._batch_values[id(metric)]
        return super().metric_batch_value(metric)

    def batch_to_device(self, batch: Any) -> Any:
        # Every device a CPU and CUDA never initialised: nothing can be elsewhere, skip the walk.
        if self._cpu_only and not torch.cuda.is_initialized():
            return batch
        return super().batch_to_device(batch)

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: Any, batch_idx: int, *extra: Any) -> Any:
        assert self.module is not None  # set by setup()
        if not self.module.automatic_optimization and len(self.parallel_devices) > 1:
            raise ValueError(
                "strategy='dp' trains with automatic optimization only: with "
                "automatic_optimization=False every replica would run its own backward and "
                "optimizer step. Use strategy='single' or 'ddp' for manual optimization."
            )
        return self._run("training_step", batch, batch_idx, extra, training=True)

    def validation_step(self, batch: Any, batch_idx: int, *extra: Any) -> Any:
        return self._run("validation_step", batch, batch_idx, extra)

    def test_step(self, batch: Any, batch_idx: int, *extra: Any) -> Any:
        return self._run("test_step", batch, batch_idx, extra)

    def predict_step(self, batch: Any, batch_idx: int, *extra: Any) -> Any:
        return self._run("predict_step", batch, batch_idx, extra)

    def _threads(self, n: int) -> int | None:
        if self.threads_per_replica is not None or not self._cpu_only:
            return self.threads_per_replica
        return max(1, torch.get_num_threads() // n)

    def _run(self, method: str, batch: Any, batch_idx: int, extra: tuple, training: bool = False) -> Any:
        module = self.module
        assert module is not None  # set by setup()
        self._batch_values = {}  # a new step: the Metrics' batch values are their own until replicas merge
        devices = self.parallel_devices
        step_args = self.step_args(method, batch, batch_idx, extra)
        if len(devices) <= 1:
            return getattr(module, method)(*step_args)
        # Only the batch is split; batch_idx and dataloader_idx go to every replica as they are.
        args, kwargs = scatter_kwargs(step_args, {}, devices)
        weights = [_chunk_size(a) for a in args]
        sinks: list[_ReplicaLog] = []
        made: list[nn.Module] = []
        metric_paths, collection_paths = self._metric_paths, self._collection_paths
        forwards: dict[int, States] = {}  # {id(replica Metric): what its last forward's batch alone left}

        def give_each_replica_a_log(replicas: list[nn.Module]) -> None:
            made.extend(replicas)
            first = torch.device(devices[0])
            for replica, device in zip(replicas, devices):
                sinks.append(_ReplicaLog())
                redirect_log(replica, sinks[-1])
                for path in metric_paths:
                    metric: Any = replica.get_submodule(path)
                    # On the replica's device, unless the module keeps this Metric elsewhere (on the CPU, say).
                    give_own_state(metric, device if metric.device == first else metric.device, forwards)
                for path in collection_paths:
                    give_own_groups(replica.get_submodule(path))

        parallel_backward = bool(self.parallel_backward)
        check = parallel_backward and training and not self._leaves_checked
        outputs = run_replicas(
            module,
            self._replicator,
            args,
            kwargs,
            devices,
            method=method,
            parallel_backward=parallel_backward,
            threads_per_replica=self._threads(len(args)),
            check_leaves=check,
            on_replicas=give_each_replica_a_log,
        )
        if check and len(args) > 1:
            self._leaves_checked = True
        root = self.root_device
        metrics = (
            _merge_metrics(module, made, metric_paths, forwards, self._batch_values) if metric_paths and made else {}
        )
        if sinks:
            _combine_logs(module, sinks, weights, root, metrics)
        return _combine_outputs(outputs, weights, root, training)


def _combine_outputs(outputs: list[Any], weights: list[int], device: torch.device, training: bool) -> Any:
    if len(outputs) == 1:
        return outputs[0]
    skipped = [i for i, out in enumerate(outputs) if out is None]
    if skipped:
        if len(skipped) == len(outputs):
            return None
        raise ValueError(
            f"training_step returned None on replicas {skipped} but not on the others. A step "
            "is skipped for the whole batch or not at all: make the decision independent of the "
            "chunk (e.g. from batch_idx), or use strategy='single'."
        )

    def mean(values: list[Tensor]) -> Tensor:
        return _weighted_mean(values, [float(w) for w in weights], device)

    if training:
        losses = [out["loss"] if isinstance(out, dict) else out for out in outputs]
        if all(isinstance(t, Tensor) and t.numel() == 1 for t in losses):
            # The exact loss: chunk means weighted by chunk size give the whole batch's mean.
            loss = mean([t.reshape(()) for t in losses]).reshape(losses[0].shape)
            if not isinstance(outputs[0], dict):
                return loss
            rest = gather(
                [{k: v for k, v in out.items() if k != "loss"} for out in outputs],
                device,
                warn_on_scalars=False,
                combine_scalars=mean,
            )
            return {"loss": loss, **rest}
    return gather(outputs, device, warn_on_scalars=False, combine_scalars=mean)
