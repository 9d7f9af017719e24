"""ember.parallel on CUDA: replicas across devices, coalesced copies, streams, DataParallel and dp.

With one GPU, "another device" is the CPU (``replicate(module, ["cpu", "cuda:0"])``) or a second
replica on GPU 0, which ember's DataParallel supports; tests that need two GPUs say so.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ember.parallel import DataParallel
from ember.parallel.replicate import _copy_to, replicate
from ember.parallel.scatter_gather import _background_stream, gather, scatter
from ember.strategies.dp import DataParallelStrategy
from tests.cuda.cuda_helpers import (
    MLP,
    assert_close_modules,
    assert_same_grads,
    loader,
    needs_cuda,
    needs_two_gpus,
    plain_cuda_loop,
    trainer,
)

pytestmark = [needs_cuda, pytest.mark.timeout(120)]
CUDA0 = torch.device("cuda", 0)


class Counting(nn.Module):
    """Scales by one buffer (saved for backward) and counts its calls in another, in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.lin(x)) * self.scale  # autograd saves ``scale``
        self.calls.add_(1.0)  # ...and this in-place update must not invalidate it
        return out


def test_in_place_buffer_update_in_a_gpu_replica_leaves_backward_intact():
    # Copies on another device used to be views of one flat tensor per dtype,
    # sharing one version counter, so ``calls.add_`` broke backward through ``scale``.
    torch.manual_seed(0)
    model = Counting()
    reference = Counting()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(32, 8)
    replicas = replicate(model, ["cpu", "cuda:0"])
    out = torch.cat([replicas[0](x[:16]), replicas[1](x[16:].cuda()).cpu()])
    out.square().sum().backward()  # gradients from cuda:0 come back through the coalesced ReduceAdd
    expected = torch.cat([reference(x[:16]), reference(x[16:])])
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_copies_to_and_from_the_gpu_keep_channels_last():
    weight = torch.randn(16, 3, 3, 3).to(memory_format=torch.channels_last)
    bias = torch.randn(16)
    on_gpu = _copy_to([weight, bias], CUDA0)
    assert on_gpu[0].is_cuda and on_gpu[0].is_contiguous(memory_format=torch.channels_last)
    back = _copy_to(on_gpu, torch.device("cpu"))
    assert back[0].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(back[0], weight) and torch.equal(back[1], bias)


def test_scatter_from_the_cpu_does_not_wait_for_the_gpu_queue():
    # The copy goes on a side stream that no longer waits for the current one: it lands while
    # the current stream is still busy, and the current stream then waits for the copy.
    x = torch.randn(64, 8).pin_memory()
    main = torch.cuda.current_stream()
    torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time on the current stream
    chunks = scatter(x, [CUDA0, CUDA0])
    _background_stream(CUDA0).synchronize()
    still_busy = not main.query()
    torch.cuda.synchronize()
    assert still_busy, "the side stream waited for the current stream's queue"
    assert torch.equal(torch.cat([c.cpu() for c in chunks]), x)


def test_one_device_data_parallel_moves_pinned_inputs_without_blocking_the_host():
    # One device skips the scatter but not its copy: a pinned batch goes over on the side
    # stream, so the forward never waits for the GPU's queue (a blocking .to() would).
    net = DataParallel(nn.Linear(8, 4).to(CUDA0), device_ids=[0])
    x = torch.randn(64, 8).pin_memory()
    net(x)  # first call: replicas, allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.cuda._sleep(1_000_000_000)  # the current stream stays busy for about half a second
        out = net(x)
        still_busy = not torch.cuda.current_stream().query()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert still_busy, "the forward waited for the GPU"
    torch.testing.assert_close(out, net.module(x.to(CUDA0)))


def test_gather_to_the_cpu_returns_values_that_have_landed():
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(200_000_000)  # the fill below waits behind ~0.1 s of GPU time
    x.fill_(3.0)
    out = gather([x[: 1 << 19], x[1 << 19 :]], "cpu")
    assert out.device.type == "cpu" and bool((out == 3.0).all())


def test_two_replicas_on_one_gpu_match_one_device():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).cuda()
    single = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).cuda()
    single.load_state_dict(model.state_dict())
    x = torch.randn(64, 8, device="cuda")
    streams = []

    class Spy(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            streams.append(torch.cuda.current_stream())
            return self.inner(x)

    wrapped = DataParallel(Spy(model), device_ids=[0, 0])
    assert wrapped.parallel_backward is False  # the CPU-only parallel backward stays off on CUDA
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # replicas run on the caller's current stream
        out = wrapped(x)
        out.square().mean().backward()
    torch.cuda.synchronize()
    assert len(streams) == 2 and all(s == side for s in streams)
    expected = single(x)
    expected.square().mean().backward()
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    for p, q in zip(model.parameters(), single.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)


def test_dp_with_device_ids_0_is_the_single_device_fit():
    module = MLP()
    trainer(strategy="dp", devices=[0]).fit(module, loader())
    assert_close_modules(module, plain_cuda_loop())


def test_dp_with_two_replicas_on_gpu_0_matches_one_device():
    module = MLP()
    strategy = DataParallelStrategy(devices=[CUDA0, CUDA0])
    t = trainer(strategy=strategy)
    t.fit(module, loader())
    assert t.global_step == 8 and strategy.parallel_backward is False
    assert_close_modules(module, plain_cuda_loop(), atol=1e-5)


def test_parallel_backward_on_cuda_is_refused():
    with pytest.raises(ValueError, match="would deadlock"):
        trainer(strategy=DataParallelStrategy(devices=[CUDA0, CUDA0], parallel_backward=True)).fit(MLP(), loader())


# ---------------------------------------------------------------------- DataParallel from CPU inputs, against torch's
def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


@needs_two_gpus
def test_matches_torch_dataparallel_on_two_gpus():
    module = small_mlp().cuda()
    reference = copy.deepcopy(module)
    x, y = torch.randn(9, 5), torch.randint(0, 3, (9,)).cuda()
    F.cross_entropy(DataParallel(module, [0, 1])(x), y).backward()
    F.cross_entropy(torch.nn.DataParallel(reference, [0, 1])(x), y).backward()
    assert_same_grads(module, reference)


def test_cpu_inputs_reach_a_gpu_replica_and_gradients_come_back():
    module = small_mlp().cuda()
    x = torch.randn(6, 5, requires_grad=True)
    model = DataParallel(module, [0, 0] if torch.cuda.device_count() < 2 else [0, 1])
    out = model(x)
    assert out.device == torch.device("cuda", 0)
    out.sum().backward()
    assert x.grad is not None and x.grad.device.type == "cpu"
