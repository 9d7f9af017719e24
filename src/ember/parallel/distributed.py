"""DistributedDataParallel: a drop-in for PyTorch's class, running on ember's Reducer.

One process per device holds a full replica. At construction the model is checked to be the same
on every rank and rank 0's parameters and buffers are broadcast; during backward the Reducer
averages gradients bucket by bucket while backward still runs. ``no_sync()`` skips the
communication (gradients accumulate locally) and ``join()`` lets ranks with fewer inputs shadow
the others' collectives.

Differences from PyTorch worth knowing:

- Buffers (e.g. BatchNorm statistics) are broadcast before a forward that follows a synchronised
  training forward, as in PyTorch, except that nothing is communicated inside ``no_sync()``: the
  first synchronised forward after the window broadcasts instead.
- A parameter that got no gradient raises at the end of that backward (naming it), not at the
  next forward.
- From the first synchronised backward on, ``param.grad`` is a view into a flat bucket buffer
  and autograd accumulates small gradients into it directly (large ones are copied in once): one
  gradient-sized buffer where PyTorch keeps two. After ``zero_grad()`` drops the gradients the
  buffer is reused, unless (without ``gradient_as_bucket_view``) an old ``.grad`` or a tensor
  sharing its memory is still held: then the bucket gets a fresh buffer, so a held reference is
  never overwritten.
- Sparse gradients (``nn.Embedding(sparse=True)``) are refused when wrapping.
- ``call(name, ...)`` / ``pre_forward`` / ``post_forward`` run any method of the module through
  the same synchronisation as ``forward`` (the Trainer calls ``training_step``).
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ember.parallel.advice import UnusedParameterAdvice
from ember.parallel.comm_hooks import CommHook, GradBucket, resolve_comm_hook
from ember.parallel.reducer import MiB, Reducer
from ember.user_frames import user_stacklevel

__all__ = ["DistributedDataParallel"]

_BROADCAST_BUCKET_BYTES = 250 * MiB


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism across processes: wraps ``module`` and averages its gradients.

    Create one per process after ``torch.distributed.init_process_group``; every rank must wrap
    the same architecture.

    Args:
        module: The model to replicate; its parameters are synchronised from rank 0.
        device_ids: ``None`` for CPU or multi-device modules, else ``[device]``: the single
            device the module lives on; inputs are moved there before forward.
        output_device: Accepted for compatibility; outputs stay where the module puts them.
        dim: Accepted for compatibility (DDP does not scatter inputs).
        broadcast_buffers: Broadcast rank 0's buffers at construction and before forward.
        process_group: The group to average over; ``None`` means the default group.
        bucket_cap_mb: Size cap of gradient buckets in MiB (the first bucket is ~1 MiB so the
            first all-reduce starts early).
        find_unused_parameters: Walk the autograd graph after each forward so parameters that
            take no part in the loss do not stall the reduction. Costs a graph walk per step.
        gradient_as_bucket_view: Keep gradients in the bucket buffers permanently, even after
            ``zero_grad(set_to_none=True)``; saves an allocation per step.
        static_graph: The same parameters are used the same number of times every iteration
            (learned in the first one); supports unused parameters without a graph walk.
        comm_hook: ``None`` (fp32 all-reduce), ``"bf16"`` / ``"fp16"`` (compressed all-reduce,
            see :mod:`ember.parallel.comm_hooks` for the accuracy trade-off), or a callable
            ``hook(bucket) -> Future[Tensor]`` that divides by the world size itself.
        advice: What the error about a parameter that got no gradient, and the warning that every
            parameter got one under ``find_unused_parameters=True``, tell the user to change (see
            :class:`~ember.parallel.reducer.UnusedParameterAdvice`); the default names this constructor's
            arguments. ember's ``ddp`` strategy names its own instead.

    Raises:
        RuntimeError: If the process group is not initialised or the model differs by rank.
        ValueError: If no parameter requires grad or the device arguments do not fit.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        comm_hook: str | CommHook | None = None,
        advice: UnusedParameterAdvice | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DistributedDataParallel needs an initialised process group, but "
                "torch.distributed is not initialised. Call torch.distributed."
                "init_process_group(backend, ...) in every process before wrapping the model."
            )
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.broadcast_buffers = broadcast_buffers
        self.dim, self.output_device = dim, output_device
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "DistributedDataParallel got a module with no parameter that requires grad; "
                "there is nothing to synchronise. Wrap a module with trainable parameters."
            )
        self._check_dense(module)
        self.device = self._check_devices(module, device_ids)
        self.device_ids = None if device_ids is None else [self.device]
        self._rank = dist.get_rank(self.process_group)
        self._verify_same_model(named)
        states: list[Tensor] = [p for _, p in module.named_parameters()]
        if broadcast_buffers:
            states += list(module.buffers())
        self._broadcast(states, src=0)
        self.reducer = Reducer(
            [p for _, p in named],
            [n for n, _ in named],
            self.process_group,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            advice=advice,
        )
        self.reducer.comm_hook = resolve_comm_hook(comm_hook, self.process_group)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self._warned_all_used = False

    # ----------------------------------------------------------------------- checks
    @staticmethod
    def _check_dense(module: nn.Module) -> None:
        # Gradients accumulate into dense buckets, which would silently densify a sparse one.
        sparse = [
            name or type(m).__name__
            for name, m in module.named_modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad
        ]
        if sparse:
            raise ValueError(
                f"DistributedDataParallel reduces dense gradient buckets only, but {sparse} "
                "use sparse=True. Construct them with sparse=False (the default)."
            )

    @staticmethod
    def _check_devices(module: nn.Module, device_ids: Sequence | None) -> torch.device:
        devices = {p.device for p in module.parameters()}
        if len({d.type for d in devices}) > 1:
            raise ValueError(
                f"DistributedDataParallel expects parameters on one device type, found "
                f"{sorted(str(d) for d in devices)}. Move the module with .to(device) first."
            )
        first = next(iter(devices))
        if device_ids is None:
            return first
        if len(device_ids) != 1 or len(devices) > 1:
            raise ValueError(
                f"device_ids={list(device_ids)} is not supported: pass a single device the "
                "module lives on (e.g. device_ids=[local_rank]) or None for CPU and "
                "multi-device modules."
            )
        wanted = (
            torch.device(device_ids[0])
            if not isinstance(device_ids[0], int)
            else torch.device(first.type, device_ids[0])
        )
        if first != wanted:
            raise ValueError(
                f"device_ids={list(device_ids)} but the module's parameters are on {first}. "
                f"Call module.to({str(wanted)!r}) before wrapping it."
            )
        return wanted

    def _verify_same_model(self, named: Sequence[tuple[str, Tensor]]) -> None:
        # One small all-gather instead of letting mismatched broadcasts hang or corrupt memory.
        shapes = ";".join(f"{tuple(p.shape)}{p.dtype}" for _, p in named).encode()
        mine = torch.tensor(
            [len(named), sum(p.numel() for _, p in named), zlib.crc32(shapes)], dtype=torch.int64, device=self.device
        )
        world = dist.get_world_size(self.process_group)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=self.process_group)
        bad = [r for r, t in enumerate(gathered) if not torch.equal(t, gathered[0])]
        if bad:
            got = {r: gathered[r][:2].tolist() for r in [0, *bad]}
            raise RuntimeError(
                "DistributedDataParallel expects the same model on every rank, but the trainable "
                f"parameters differ ([count, elements] per rank: {got}; shapes or dtypes may "
                "differ too). Build the identical model on every rank before wrapping it."
            )

    # ------------------------------------------------------------------- forward path
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module's forward with the synchronisation around it."""
        inputs, kwargs = self.pre_forward(*inputs, **kwargs)
        return self.post_forward(self.module(*inputs, **kwargs))

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Runs ``module.<method>(*args, **kwargs)`` as if it were ``forward``.

        Args:
            method: Name of the wrapped module's method, e.g. ``"training_step"``.
            *args: Positional arguments for it (moved to ``device_ids[0]`` if set).
            **kwargs: Keyword arguments for it.

        Returns:
            What the method returns; its tensors are what backward will start from.
        """
        args, kwargs = self.pre_forward(*args, **kwargs)
        return self.post_forward(getattr(self.module, method)(*args, **kwargs))

    def pre_forward(self, *inputs: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """The collectives that precede a forward; returns the inputs moved to the device.

        Every rank must call it the same number of times (or be inside :meth:`join`).
        """
        sync = self.require_backward_grad_sync and torch.is_grad_enabled()
        joining = self._join_config.enable
        if joining:
            work = Join.notify_join_context(self)
            if work is not None:
                work.wait()
                if not self._divide_by_initial_world_size:
                    self.reducer.div_factor = float(work.result()[0].item())
            # Tells ranks that already joined whether to shadow a backward this iteration.
            self._all_reduce_flag(int(sync))
        self.reducer.prepare_for_forward(sync)
        if joining:
            if sync:
                self._sync_buffers_joining(candidate=True)
        elif self.require_forward_param_sync and self.require_backward_grad_sync:
            self._sync_buffers(0)
        if self.device_ids is not None and self.device.type != "cpu":
            inputs, kwargs = apply_to_collection((inputs, kwargs), Tensor, Tensor.to, self.device, non_blocking=True)
        return inputs, kwargs

    def post_forward(self, outputs: Any) -> Any:
        """Arms gradient synchronisation for the backward of ``outputs``; returns them."""
        if torch.is_grad_enabled():
            if self.require_backward_grad_sync:
                unused = self._unused_parameters(outputs) if self.reducer.find_unused else ()
                self.reducer.prepare_for_backward(unused)
                self.require_forward_param_sync = True
        else:
            self.require_forward_param_sync = False
        return outputs

    def prepare_for_backward(self, outputs: Any) -> None:
        """Arms synchronisation for a backward of ``outputs`` if nothing armed it yet.

        A forward through the wrapper already does this; call it before a further backward of
        the same forward (e.g. one per optimizer in manual optimization), which would otherwise
        not be synchronised. A no-op inside :meth:`no_sync` or with grad disabled.
        """
        if torch.is_grad_enabled() and self.require_backward_grad_sync and not self.reducer.armed:
            self.post_forward(outputs)

    def sync_buffers(self) -> None:
        """Broadcasts rank 0's buffers now (e.g. BatchNorm statistics before evaluating).

        A collective: every rank must call it.
        """
        self._sync_buffers(0)

    def _unused_parameters(self, outputs: Any) -> list[int]:
        """Indices of reducer parameters the autograd graph of ``outputs`` does not reach."""
        stack: list = []
        apply_to_collection(outputs, Tensor, lambda t: stack.append(t.grad_fn) if t.grad_fn is not None else None)
        seen, reached = set(stack), set()
        while stack:
            fn = stack.pop()
            leaf = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their parameter
            if leaf is not None:
                reached.add(id(leaf))
            for nxt, _ in fn.next_functions:
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        unused = [i for i, p in enumerate(self.reducer.params) if id(p) not in reached]
        advice = self.reducer.advice.all_used
        if not unused and not self._warned_all_used and advice is not None:
            self._warned_all_used = True
            warnings.warn(
                f"find_unused_parameters=True, but every parameter received a gradient in this iteration. {advice}",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        return unused

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skips gradient communication for forwards and backwards run inside the context.

        Gradients accumulate locally; the first synchronised backward after it averages the
        accumulated sum. No collective is issued inside the context. The forward must run
        inside it too.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Callable[[object, GradBucket], torch.futures.Future]) -> None:
        """Registers ``hook(state, bucket) -> Future[Tensor]`` to reduce each bucket.

        Same contract as PyTorch's: call once, before the first backward; the hook divides.
        """
        if self.reducer.comm_hook is not None or self.reducer.synced_iterations:
            raise RuntimeError(
                "register_comm_hook must be called once, before the first backward pass; a hook "
                "is already set or training has started. Register it right after wrapping."
            )
        self.reducer.comm_hook = lambda bucket: hook(state, bucket)

    # ------------------------------------------------------------------ collectives
    def _broadcast(self, tensors: list[Tensor], src: int) -> None:
        """Broadcasts tensors from group rank ``src`` in one collective per 250 MiB."""
        _broadcast_coalesced(tensors, src, self.process_group, self._rank)

    def _sync_buffers(self, src: int) -> None:
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())  # re-read: users may reassign buffers
            if buffers:
                self._broadcast(buffers, src)

    def _sync_buffers_joining(self, candidate: bool) -> None:
        # Rank 0 may have joined already: take the buffers of the highest rank still training.
        if self.broadcast_buffers and next(self.module.buffers(), None) is not None:
            self._sync_buffers(self._common_rank(candidate))

    def _all_reduce_flag(self, value: int) -> bool:
        flag = torch.tensor([value], device=self.device)
        dist.all_reduce(flag, group=self.process_group)
        return bool(flag.item())

    def _common_rank(self, candidate: bool) -> int:
        """Highest group rank among those passing ``candidate`` (the source under join)."""
        rank = torch.tensor([self._rank if candidate else -1], device=self.device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(rank.item())

    # ------------------------------------------------------------------------- join
    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """Context manager for uneven inputs: ranks that run out shadow the others.

        Args:
            divide_by_initial_world_size: Average over all ranks (joined ranks contribute
                zeros) rather than over the ranks still training.
            enable: Set False to make the context a no-op.
            throw_on_early_termination: Raise on every rank as soon as one runs out.
        """
        return Join(
            [self], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook :class:`~torch.distributed.algorithms.join.Join` runs on joined ranks."""
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return _JoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup | None:
        return self.process_group


class _JoinHook(JoinHook):
    """Mirrors, on a rank out of inputs, the collectives of one iteration of the others."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp = self.ddp
        sync = ddp._all_reduce_flag(0)  # same order as pre_forward on the training ranks
        if sync and ddp.reducer.rebuild_pending:
            ddp.reducer.rebuild_buckets()
        if sync:
            ddp._sync_buffers_joining(candidate=False)
            ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        # Ranks that joined early skipped optimizer steps: take the model of a last joiner.
        src = ddp._common_rank(is_last_joiner)
        states: list[Tensor] = list(ddp.module.parameters())
        if ddp.broadcast_buffers:
            states += list(ddp.module.buffers())
        ddp._broadcast(states, src)
        # Join leaves the config enabled; without this every later forward would keep
        # paying the join collectives.
        ddp._join_config = ddp._join_config._replace(enable=False)
        ddp._divide_by_initial_world_size = True


def _broadcast_coalesced(
    tensors: list[Tensor],
    src: int,
    group: dist.ProcessGroup | None,
    rank: int,
    bucket_bytes: int = _BROADCAST_BUCKET_BYTES,
) -> None:
    """Broadcasts ``tensors`` (any dtypes) as flat byte buffers, one collective per bucket."""
    global_src = src if group is None or group is dist.group.WORLD else dist.get_global_rank(group, src)
    with torch.no_grad():
        by_device: dict[torch.device, list[Tensor]] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        for device, group_tensors in by_device.items():
            chunk: list[Tensor] = []
            size = 0
            for t in group_tensors:
                chunk.append(t)
                size += _padded_bytes(t)
                if size >= bucket_bytes:
                    _broadcast_chunk(chunk, size, device, global_src, group, rank == src)
                    chunk, size = [], 0
            if chunk:
                _broadcast_chunk(chunk, size, device, global_src, group, rank == src)


def _padded_bytes(t: Tensor) -> int:
    # 8-byte alignment so every slice can be viewed back as its dtype.
    return (t.numel() * t.element_size() + 7) // 8 * 8


def _broadcast_chunk(
    chunk: list[Tensor], size: int, device: torch.device, src: int, group: dist.ProcessGroup | None, is_src: bool
) -> None:
    if len(chunk) == 1 and chunk[0].is_contiguous() and chunk[0].dtype != torch.bool:
        dist.broadcast(chunk[0], src=src, group=group)  # in place, no staging copy
        return
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    slices, offset = [], 0
    for t in chunk:
        n = t.numel() * t.element_size()
        view = flat[offset : offset + n].view(t.dtype).view(t.shape)
        if is_src:
            view.copy_(t)
        slices.append(view)
        offset += _padded_bytes(t)
    dist.broadcast(flat, src=src, group=group)
    if not is_src:
        for t, view in zip(chunk, slices):
            t.copy_(view)
