"""Reducer unit tests in one process: bucket assignment, rebuild, gradient views, errors.

A 1-rank gloo group exercises the whole hook / bucket / all-reduce path without spawning;
multi-rank behaviour is in test_distributed.py.
"""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ember.parallel.buckets import MiB, compute_bucket_assignment
from ember.parallel.comm_hooks import GradBucket, resolve_comm_hook
from ember.parallel.distributed import DistributedDataParallel as DDP
from tests.helpers.dist import count_collectives


def _sized(*numels: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=dtype) for n in numels]


# ------------------------------------------------------------------------- assignment
def test_assignment_in_reverse_order_with_a_small_first_bucket():
    params = _sized(*(MiB // 4 // 2 for _ in range(8)))  # eight 0.5 MiB tensors
    buckets = compute_bucket_assignment(params, reversed(range(8)), [1 * MiB, 2 * MiB])
    assert buckets == [[7, 6], [5, 4, 3, 2], [1, 0]]


def test_assignment_gives_an_oversized_tensor_its_own_bucket():
    params = _sized(10, 5 * MiB // 4, 10)
    assert compute_bucket_assignment(params, [2, 1, 0], [MiB, MiB]) == [[2, 1], [0]]
    assert compute_bucket_assignment(params, [1, 2, 0], [MiB, MiB]) == [[1], [2, 0]]


def test_assignment_separates_dtypes_and_orders_buckets_by_first_member():
    params = _sized(4, 4) + _sized(4, dtype=torch.float64) + _sized(4)
    buckets = compute_bucket_assignment(params, [2, 3, 1, 0], [MiB])
    assert buckets == [[2], [3, 1, 0]]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 3000), st.booleans()), min_size=1, max_size=30),
    st.integers(64, 4096),
    st.integers(64, 8192),
    st.randoms(),
)
def test_assignment_properties(spec, first, cap, rnd):
    params = [torch.empty(n, dtype=torch.float64 if wide else torch.float32) for n, wide in spec]
    order = list(range(len(params)))
    rnd.shuffle(order)
    buckets = compute_bucket_assignment(params, order, [first, cap])
    assert sorted(i for b in buckets for i in b) == list(range(len(params)))
    position = {i: k for k, i in enumerate(order)}
    assert [position[b[0]] for b in buckets] == sorted(position[b[0]] for b in buckets)
    for b in buckets:
        assert len({params[i].dtype for i in b}) == 1
        assert [position[i] for i in b] == sorted(position[i] for i in b)
        # Only the last tensor may push a bucket over its limit.
        assert sum(params[i].numel() * params[i].element_size() for i in b[:-1]) < max(first, cap)


# ------------------------------------------------------------------------- buckets
class Backwards(nn.Module):
    """Uses its layers in the reverse of registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.a(self.b(self.c(x)))


def test_buckets_follow_reverse_registration_then_rebuild_once_from_ready_order(group):
    model = Backwards()
    ddp = DDP(model, bucket_cap_mb=272 * 4 / MiB)  # one Linear (weight + bias) per bucket
    assert ddp.reducer.bucket_indices == [[5, 4], [3, 2], [1, 0]]
    broadcasts = []
    for _ in range(3):
        with count_collectives() as counts:
            ddp(torch.randn(4, 16)).sum().backward()
        broadcasts.append(counts["broadcast"])
        assert counts["all_reduce"] == 3
    assert broadcasts == [0, 1, 0]  # rank 0's order is shared once, at the second forward
    # Gradients of `a` (used last in forward) are ready first.
    assert ddp.reducer.bucket_indices == [[1, 0], [3, 2], [5, 4]]


def test_gradients_match_plain_backward_and_live_in_the_buckets(group):
    torch.manual_seed(0)
    model, reference = nn.Linear(5, 3), nn.Linear(5, 3)
    reference.load_state_dict(model.state_dict())
    ddp = DDP(model)
    x = torch.randn(7, 5)
    ddp(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    buffer = ddp.reducer.buckets[0].buffer
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        assert p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_dropped_gradients_are_never_overwritten(group):
    model = nn.Linear(5, 3)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp(torch.randn(2, 5)).sum().backward()
    kept = model.weight.grad
    snapshot = kept.clone()
    opt.zero_grad()  # set_to_none: the old gradient is the user's now
    ddp(torch.randn(2, 5)).sum().backward()
    assert torch.equal(kept, snapshot) and model.weight.grad is not kept
    # Zeroed in place, the gradients stay in the same buffer and accumulate there.
    in_place = model.weight.grad
    opt.zero_grad(set_to_none=False)
    ddp(torch.randn(2, 5)).sum().backward()
    assert model.weight.grad is in_place


def test_a_dropped_buffer_is_reused_only_when_nothing_else_shares_it(group):
    model = nn.Linear(5, 3)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> int:
        opt.zero_grad()
        ddp(torch.randn(2, 5)).sum().backward()
        return ddp.reducer.buckets[0].buffer.data_ptr()

    first = step()
    assert step() == first  # nobody kept the old gradients: no new allocation
    flat = model.weight.grad.view(-1)  # a derived view keeps the old values visible
    snapshot = flat.clone()
    assert step() != first and torch.equal(flat, snapshot)


def test_gradient_as_bucket_view_keeps_one_buffer(group):
    model = nn.Linear(5, 3)
    ddp = DDP(model, gradient_as_bucket_view=True)
    ptrs = set()
    for _ in range(3):
        model.zero_grad()
        ddp(torch.randn(2, 5)).sum().backward()
        ptrs.add(ddp.reducer.buckets[0].buffer.data_ptr())
        assert model.bias.grad.data_ptr() in range(min(ptrs), min(ptrs) + 32)
    assert len(ptrs) == 1


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_missing_gradient_raises_a_clear_error_naming_the_parameters(group):
    ddp = DDP(WithUnused())
    with pytest.raises(RuntimeError, match=r"unused\.weight.*unused\.bias.*find_unused_parameters"):
        ddp(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="unused.weight"):  # reported again, never a hang
        ddp(torch.randn(2, 4)).sum().backward()


def test_find_unused_parameters_leaves_unused_gradients_untouched(group):
    model = WithUnused()
    ddp = DDP(model, find_unused_parameters=True)
    for _ in range(2):
        ddp(torch.randn(2, 4)).sum().backward()
    assert model.unused.weight.grad is None and model.used.weight.grad is not None


def test_find_unused_parameters_warns_when_nothing_is_unused(group):
    ddp = DDP(nn.Linear(4, 4), find_unused_parameters=True)
    with pytest.warns(UserWarning, match="every parameter received a gradient"):
        ddp(torch.randn(2, 4)).sum().backward()


def test_find_unused_parameters_reads_the_used_map_back_only_when_something_was_unused(group, monkeypatch):
    # Reading the map back is a host sync on GPUs: PyTorch does it only when a parameter was
    # unused locally (its gradient may have to be adopted from the other ranks' average).
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.numel()) or tolist(t))

    class Sometimes(WithUnused):
        def forward(self, x, uses_all):
            return self.used(x) + (self.unused(x) if uses_all else 0)

    model = Sometimes()
    ddp = DDP(model, find_unused_parameters=True)
    n = len(list(model.parameters()))
    for uses_all in (True, False, True):
        reads.clear()
        ddp(torch.randn(2, 4), uses_all).sum().backward()
        assert (n in reads) != uses_all, (uses_all, reads)
    assert model.unused.weight.grad is not None  # used in the last step: reduced as usual


def test_static_graph_learns_the_unused_set(group):
    model = WithUnused()
    ddp = DDP(model, static_graph=True)
    for _ in range(3):
        ddp(torch.randn(2, 4)).sum().backward()
    assert model.unused.weight.grad is None and model.used.weight.grad is not None


def test_no_sync_issues_no_collective(group):
    ddp = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    ddp(torch.randn(3, 4)).sum().backward()
    with count_collectives() as counts, ddp.no_sync():
        for _ in range(2):
            ddp(torch.randn(3, 4)).sum().backward()
    assert sum(counts.values()) == 0


def test_call_runs_a_named_method_through_the_sync_path(group):
    class Module(nn.Linear):
        def training_step(self, x, scale):
            return self(x).sum() * scale

    model = Module(4, 2)
    ddp = DDP(model)
    with count_collectives() as counts:
        ddp.call("training_step", torch.randn(3, 4), scale=2.0).backward()
    assert counts["all_reduce"] == 1 and model.weight.grad is not None


def test_custom_hook_sees_buckets_in_launch_order_and_does_the_reduction(group):
    seen = []

    def hook(bucket: GradBucket):
        seen.append((bucket.index(), bucket.is_last(), len(bucket.parameters())))
        assert all(g.numel() == p.numel() for g, p in zip(bucket.gradients(), bucket.parameters()))
        bucket.set_buffer(bucket.buffer() * 3)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ddp = DDP(model, bucket_cap_mb=20 * 4 / MiB, comm_hook=hook)
    x = torch.randn(2, 4)
    ddp(x).sum().backward()
    assert seen == [(0, False, 2), (1, True, 2)]
    expected = torch.autograd.grad(model(x).sum(), model[0].weight)[0] * 3
    torch.testing.assert_close(model[0].weight.grad, expected)


def test_hooks_go_quiet_when_the_wrapper_is_dropped(group):
    model = nn.Linear(4, 4)
    ddp = DDP(model)
    ddp(torch.randn(2, 4)).sum().backward()
    del ddp
    gc.collect()
    model.zero_grad()
    with count_collectives() as counts:
        model(torch.randn(2, 4)).sum().backward()
    assert sum(counts.values()) == 0 and model.weight.grad._base is None


def test_errors_say_what_to_do(group):
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        DDP(nn.ReLU())
    with pytest.raises(ValueError, match="bf16"):
        resolve_comm_hook("int8", None)
    with pytest.raises(ValueError, match="single device"):
        DDP(nn.Linear(2, 2), device_ids=[0, 1])
    ddp = DDP(nn.Linear(2, 2))
    ddp.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(RuntimeError, match="once, before the first backward"):
        ddp.register_comm_hook(None, lambda state, bucket: None)


def test_wrapping_without_a_process_group_explains_the_fix():
    with pytest.raises(RuntimeError, match="init_process_group"):
        DDP(nn.Linear(2, 2))


def test_hooks_of_a_module_on_several_devices_never_run_concurrently():
    # Each device's gradients are accumulated on an autograd thread of its own: the reducer's
    # per-iteration state must change under a lock (one device: one thread, no lock needed).
    import threading
    import time
    import weakref

    from ember.parallel.grad_hooks import locked_ready_hook as _locked_hook

    class Recording:
        inside = peak = calls = 0

        def _on_grad_ready(self, index: int) -> None:
            self.inside += 1
            self.peak = max(self.peak, self.inside)
            time.sleep(0.001)  # long enough for another thread to enter, were it allowed to
            self.calls += 1
            self.inside -= 1

    reducer = Recording()
    lock = threading.Lock()
    hooks = [_locked_hook(weakref.ref(reducer), i, lock) for i in range(8)]
    threads = [threading.Thread(target=lambda h=h: [h(torch.empty(0)) for _ in range(10)]) for h in hooks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reducer.calls == 80 and reducer.peak == 1
