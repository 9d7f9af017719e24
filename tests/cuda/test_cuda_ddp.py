"""ddp on CUDA: NCCL at world size 1, two gloo ranks sharing GPU 0, ember's DDP against PyTorch's.

NCCL refuses two ranks on one GPU, so with one GPU the multi-rank tests use gloo with CUDA tensors
(the reducer's async all-reduce and the broadcasts run on GPU memory all the same).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ember
from ember.callbacks import Callback
from ember.strategies.ddp import DDPStrategy
from tests.cuda.cuda_helpers import BATCH, MLP, assert_close_modules, loader, needs_cuda, needs_two_gpus, trainer
from tests.helpers.dist import join_as_rank, run_ranks

pytestmark = [pytest.mark.processes, needs_cuda, pytest.mark.timeout(180)]
CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def loopback(monkeypatch):
    # NCCL's bootstrap needs a network interface even for one rank; a bare container may have
    # only the loopback one.
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", os.environ.get("NCCL_SOCKET_IFNAME", "lo"))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))


class GroupSpy(Callback):
    def on_train_start(self, trainer, module):
        group = dist.group.WORLD
        self.backend = dist.get_backend()
        self.bound = getattr(group, "bound_device_id", None)
        self.current = torch.cuda.current_device()


def test_ddp_with_nccl_at_world_size_1_equals_the_single_device_fit(loopback):
    spy = GroupSpy()
    module = MLP()
    t = trainer(strategy="ddp", callbacks=[spy])
    t.fit(module, loader())
    assert spy.backend == "nccl" and spy.bound == CUDA0 and spy.current == 0
    assert not dist.is_initialized()  # its private group is released at teardown
    single = MLP()
    trainer().fit(single, loader())
    assert_close_modules(module, single)


def _rank_env(rank: int, world: int) -> None:
    join_as_rank(rank, world)


def gloo_ranks_on_gpu_0(rank: int, world: int) -> dict:
    _rank_env(rank, world)
    module = MLP()
    strategy = DDPStrategy(devices=[CUDA0] * world, process_group_backend="gloo")
    t = trainer(strategy=strategy, max_epochs=2)
    t.fit(module, loader(batch_size=BATCH))
    out = {
        "device": str(module.device),
        "steps": t.global_step,
        "weights": [v.detach().cpu() for v in module.state_dict().values()],
    }
    if rank == 0:  # one process on the global batch, on the same GPU
        alone = MLP()
        trainer(max_epochs=2).fit(alone, loader(batch_size=BATCH * world))
        out["single"] = [v.detach().cpu() for v in alone.state_dict().values()]
    return out


def test_two_gloo_ranks_sharing_gpu_0_train_like_one_process_on_the_global_batch(loopback):
    results = run_ranks(gloo_ranks_on_gpu_0, 2, timeout=150)
    assert [r["device"] for r in results] == ["cuda:0", "cuda:0"]
    assert [r["steps"] for r in results] == [4, 4]  # 64 samples, 2 ranks of batch 16, 2 epochs
    for a, b, c in zip(results[0]["weights"], results[1]["weights"], results[0]["single"]):
        assert torch.equal(a, b)  # the ranks agree exactly
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def ember_and_torch_ddp(rank: int, world: int) -> dict:
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
    ours = ember.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[CUDA0], bucket_cap_mb=0.01)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[0], bucket_cap_mb=0.01)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x, y = torch.randn(32, 8, generator=g).cuda(), torch.randn(32, 1, generator=g).cuda()
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    torch.cuda.synchronize()
    return {
        "ours": [p.detach().cpu() for p in ours.module.parameters()],
        "theirs": [p.detach().cpu() for p in theirs.module.parameters()],
    }


def test_embers_distributed_data_parallel_matches_pytorchs_on_cuda(loopback):
    results = run_ranks(ember_and_torch_ddp, 2, timeout=120)
    for r in results:
        for a, b in zip(r["ours"], r["theirs"]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for a, b in zip(results[0]["ours"], results[1]["ours"]):
        assert torch.equal(a, b)


def rank_on_its_listed_device(rank: int, world: int) -> dict:
    # A group that already exists (made by the harness) still gets the
    # rank's device set, so each rank works on devices[local_rank], not on cuda:0.
    _rank_env(rank, world)
    seen: list[int] = []

    class Spy(MLP):
        def training_step(self, batch, batch_idx):
            seen.append(torch.cuda.current_device())
            return super().training_step(batch, batch_idx)

    module = Spy()
    strategy = DDPStrategy(devices=[torch.device("cuda", 1), torch.device("cuda", 0)], process_group_backend="gloo")
    trainer(strategy=strategy, max_epochs=1).fit(module, loader())
    return {"current": sorted(set(seen)), "device": str(module.device)}  # (a process of its own: no reset)


@needs_two_gpus
def test_each_rank_uses_its_listed_gpu_in_an_existing_group(loopback):
    results = run_ranks(rank_on_its_listed_device, 2, timeout=120)
    assert results == [{"current": [1], "device": "cuda:1"}, {"current": [0], "device": "cuda:0"}]


class TwoGPUNet(nn.Module):
    """Half of the layers on each GPU: backward accumulates on two autograd threads at once."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(*(nn.Linear(64, 64) for _ in range(8))).to("cuda:0")
        self.b = nn.Sequential(*(nn.Linear(64, 64) for _ in range(8))).to("cuda:1")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x.to("cuda:0")).to("cuda:1"))


@needs_two_gpus
def test_a_module_on_two_gpus_reduces_every_gradient_exactly():
    from ember.parallel.distributed import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = TwoGPUNet()
        reference = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, bucket_cap_mb=64 * 65 * 4 / 2**20)  # many buckets
        for step in range(20):
            x = torch.randn(32, 64, device="cuda:0")
            for net in (ddp, reference):
                net.zero_grad()
                net(x).pow(2).mean().backward()
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}")
    finally:
        dist.destroy_process_group()


def test_find_unused_parameters_does_not_synchronise_when_every_parameter_is_used(loopback):
    from ember.parallel.distributed import DistributedDataParallel

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=CUDA0)
    try:
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)).to(CUDA0)
        ddp = DistributedDataParallel(model, device_ids=[0], find_unused_parameters=True)
        x = torch.randn(8, 16, device=CUDA0)
        for step in range(4):
            if step >= 2:  # past the first iterations (buckets built, the warning given)
                torch.cuda.set_sync_debug_mode("error")
            try:
                model.zero_grad()
                ddp(x).sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        dist.destroy_process_group()
