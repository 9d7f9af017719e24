"""Gradient buckets, per-parameter hooks and the all-reduce that overlaps backward.

Parameters are grouped into buckets in reverse registration order (their gradients tend to be
ready first), each bucket owning one flat buffer. At the start of a synchronised backward (its first
gradient hook) every small parameter's ``.grad`` is pointed at its slot in the buffer, so autograd
accumulates straight into the bucket: no copy per parameter, and the gradients *are* the bucket
(one gradient-sized buffer instead of PyTorch's two). A post-accumulate-grad hook per parameter
then only counts: when a bucket's last gradient is in, its small slots are divided by the world
size in one op and its all-reduce launched asynchronously, in strict bucket order so every rank
issues the same collectives in the same order, while backward keeps computing. Large parameters
(``buckets.LARGE_NUMEL``) are left to autograd and copied into their slot by their hook, divided
while copying: one op each, cheap next to their data, and fewer bytes moved than zeroing and
accumulating in place. One callback queued on the autograd engine waits for everything at the
end of backward. So the per-step tensor work is per bucket plus per large parameter; per small
parameter there is one cheap Python call. Buckets are rebuilt once from the order gradients
actually became ready in the first iteration, using rank 0's order so all ranks agree.

A gradient that is not its slot when its hook fires (the one whose hook starts the backward, one
replaced or dropped mid-backward, the first iteration of a static graph, a module spread over
several devices) is copied into the slot instead.

Without ``gradient_as_bucket_view`` the gradients must stay independent tensors: when the user has
dropped them (``zero_grad(set_to_none=True)``), the buffer is only reused if no tensor outside the
reducer still holds its memory; otherwise the bucket gets a fresh buffer, so an old ``.grad``
reference never sees its values overwritten.

``torch.autograd.graph.register_multi_grad_hook`` would not save anything here: it registers one
Python hook per tensor too (with a lock and dictionaries per call), and it sees the gradients
before they are accumulated into ``.grad``.

The hooks themselves are in ``grad_hooks.py``; the buckets' layout and storage in ``buckets.py``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ember.parallel.advice import UnusedParameterAdvice
from ember.parallel.buckets import (
    DEFAULT_FIRST_BUCKET_BYTES,
    FlatBucket,
    MiB,
    allocate_missing,
    compute_bucket_assignment,
)
from ember.parallel.comm_hooks import CommHook, GradBucket
from ember.parallel.grad_hooks import locked_ready_hook, ready_hook, remove_handles

__all__ = ["Reducer", "compute_bucket_assignment", "DEFAULT_FIRST_BUCKET_BYTES", "MiB"]


def _group_src(group: dist.ProcessGroup | None) -> int:
    """Global rank of the group's rank 0 (``broadcast`` wants global ranks)."""
    if group is None or group is dist.group.WORLD:
        return 0
    return dist.get_global_rank(group, 0)


class Reducer:
    """Averages gradients across ranks while backward runs.

    Args:
        params: Parameters to reduce (unique, requiring grad), in registration order.
        names: A name per parameter, for error messages.
        process_group: The group to reduce over.
        bucket_cap_mb: Size cap of every bucket but the first, in MiB.
        first_bucket_bytes: Size cap of the first bucket, so communication starts early
            (never more than ``bucket_cap_mb``).
        find_unused_parameters: Walk the autograd graph after each forward and treat parameters
            it does not reach as ready (their slot contributes zeros).
        gradient_as_bucket_view: Always reuse the bucket buffers as the gradients' storage.
        static_graph: The set of used parameters and the number of times each one's hook fires
            are the same every iteration; learned in the first iteration.
        advice: What the error about a parameter without a gradient tells the user to change.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        names: Sequence[str],
        process_group: dist.ProcessGroup | None,
        *,
        bucket_cap_mb: float = 25,
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        advice: UnusedParameterAdvice | None = None,
    ) -> None:
        self.params = list(params)
        self.advice = advice or UnusedParameterAdvice()
        self.names = list(names)
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        cap = int(bucket_cap_mb * MiB)
        self.limits = [min(int(first_bucket_bytes), cap), cap]
        self.find_unused = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.comm_hook: CommHook | None = None
        self._one_device = len({p.device for p in self.params}) == 1
        self.buckets: list[FlatBucket] = []
        self._locate: list[tuple[int, int]] = []
        self._spare: list[Tensor] = []  # the buffers' memory before a rebuild, for reuse
        self._build(reversed(range(len(self.params))))

        ref = weakref.ref(self)
        lock = threading.Lock()
        self._handles = [
            p.register_post_accumulate_grad_hook(
                ready_hook(ref, i) if self._one_device else locked_ready_hook(ref, i, lock)
            )
            for i, p in enumerate(self.params)
        ]
        weakref.finalize(self, remove_handles, self._handles)

        # Per-iteration state, reset by prepare_for_backward.
        self._expect_hooks = False  # False under no_sync / no_grad: hooks do nothing
        self._started = False  # a hook fired: finalize is queued
        self._ready = bytearray(len(self.params))
        self._next_bucket = 0
        self._unused: list[int] = []  # locally unused, marked ready at the first hook
        self._used_work = None
        self._used_map: Tensor | None = None
        self.div_factor: float = float(self.world_size)
        self._scale: float | None = None  # what the reducer multiplies each bucket by

        # Learned once.
        self.synced_iterations = 0
        self._order: list[int] | None = [] if not find_unused_parameters else None
        self._rebuilt = find_unused_parameters  # dynamic graphs keep the initial buckets
        self._static_counts: list[int] | None = None  # hook firings per param (static graph)
        self._static_left: list[int] = []
        self._global_used: list[int] | None = None  # static graph: used on any rank

    # ----------------------------------------------------------------------------- buckets
    def _build(self, order: Iterable[int]) -> None:
        assignment = compute_bucket_assignment(self.params, order, self.limits)
        self.buckets = [FlatBucket(indices, self.params) for indices in assignment]
        self._locate = [(0, 0)] * len(self.params)
        for b, bucket in enumerate(self.buckets):
            for slot, i in enumerate(bucket.indices):
                self._locate[i] = (b, slot)

    @property
    def bucket_indices(self) -> list[list[int]]:
        """Parameter indices per bucket, in launch order."""
        return [list(b.indices) for b in self.buckets]

    @property
    def armed(self) -> bool:
        """Whether the next backward will be synchronised and has not started yet."""
        return self._expect_hooks and not self._started

    @property
    def rebuild_pending(self) -> bool:
        """Whether the next synchronised forward rebuilds buckets (a collective)."""
        return not self._rebuilt and self.synced_iterations >= 1

    def rebuild_buckets(self) -> bool:
        """Rebuilds buckets from rank 0's observed ready order; all ranks must call it.

        Returns:
            Whether the bucket assignment changed.
        """
        seen = set(self._order or [])
        # Parameters that never fired (static graph, or a rank that joined before any step)
        # go last, in the initial order, so every rank sends a complete permutation.
        order = list(self._order or []) + [i for i in reversed(range(len(self.params))) if i not in seen]
        tensor = torch.tensor(order, dtype=torch.int64, device=self._comm_device)
        dist.broadcast(tensor, src=_group_src(self.group), group=self.group)
        self._rebuilt, self._order = True, None
        assignment = compute_bucket_assignment(self.params, tensor.tolist(), self.limits)
        if assignment == self.bucket_indices:
            return False
        # Gradients still point into the old buffers; the next backward copies them over, or
        # lays the new buckets over the old memory if nothing holds it by then.
        self._spare = [
            b.buffer if b.buffer._base is None else b.buffer._base for b in self.buckets if b.buffer is not None
        ]
        self._build(tensor.tolist())
        return True

    @property
    def _comm_device(self) -> torch.device:
        return self.params[0].device

    # ------------------------------------------------------------------------- iteration
    def prepare_for_forward(self, sync: bool) -> None:
        """Checks the previous backward finished; rebuilds buckets once (when ``sync``)."""
        if self._started:
            # A backward ran hooks but never reached its end-of-backward callback (it raised).
            missing = [i for i in range(len(self.params)) if not self._ready[i]]
            self._abort()
            raise RuntimeError(
                self._missing_message(missing, "the previous backward pass stopped before reducing gradients")
            )
        self._expect_hooks = False
        if sync and torch.is_grad_enabled() and self.rebuild_pending:
            self.rebuild_buckets()

    def prepare_for_backward(self, unused: Sequence[int] = ()) -> None:
        """Arms the hooks for the coming backward (call after a synchronised forward).

        Args:
            unused: With ``find_unused_parameters``: indices of the parameters the autograd
                graph of this forward does not reach (they count as ready, contributing zeros).
        """
        self._expect_hooks = True
        self._started = False
        self._ready = bytearray(len(self.params))
        self._next_bucket = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.indices)
            bucket.work = None
        self._used_work = None
        if self.find_unused:
            self._unused = list(unused)
            # Built on the host and sent without blocking it (indexing a GPU tensor with a list
            # is a blocking copy of the indices); nothing to send when all were used.
            if self._unused:
                used = torch.ones(len(self.params), dtype=torch.int32)
                used[self._unused] = 0
                if self._comm_device.type == "cuda":
                    used = used.pin_memory()
                self._used_map = used.to(self._comm_device, non_blocking=True)
            else:
                self._used_map = torch.ones(len(self.params), dtype=torch.int32, device=self._comm_device)
        elif self._static_counts is not None:
            self._static_left = list(self._static_counts)

    def _on_grad_ready(self, index: int) -> None:
        if not self._expect_hooks:
            return
        if not self._started:
            self._start_backward()
        if self.static_graph:
            if self._static_counts is None:  # first iteration: count, reduce at the end
                self._first_counts[index] += 1
                if self._first_counts[index] == 1 and self._order is not None:
                    self._order.append(index)
                return
            self._static_left[index] -= 1
            if self._static_left[index] > 0:
                return
            if self._static_left[index] < 0:
                raise RuntimeError(
                    f"static_graph=True, but the gradient hook of parameter "
                    f"'{self.names[index]}' fired more often than in the first iteration "
                    f"({self._static_counts[index]} times). The graph changed between "
                    "iterations; construct the wrapper with static_graph=False."
                )
        self._mark_ready(index, from_hook=True)

    def _start_backward(self) -> None:
        """First gradient hook of a synchronised backward: point the gradients at the buckets."""
        self._started = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        hook = self.comm_hook
        prescale = hook is None or getattr(hook, "accepts_prescaled", False)
        self._scale = 1 / self.div_factor if prescale and self.div_factor != 1 else None
        first_static = self.static_graph and self._static_counts is None
        # Only the gradient whose hook is running has been accumulated so far, so from here on
        # autograd adds the others into their slots. Not in a static graph's first iteration
        # (its unused parameters, not known yet, must keep .grad as it is), nor across devices
        # (each device's gradients are accumulated on a thread of its own, concurrently).
        attach = self._one_device and not first_static
        skip = set(self._unused)  # unused: .grad stays as it is unless another rank used them
        for bucket in self.buckets:
            detached = self._claim(bucket)
            if attach and detached:
                self._attach(bucket, detached, skip)
        if first_static:
            self._first_counts = [0] * len(self.params)
            return
        for i in self._unused:
            self._mark_ready(i, from_hook=False)

    def _claim(self, bucket: FlatBucket) -> list[int]:
        """Makes the bucket's buffer safe to write; returns the slots not holding their gradient."""
        params, views = bucket.params, bucket.views
        if bucket.buffer is None:
            allocate_missing(self.buckets, self._spare)
            self._spare = []
            return list(range(len(params)))
        detached = [k for k, (p, v) in enumerate(zip(params, views)) if p.grad is not v]
        if detached and not self.gradient_as_bucket_view and bucket.shared(detached, self.buckets):
            # Some dropped gradient (or a view of one) is still held: leave the old memory to
            # its holder. Attached gradients are copied over by _attach / _mark_ready.
            bucket.allocate()
            return list(range(len(params)))
        return detached

    def _attach(self, bucket: FlatBucket, detached: list[int], skip: set[int]) -> None:
        """Writes the current gradients of small ``detached`` slots into them, points .grad there.

        Large slots are left to autograd and copied in by their hooks (see ``FlatBucket``).
        """
        large = bucket.large
        small = [k for k in detached if not large[k]]
        if not small:
            return
        params, views, buffer = bucket.params, bucket.views, bucket.buffer
        assert buffer is not None  # claimed
        grads = [params[k].grad for k in small]
        if self.gradient_as_bucket_view:
            # A gradient replaced by another view of the buffer (else _claim gave a fresh one)
            # must be read before the buffer is zeroed.
            here = buffer.untyped_storage().data_ptr()
            grads = [g.clone() if g is not None and g.untyped_storage().data_ptr() == here else g for g in grads]
        if len(small) == len(params) - sum(large) and any(g is None for g in grads):
            buffer[: bucket.small_numel].zero_()  # one op (the usual case: all were dropped)
        else:
            for k, grad in zip(small, grads):
                if grad is None:
                    views[k].zero_()
        copies = [(k, g) for k, g in zip(small, grads) if g is not None]
        if copies:
            for k, g in copies:
                self._check_dense(bucket.indices[k], g)
            torch._foreach_copy_([views[k] for k, _ in copies], [g.detach() for _, g in copies])
        for k in small:
            if bucket.indices[k] not in skip:
                params[k].grad = views[k]

    def _check_dense(self, index: int, grad: Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(
                f"Parameter '{self.names[index]}' has a sparse gradient; ember's "
                "DistributedDataParallel reduces dense buckets only. Use sparse=False."
            )

    def _mark_ready(self, index: int, from_hook: bool) -> None:
        if self._ready[index]:
            raise RuntimeError(
                f"The gradient of parameter '{self.names[index]}' became ready twice in one "
                "backward pass (reentrant activation checkpointing, or the parameter used by "
                "several forwards before one backward). Use non-reentrant checkpointing, or "
                "construct the wrapper with static_graph=True if the graph does not change."
            )
        self._ready[index] = 1
        if from_hook and self.synced_iterations == 0 and self._order is not None and not self.static_graph:
            self._order.append(index)
        b, slot = self._locate[index]
        bucket = self.buckets[b]
        view = bucket.views[slot]
        param = self.params[index]
        grad = param.grad
        # Small slots are divided with their bucket at launch, large ones here.
        scale = self._scale if bucket.large[slot] else None
        if grad is not view:  # not accumulated into its slot (see the module docstring)
            if grad is None:
                view.zero_()
            else:
                self._check_dense(index, grad)
                if scale is not None:
                    torch.mul(grad.detach(), scale, out=view)  # divide while copying
                else:
                    view.copy_(grad.detach())
                if from_hook:
                    param.grad = view  # frees the autograd-produced gradient right away
        elif scale is not None:
            view.mul_(scale)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        buckets = self.buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            b = self._next_bucket
            self._next_bucket += 1
            buffer = buckets[b].buffer
            assert buffer is not None  # every gradient of the bucket arrived
            self._launch(b, buffer)
        if self._next_bucket == len(buckets) and self._used_map is not None and self._used_work is None:
            self._used_work = dist.all_reduce(self._used_map, group=self.group, async_op=True)

    def _launch(self, b: int, buffer: Tensor) -> None:
        bucket = self.buckets[b]
        if self._scale is not None and bucket.small_numel:
            # The division by the world size, one op for all the small slots.
            buffer[: bucket.small_numel].mul_(self._scale)
        if self.comm_hook is None:
            bucket.work = dist.all_reduce(buffer, group=self.group, async_op=True)
        else:
            grad_bucket = GradBucket(b, buffer, bucket.params, bucket.views, b == len(self.buckets) - 1)
            # Built-in hooks let the reducer divide: saves them a pass of their own.
            grad_bucket.prescaled = getattr(self.comm_hook, "accepts_prescaled", False)
            bucket.work = self.comm_hook(grad_bucket)

    def _finalize_backward(self) -> None:
        """End of backward: wait once for every bucket; gradients are then averaged."""
        try:
            if self.static_graph and self._static_counts is None:
                self._finish_static_first_iteration()
            if self._next_bucket < len(self.buckets):
                missing = [i for i in range(len(self.params)) if not self._ready[i]]
                self._abort()
                raise RuntimeError(self._missing_message(missing, "backward finished"))
            for bucket in self.buckets:
                assert bucket.work is not None and bucket.buffer is not None  # every bucket launched
                result = bucket.work.wait()
                if (
                    self.comm_hook is not None
                    and isinstance(result, Tensor)
                    and result.data_ptr() != bucket.buffer.data_ptr()
                ):
                    bucket.buffer.copy_(result.reshape(-1))
                bucket.work = None
            if self._used_work is not None:
                self._used_work.wait()
                self._used_work = None
                if self.static_graph:
                    self._global_used = self._used_map.tolist()
                    self._used_map = None
                if self._global_used is not None:
                    self._adopt_locally_unused(self._global_used)
                elif self._unused:  # read back (a host sync) only when there is a gradient to adopt
                    self._adopt_locally_unused(self._used_map.tolist())
            elif self._global_used is not None:
                self._adopt_locally_unused(self._global_used)
            self.synced_iterations += 1
        finally:
            self._expect_hooks = False
            self._started = False
            self.div_factor = float(self.world_size)

    def _adopt_locally_unused(self, global_used: list[int]) -> None:
        # Another rank used it: the averaged slot is this rank's gradient too. Nobody used
        # it: leave .grad untouched, like PyTorch.
        for i in self._unused:
            if global_used[i]:
                b, slot = self._locate[i]
                self.params[i].grad = self.buckets[b].views[slot]

    def _finish_static_first_iteration(self) -> None:
        counts = self._first_counts
        self._static_counts = counts
        self._unused = [i for i, c in enumerate(counts) if c == 0]
        self._used_map = torch.tensor([int(c > 0) for c in counts], dtype=torch.int32, device=self._comm_device)
        # Hooks only counted; now every gradient is final, so reduce all buckets in order.
        for i in range(len(self.params)):
            self._mark_ready(i, from_hook=counts[i] > 0)

    def _abort(self) -> None:
        # Wait for what was launched so no collective is left in flight (the same buckets
        # were launched by every rank that saw the same unused set), then reset.
        for bucket in self.buckets[: self._next_bucket]:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work = None
        self._expect_hooks = False
        self._started = False

    def _missing_message(self, missing: list[int], when: str) -> str:
        names = [self.names[i] for i in missing]
        rank = dist.get_rank(self.group)
        return (
            f"DistributedDataParallel: {when}, but these parameters received no gradient on "
            f"rank {rank}: {names}. {self.advice.missing}"
        )

    # ----------------------------------------------------------------------------- join
    def shadow_backward(self) -> None:
        """On a rank that ran out of inputs: match the others' backward collectives with zeros."""
        first_static = self.static_graph and self._static_counts is None
        for b, bucket in enumerate(self.buckets):
            first = bucket.params[0]
            zeros = torch.zeros(bucket.numel, dtype=first.dtype, device=first.device)
            if self.comm_hook is None:
                dist.all_reduce(zeros, group=self.group)
            else:
                self.comm_hook(GradBucket(b, zeros, bucket.params, [], b == len(self.buckets) - 1)).wait()
        if self.find_unused or first_static:
            used = torch.zeros(len(self.params), dtype=torch.int32, device=self._comm_device)
            dist.all_reduce(used, group=self.group)
            if first_static:
                # Learn the graph from the ranks that did compute it.
                self._global_used = used.tolist()
                self._static_counts = [int(u > 0) for u in self._global_used]
                self._unused = [i for i, u in enumerate(self._global_used) if not u]
        self.synced_iterations += 1

    def remove_hooks(self) -> None:
        """Detaches the gradient hooks from the parameters (the reducer stops working)."""
        remove_handles(self._handles)
        self._handles.clear()
