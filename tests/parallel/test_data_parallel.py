"""DataParallel: PyTorch's documented behaviour, on CPU replicas in threads."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ember.parallel.data_parallel import DataParallel, data_parallel
from ember.parallel.replicate import DeviceMismatchError


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        # A gradient that is identically zero may come back as zeros on one side, None on the other.
        pg = p.grad if p.grad is not None else torch.zeros_like(p)
        qg = q.grad if q.grad is not None else torch.zeros_like(q)
        torch.testing.assert_close(pg, qg, msg=name, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("parallel_backward", [True, False])
@pytest.mark.parametrize("batch", [7, 12])
def test_gradients_equal_the_unwrapped_module(replicas, parallel_backward, batch):
    module, reference = mlp(), mlp()
    reference.load_state_dict(module.state_dict())
    x = torch.randn(batch, 5)
    y = torch.randint(0, 3, (batch,))
    model = DataParallel(module, ["cpu"] * replicas, parallel_backward=parallel_backward)
    out = model(x)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(reference(x), y).backward()
    torch.testing.assert_close(out, reference(x))
    assert_same_grads(module, reference)


def test_torch_dataparallel_on_cpu_is_a_plain_call_with_the_same_gradients():
    # Without CUDA, torch.nn.DataParallel just calls the module; ours really splits the batch.
    ours, theirs = mlp(), mlp()
    theirs.load_state_dict(ours.state_dict())
    x, y = torch.randn(9, 5), torch.randint(0, 3, (9,))
    F.cross_entropy(DataParallel(ours, ["cpu", "cpu"])(x), y).backward()
    F.cross_entropy(torch.nn.DataParallel(theirs)(x), y).backward()
    assert_same_grads(ours, theirs)


def test_inputs_requiring_grad_get_gradients():
    module = mlp()
    x = torch.randn(6, 5, requires_grad=True)
    module(x).pow(2).sum().backward()
    expected, x.grad = x.grad.clone(), None
    for pb in (True, False):
        DataParallel(module, ["cpu"] * 3, parallel_backward=pb)(x).pow(2).sum().backward()
        torch.testing.assert_close(x.grad, expected)
        x.grad = None


def test_training_several_steps_matches_plain_training():
    module, reference = mlp(), mlp()
    reference.load_state_dict(module.state_dict())
    model = DataParallel(module, ["cpu", "cpu", "cpu"])
    opt_a = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)
    opt_b = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    for _ in range(4):
        x, y = torch.randn(10, 5), torch.randint(0, 3, (10,))
        for m, opt in ((model, opt_a), (reference, opt_b)):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_forward_hooks_run_once_per_replica_on_their_chunks():
    module = mlp()
    seen = []
    module.register_forward_hook(lambda m, inp, out: seen.append(inp[0].shape[0]))
    out = DataParallel(module, ["cpu"] * 4)(torch.randn(5, 5))
    assert sorted(seen) == [1, 2, 2] and out.shape == (5, 3)  # 5 over 4: only 3 replicas


def test_replicas_run_in_threads_with_one_intra_op_thread_each():
    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.seen: list = []

        def forward(self, x):
            self.seen.append((threading.current_thread().name, torch.get_num_threads()))
            return self.lin(x)

    probe = Probe()
    threads = torch.get_num_threads()
    DataParallel(probe, ["cpu", "cpu"])(torch.randn(4, 2))
    assert len({name for name, _ in probe.seen}) == 2
    assert {n for _, n in probe.seen} == {max(1, threads // 2)}
    assert torch.get_num_threads() == threads


def test_scalar_outputs_become_a_vector_with_a_warning():
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            return self.lin(x).mean()

    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        out = DataParallel(Loss(), ["cpu"] * 3)(torch.randn(6, 3))
    assert out.shape == (3,)
    out.mean().backward()


def test_inplace_buffer_updates_persist_only_from_the_first_replica():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4, momentum=1.0)  # running stats = the last batch's stats
    x = torch.randn(8, 4) * 3 + 1
    DataParallel(bn, ["cpu", "cpu"])(x)
    torch.testing.assert_close(bn.running_mean, x[:4].mean(0))  # chunk 0 only
    assert bn.num_batches_tracked.item() == 1

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))
            self.python_calls = 0

        def forward(self, x):
            self.calls.add_(1)
            self.python_calls += 1
            return x

    counter = Counter()
    DataParallel(counter, ["cpu"] * 3)(torch.ones(3))
    assert counter.calls.item() == 1 and counter.python_calls == 0


def test_parameters_inside_a_replica_forward_are_the_replicas_own():
    class Penalised(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            device = next(self.parameters()).device  # empty in PyTorch's replicas
            penalty = sum(p.pow(2).sum() for p in self.parameters())
            return self.lin(x.to(device)).sum(1) + penalty

    module = Penalised()
    reference = copy.deepcopy(module)
    x = torch.randn(6, 3)
    for pb in (True, False):
        module.zero_grad()
        DataParallel(module, ["cpu"] * 3, parallel_backward=pb)(x).sum().backward()
        reference.zero_grad()
        reference(x).sum().backward()
        assert_same_grads(module, reference)


def test_kwargs_are_scattered_and_structures_gathered():
    @dataclasses.dataclass
    class Out:
        y: torch.Tensor
        note: str

    class Net(nn.Module):
        def forward(self, x, *, mask, tag):
            return {"y": x * mask, "out": Out(x.sum(1), tag)}

    x, mask = torch.randn(5, 2), torch.ones(5, 2)
    got = DataParallel(Net(), ["cpu", "cpu"])(x, mask=mask, tag="t")
    torch.testing.assert_close(got["y"], x)
    assert isinstance(got["out"], Out) and got["out"].y.shape == (5,) and got["out"].note == "t"


def test_dim_one_and_output_device():
    model = DataParallel(nn.Identity(), ["cpu", "cpu"], dim=1)
    x = torch.randn(2, 6)
    assert torch.equal(model(x), x)
    assert model.output_device == torch.device("cpu") and model.dim == 1
    assert model.device_ids == [torch.device("cpu")] * 2


def test_no_inputs_runs_once_on_the_first_device():
    class Constant(nn.Module):
        calls = 0

        def forward(self):
            Constant.calls += 1
            return torch.ones(2, 2)

    assert DataParallel(Constant(), ["cpu", "cpu"])().shape == (2, 2)
    assert Constant.calls == 1


def test_default_devices_without_cuda_just_call_the_module():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    module = mlp()
    model = DataParallel(module)
    assert model.devices == [torch.device("cpu")]
    x = torch.randn(3, 5)
    torch.testing.assert_close(model(x), module(x))
    assert model(3 * torch.ones(1, 5)).shape == (1, 3)


def test_bad_inputs_are_clear_errors():
    model = DataParallel(mlp(), ["cpu", "cpu"])
    with pytest.raises(ValueError, match="holds no tensor"):
        model(3)
    with pytest.raises(ValueError, match="same size along dim 0"):
        model(torch.randn(4, 5), torch.randn(3, 5))
    for devices in (["cpu", "cpu"], ["cpu"]):
        module = mlp()
        model = DataParallel(module, devices)  # one device: moves the module there, as PyTorch
        module[2].bias = nn.Parameter(torch.zeros(3, device="meta"))
        with pytest.raises(DeviceMismatchError, match=r"device_ids\[0\].*meta"):
            model(torch.randn(4, 5))
    with pytest.raises(ValueError, match="all be of one type"):
        DataParallel(mlp(), ["cpu", "meta"])


def test_exception_in_a_replica_names_it():
    class Fails(nn.Module):
        def forward(self, x):
            if x.shape[0] == 1:
                raise IndexError("tiny chunk")
            return x

    with pytest.raises(IndexError, match=r"(?s)in replica 2 on device cpu.*tiny chunk"):
        DataParallel(Fails(), ["cpu"] * 3)(torch.randn(5, 1))


def test_no_grad_forward_builds_no_graph():
    model = DataParallel(mlp(), ["cpu", "cpu"])
    with torch.no_grad():
        out = model(torch.randn(4, 5))
    assert out.grad_fn is None and not out.requires_grad


def test_retain_graph_and_higher_order_gradients():
    module = mlp()
    x = torch.randn(6, 5, requires_grad=True)
    loss = DataParallel(module, ["cpu", "cpu"])(x).sum()
    loss.backward(retain_graph=True)
    once = module[0].weight.grad.clone()
    loss.backward()
    torch.testing.assert_close(module[0].weight.grad, 2 * once)

    # A gradient penalty needs one graph across replicas: parallel_backward=False.
    module.zero_grad()
    out = DataParallel(module, ["cpu", "cpu"], parallel_backward=False)(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    gx.pow(2).sum().backward()
    reference = copy.deepcopy(module)
    reference.zero_grad()
    (rx,) = torch.autograd.grad(reference(x).sum(), x, create_graph=True)
    rx.pow(2).sum().backward()
    assert_same_grads(module, reference)
    with pytest.raises(RuntimeError, match="parallel_backward=False"):
        out = DataParallel(module, ["cpu", "cpu"])(x)
        torch.autograd.grad(out.sum(), x, create_graph=True)


def test_state_dict_pickle_and_deepcopy():
    model = DataParallel(mlp(), ["cpu", "cpu"])
    model(torch.randn(4, 5))
    assert all(k.startswith("module.") for k in model.state_dict())
    x = torch.randn(4, 5)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        torch.testing.assert_close(clone(x), model(x))


def test_subclass_hooks_with_pytorchs_method_names():
    calls = []

    class Custom(DataParallel):
        def scatter(self, inputs, kwargs, device_ids):
            calls.append("scatter")
            return super().scatter(inputs, kwargs, device_ids)

        def parallel_apply(self, replicas, inputs, kwargs):
            calls.append(("parallel_apply", len(replicas)))
            return super().parallel_apply(replicas, inputs, kwargs)

        def gather(self, outputs, output_device):
            calls.append("gather")
            return super().gather(outputs, output_device)

    module, reference = mlp(), mlp()
    reference.load_state_dict(module.state_dict())
    x = torch.randn(5, 5)
    Custom(module, ["cpu"] * 3)(x).sum().backward()
    reference(x).sum().backward()
    assert calls == ["scatter", ("parallel_apply", 3), "gather"]
    assert_same_grads(module, reference)


def test_functional_data_parallel():
    module = mlp()
    x = torch.randn(5, 5)
    torch.testing.assert_close(data_parallel(module, x, ["cpu", "cpu"]), module(x))


def test_parallel_backward_on_cuda_is_refused_at_construction():
    model = mlp()
    with pytest.raises(
        ValueError,
        match=r"parallel_backward=True .* CPU replicas only; on cuda:0 it would"
        r" deadlock.*set it to False",
    ):
        DataParallel(model, device_ids=["cuda:0", "cuda:0"], parallel_backward=True)
    assert next(model.parameters()).device.type == "cpu"
