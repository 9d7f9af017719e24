"""The reducer's per-step work is per bucket: autograd accumulates into the bucket views.

One process with a 1-rank gloo group (no spawning): the tensor ops the reducer issues during a
backward are counted with a dispatch mode and compared with a plain backward of the same model;
gradients are checked against plain autograd in the paths that still copy (the first backward,
a zero_grad between forward and backward, a held old gradient, gradients on several devices).
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ember.parallel.buckets import MiB
from ember.parallel.distributed import DistributedDataParallel as DDP
from tests.parallel.test_reducer import Backwards


class CountOps(TorchDispatchMode):
    """Counts every aten / c10d op dispatched while active (autograd's included)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def deep(n: int = 30) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(8, 8) for _ in range(n)))  # 2 * n parameter tensors


def backward_ops(net: nn.Module, x: torch.Tensor) -> Counter[str]:
    loss = net(x).pow(2).sum()
    with CountOps() as mode:
        loss.backward()
    return mode.counts


def test_reducer_ops_per_step_scale_with_buckets_not_parameters(group):
    model = deep()
    plain = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=12 * 72 * 4 / MiB)  # 60 tensors in 3 buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    for _ in range(3):  # past the first backward and the bucket rebuild
        opt.zero_grad()
        ddp(x).pow(2).sum().backward()
        opt.step()
    buckets = len(ddp.reducer.buckets)
    assert buckets == 3
    for set_to_none in (True, False):
        opt.zero_grad(set_to_none=set_to_none)
        plain.zero_grad(set_to_none=set_to_none)
        ours, theirs = backward_ops(ddp, x), backward_ops(plain, x)
        # Autograd's own accumulation (a steal when .grad is None, an add into .grad otherwise)
        # is the same work in both; what the reducer adds on top is per bucket.
        extra = ours - theirs
        for accumulation in ("add_", "detach", "add"):
            extra.pop(accumulation, None)
        assert extra["allreduce_"] == buckets
        # Per bucket: zeroing its slots (a slice and a zero_) and the all-reduce; once: the copy
        # of the gradient whose hook starts the backward. Never one op per parameter.
        assert sum(extra.values()) <= 3 * buckets + 1 < len(ddp.reducer.params), extra
    for p in model.parameters():
        assert p.grad.untyped_storage().data_ptr() in {
            b.buffer.untyped_storage().data_ptr() for b in ddp.reducer.buckets
        }


def check_against_plain(ddp: DDP, model: nn.Module, steps: int = 3, zero_grad_after_forward: bool = False) -> None:
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8)
        losses = []
        for net, opt in zip((ddp, reference), opts):
            if not zero_grad_after_forward:
                opt.zero_grad()
            loss = net(x).pow(2).sum()
            if zero_grad_after_forward:
                opt.zero_grad()
            loss.backward()
            losses.append(loss)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        for opt in opts:
            opt.step()


def test_zero_grad_between_forward_and_backward_still_reduces_every_gradient(group):
    # The Trainer's order (training_step, then zero_grad, then backward): the gradients are
    # pointed at the buckets when backward starts, not when the forward ends.
    model = deep(6)
    check_against_plain(DDP(model, bucket_cap_mb=2 * 72 * 4 / MiB), model, zero_grad_after_forward=True)


def test_gradients_on_several_devices_take_the_copying_path(group):
    model = deep(6)
    ddp = DDP(model, bucket_cap_mb=2 * 72 * 4 / MiB)
    ddp.reducer._one_device = False  # what a module spread over two GPUs gets
    check_against_plain(ddp, model)
    for p in model.parameters():  # still views of the buckets, copied there by the hooks
        assert p.grad._base is not None


def test_no_sync_accumulation_is_carried_into_the_buckets(group):
    model = deep(4)
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    xs = torch.randn(5, 4, 8)
    ddp(xs[0]).sum().backward()  # buckets exist; the gradients are their views
    model.zero_grad()  # dropped: the no_sync backward below makes gradients of its own
    with ddp.no_sync():
        for x in xs[1:3]:
            ddp(x).sum().backward()
    for x in xs[3:]:
        ddp(x).sum().backward()
    for x in xs[1:]:
        reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        assert p.grad.untyped_storage().data_ptr() == ddp.reducer.buckets[0].buffer.untyped_storage().data_ptr()


def test_a_rebuild_lays_the_new_buckets_over_the_dropped_memory(group):
    model = Backwards()
    reference = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=272 * 4 / MiB)  # one Linear per bucket
    x = torch.randn(4, 16)

    def memory() -> set[int]:
        return {b.buffer.untyped_storage().data_ptr() for b in ddp.reducer.buckets}

    ddp(x).sum().backward()
    before, order = memory(), ddp.reducer.bucket_indices
    assert len(before) == 1  # one allocation for all buckets
    model.zero_grad()
    ddp(x).sum().backward()  # rebuilt at this forward
    assert ddp.reducer.bucket_indices != order and memory() == before
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_dropped_gradient_held_from_cpp_is_not_overwritten(group):
    model = nn.Linear(5, 3)
    holder = nn.Parameter(torch.zeros(3, 5))
    ddp = DDP(model)
    ddp(torch.randn(2, 5)).sum().backward()
    holder.grad = model.weight.grad  # referenced from C++ only: no Python name holds it
    snapshot = holder.grad.clone()
    model.zero_grad()
    ddp(torch.randn(2, 5)).sum().backward()
    assert torch.equal(holder.grad, snapshot)
    assert model.weight.grad.data_ptr() != holder.grad.data_ptr()


def test_sparse_embeddings_are_refused_when_wrapping(group):
    with pytest.raises(ValueError, match=r"emb.*sparse=True.*sparse=False"):
        DDP(nn.ModuleDict({"emb": nn.Embedding(10, 4, sparse=True)}))


class Gappy(nn.Module):
    """Parameters whose strides leave gaps (slices of larger tensors), first and last in a bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter((torch.randn(8, 16) * 0.3)[:, ::2])  # stride (16, 2)
        self.mid = nn.Linear(8, 8)
        self.last = nn.Parameter((torch.randn(16, 8) * 0.3).t()[:, ::2])  # transposed, sliced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mid(x @ self.first) @ self.last


def test_parameters_with_gaps_get_dense_gradient_slots(group):
    # A strided view of a gappy parameter would reach past its slot into its neighbours' (or
    # past the buffer): its gradient slot must be a dense one of the same shape.
    model = Gappy()
    assert not model.first.is_contiguous() and not model.last.is_contiguous()
    ddp = DDP(model)
    check_against_plain(ddp, model)
    for bucket in ddp.reducer.buckets:
        ends = sorted((v.storage_offset(), v.storage_offset() + v.numel()) for v in bucket.views)
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # slots do not overlap


def test_dense_layouts_keep_their_strides_and_gappy_ones_are_told_apart():
    from ember.parallel.buckets import dense

    channels_last = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert dense(channels_last) and dense(torch.randn(3, 4).t()) and dense(torch.randn(1, 5)[:, :])
    assert not dense(torch.randn(3, 8)[:, ::2]) and not dense(torch.randn(4, 4)[:2, :2])
