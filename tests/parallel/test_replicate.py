"""replicate: replica structure, storage sharing, gradients, the structure cache, errors."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from ember.parallel.replicate import (
    Broadcast,
    DeviceMismatchError,
    ReduceAdd,
    Replicator,
    _copy_to,
    _reduce_add_coalesced,
    replicate,
)

CPU2 = ["cpu", "cpu"]


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def test_replicas_are_shallow_copies_with_plain_tensor_parameters():
    module = net()
    replicas = replicate(module, CPU2)
    assert len(replicas) == 2
    for r in replicas:
        assert type(r) is nn.Sequential and r is not module
        assert r[0] is not module[0] and type(r[0]) is nn.Linear
        assert not isinstance(r[0].weight, nn.Parameter)
        # parameters() lists the replica's own tensors (PyTorch's replicas list none)
        assert [n for n, _ in r.named_parameters()] == [n for n, _ in module.named_parameters()]
        assert next(r.parameters()) is r[0].weight
        assert r[1].running_mean.shape == (4,)
        assert torch.equal(r[0].weight, module[0].weight)


def test_first_replica_shares_storage_other_cpu_replica_copies_buffers():
    module = net()
    first, second = replicate(module, CPU2)
    assert ptr(first[0].weight) == ptr(module[0].weight)
    assert ptr(second[0].weight) == ptr(module[0].weight)  # CPU alias: no copy needed
    assert first[1].running_mean is module[1].running_mean
    assert ptr(second[1].running_mean) != ptr(module[1].running_mean)


def test_graph_mode_gradients_sum_into_the_original():
    module = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    replicas = replicate(module, ["cpu"] * 3)
    sum(r(x).sum() for r in replicas).backward()
    expected = nn.Linear(3, 2)
    expected.load_state_dict(module.state_dict())
    (3 * expected(x).sum()).backward()
    torch.testing.assert_close(module.weight.grad, expected.weight.grad)
    torch.testing.assert_close(module.bias.grad, expected.bias.grad)


def test_frozen_parameters_get_no_gradient_path():
    module = nn.Linear(3, 2)
    module.bias.requires_grad_(False)
    first, second = replicate(module, CPU2)
    assert first.weight.requires_grad and not second.bias.requires_grad


def test_broadcast_reduce_add_are_twice_differentiable():
    devices = [torch.device("cpu")] * 2
    a = torch.randn(3, dtype=torch.double, requires_grad=True)
    b = torch.randn(2, 2, dtype=torch.double, requires_grad=True)

    def fn(a, b):
        a0, b0, a1, b1 = Broadcast.apply(devices, a, b)
        return (a0 * a1).sum() + (b0**2 * b1).sum()

    assert torch.autograd.gradcheck(fn, (a, b))
    assert torch.autograd.gradgradcheck(fn, (a, b))
    grads = [torch.randn(3, dtype=torch.double, requires_grad=True) for _ in range(2)]
    assert torch.autograd.gradcheck(lambda g0, g1: ReduceAdd.apply(torch.device("cpu"), 1, g0, g1), grads)


def test_detached_replicas_have_no_graph():
    module = net()
    for r in replicate(module, CPU2, detach=True):
        assert r[0].weight.grad_fn is None and not r[0].weight.requires_grad
    with torch.no_grad():
        assert all(r[0].weight.grad_fn is None for r in replicate(module, CPU2))


def test_leaf_mode_shares_leaves_per_device_and_lists_sources():
    module = net()
    module[3].bias.requires_grad_(False)
    reps = Replicator().replicate(module, ["cpu"] * 3, "leaf")
    trainable = [p for p in module.parameters() if p.requires_grad]
    assert len(reps.sources) == len(trainable)
    assert all(s is p for s, p in zip(reps.sources, trainable))
    assert all(leaf.is_leaf and leaf.requires_grad for leaf in reps.leaves[0])
    assert all(a is b for a, b in zip(reps.leaves[0], reps.leaves[2]))
    assert reps.modules[1][0].weight is reps.leaves[1][0]


def test_tied_parameters_stay_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.out = nn.Linear(3, 5, bias=False)
            self.out.weight = self.embed.weight

    for mode in ("graph", "leaf", "detached"):
        [r, s] = Replicator().replicate(Tied(), CPU2, mode).modules
        assert r.embed.weight is r.out.weight and s.embed.weight is s.out.weight


def test_cache_reuses_structure_and_sees_changes():
    module = net()
    rep = Replicator()
    rep.replicate(module, CPU2)
    plan = rep._plan
    rep.replicate(module, CPU2)
    assert rep._plan is plan  # unchanged tree: cached

    with torch.no_grad():
        module[0].weight.add_(1.0)  # in-place (an optimizer step): same storage, new values
    module[3].weight = nn.Parameter(torch.zeros(2, 4))  # a new Parameter object
    module.eval()
    [r, _] = rep.replicate(module, CPU2).modules
    assert rep._plan is plan
    assert torch.equal(r[0].weight, module[0].weight)
    assert torch.equal(r[3].weight, torch.zeros(2, 4))
    assert not r.training and not r[1].training

    module.append(nn.Tanh())  # a new child: re-planned
    [r, _] = rep.replicate(module, CPU2).modules
    assert rep._plan is not plan and isinstance(r[4], nn.Tanh)

    plan = rep._plan
    module[4] = nn.Sigmoid()  # same count, other child
    assert isinstance(rep.replicate(module, CPU2).modules[0][4], nn.Sigmoid)
    assert rep._plan is not plan

    del module[0]._parameters["bias"]
    module[0].register_parameter("other", nn.Parameter(torch.ones(1)))  # same count, new name
    [r, _] = rep.replicate(module, CPU2).modules
    assert torch.equal(r[0].other, torch.ones(1))

    module.double()  # .to() swaps parameter data
    assert rep.replicate(module, CPU2).modules[1][0].weight.dtype == torch.float64


def test_attribute_set_in_replica_is_lost():
    module = nn.Linear(2, 2)
    module.counter = 0
    for r in replicate(module, CPU2):
        r.counter += 1
    assert module.counter == 0


def test_parameters_not_on_first_device_is_a_clear_error():
    module = nn.Linear(2, 2)
    module.bias = nn.Parameter(torch.zeros(2, device="meta"))
    with pytest.raises(DeviceMismatchError, match=r"on device cpu \(device_ids\[0\]\).*meta"):
        replicate(module, CPU2)
    assert issubclass(DeviceMismatchError, ValueError) and issubclass(DeviceMismatchError, RuntimeError)


def test_bad_mode():
    with pytest.raises(ValueError, match="'graph', 'leaf' or 'detached'"):
        Replicator().replicate(nn.Linear(1, 1), CPU2, "copy")


def test_replicator_pickles_and_deep_copies_empty():
    rep = Replicator()
    rep.replicate(net(), CPU2)
    assert pickle.loads(pickle.dumps(rep))._plan is None
    assert copy.deepcopy(rep)._plan is None


def test_coalesced_copy_keeps_values_shapes_and_dtypes():
    tensors = [torch.randn(3, 4), torch.arange(5), torch.randn(2).t(), torch.randn(4, 3).t(), torch.eye(3).to_sparse()]
    copies = _copy_to(tensors, torch.device("cpu"))
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape
        assert torch.equal(c.to_dense(), t.to_dense())


def test_coalesced_copies_have_their_own_version_counters():
    # Views of one flat tensor would share its version counter: an in-place update of one copy
    # (a replica's BatchNorm statistics) would then break backward through an unrelated one.
    weight, stats = torch.randn(4), torch.zeros(4)
    w, s = _copy_to([weight, stats], torch.device("cpu"))
    assert w._base is None and s._base is None
    x = torch.randn(4, requires_grad=True)
    loss = (w * x).sum()  # autograd saves w for x's gradient
    s.add_(1.0)
    assert w._version == 0
    loss.backward()
    torch.testing.assert_close(x.grad, weight)


def test_coalesced_copies_keep_the_memory_layout():
    conv = torch.randn(8, 3, 5, 5).to(memory_format=torch.channels_last)
    transposed = torch.randn(4, 3).t()
    strided_slice = torch.randn(6, 4)[::2]  # not dense: becomes contiguous, as .contiguous()
    copies = _copy_to([conv, transposed, strided_slice, torch.randn(0, 3)], torch.device("cpu"))
    assert copies[0].is_contiguous(memory_format=torch.channels_last)
    assert copies[0].stride() == conv.stride() and copies[1].stride() == transposed.stride()
    assert copies[2].is_contiguous()
    for source, copy_ in zip([conv, transposed, strided_slice], copies):
        assert torch.equal(copy_, source)
    assert copies[3].shape == (0, 3)


def test_reduce_add_coalesced_equals_per_tensor_sums():
    def row():
        return [
            torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last),
            torch.randn(5),
            torch.randn(3, dtype=torch.float64),
            torch.eye(2).to_sparse(),
            torch.randn(4, 2).t(),
        ]

    rows = [row(), row(), row()]
    sums = _reduce_add_coalesced(rows, torch.device("cpu"))
    for j, total in enumerate(sums):
        expected = rows[0][j] + rows[1][j] + rows[2][j]
        assert total.dtype == expected.dtype
        torch.testing.assert_close(total.to_dense(), expected.to_dense())
    assert sums[0].is_contiguous(memory_format=torch.channels_last)
    assert sums[4].stride() == rows[0][4].stride()
    sums[1].add_(1.0)
    assert sums[0]._version == 0 and sums[2]._version == 0
