"""The ``ddp`` strategy in the Trainer, on real gloo ranks (2 and 3 processes).

Each rank joins the group the harness created, as it would under torchrun (the rank variables are
set), and runs several Trainer fits; rank 0 also trains with ``strategy="single"`` on the global
batch (``world * B``) for reference. One spawn per world size: the checks return numbers and the
tests assert on them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.strategies.ddp import DDPStrategy
from ember.strategies.launchers.launcher import World
from tests.helpers.dist import join_as_rank, run_ranks

B, STEPS, TOL, N = 4, 20, 1e-5, 48
pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


class Net(ember.TrainModule):
    """An MLP; ``kind`` adds tied weights, an unused layer, BatchNorm or manual optimization."""

    def __init__(self, kind: str = "mlp") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.a, self.b, self.c = torch.nn.Linear(6, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)
        if kind == "tied":
            self.tied = torch.nn.Linear(16, 16)
            self.tied.weight = self.b.weight
        if kind == "unused":
            self.spare = torch.nn.Linear(6, 3)
        self.norm = torch.nn.BatchNorm1d(16) if kind == "batchnorm" else torch.nn.Identity()
        if kind == "manual":
            self.automatic_optimization = False
        self.grads: list = []
        self.comms: list[Counter] = []

    def forward(self, x):
        h = torch.tanh(self.norm(self.a(x)))
        h = torch.tanh(self.b(h))
        if self.kind == "tied":
            h = torch.tanh(self.tied(h))
        return self.c(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, on_epoch=True)
        if self.kind == "manual":
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self._keep_first_grads()
            opt.step()
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        if self.kind == "lbfgs":  # calls the closure several times per step, deciding from the loss
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=4)
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_before_optimizer_step(self, optimizer):
        self._keep_first_grads()

    def _keep_first_grads(self):
        if not self.grads:
            self.grads = [None if p.grad is None else p.grad.clone() for p in self.parameters()]

    # Counting collectives issued during each batch (through dist.<name> calls).
    def on_train_batch_start(self, batch, batch_idx):
        self.comms.append(Counter())

    def on_fit_start(self):
        for name in ("all_reduce", "broadcast", "all_gather", "barrier"):
            original = getattr(dist, name)
            if not hasattr(original, "_counted"):
                setattr(dist, name, _counting(name, original))
        _Active.module = self


class _Active:
    module: Net | None = None


def _counting(name, original):
    def wrapper(*args, **kwargs):
        if _Active.module is not None and _Active.module.comms:
            _Active.module.comms[-1][name] += 1
        return original(*args, **kwargs)

    wrapper._counted = True
    return wrapper


def loaders(world: int, global_batch: bool, val_size: int = 21) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 6, generator=g), torch.randn(N, 3, generator=g)
    batch = B * world if global_batch else B
    return (
        DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True),
        DataLoader(TensorDataset(x[:val_size], y[:val_size]), batch_size=5),
    )


def fit(kind: str, world: int, strategy, **trainer_kwargs) -> tuple[Net, ember.Trainer]:
    ember.seed_everything(7)  # same global RNG on every run: the shuffle order comes from it
    module = Net(kind)
    devices = 1 if strategy == "single" else world
    trainer = ember.Trainer(
        strategy=strategy,
        devices=devices,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(module, *loaders(world, strategy == "single"))
    return module, trainer


def diff(a, b) -> float:
    if any((x is None) != (y is None) for x, y in zip(a, b)):
        return float("inf")
    return max((x - y).abs().max().item() for x, y in zip(a, b) if x is not None)


def parity(kind: str, rank: int, world: int, strategy_kwargs=None, **trainer_kwargs) -> dict:
    module, trainer = fit(kind, world, DDPStrategy(**(strategy_kwargs or {})), **trainer_kwargs)
    out = {
        "weights": [t.detach().clone() for t in module.state_dict().values()],
        "comms": [dict(c) for c in module.comms],
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    if rank == 0:
        alone, single = fit(kind, world, "single", **trainer_kwargs)
        out["vs_single_weights"] = diff(list(module.state_dict().values()), list(alone.state_dict().values()))
        out["vs_single_grads"] = diff(module.grads, alone.grads)
        out["single_metrics"] = {k: float(v) for k, v in single.callback_metrics.items()}
    return out


def check_user_collectives(rank: int, world: int) -> dict:
    strategy = DDPStrategy()
    t = torch.tensor(float(rank + 1))
    return {
        "sum": strategy.reduce(t, "sum").item(),
        "mean": strategy.reduce(t, "mean").item(),
        "max": strategy.reduce(t, "max").item(),
        "gather": strategy.all_gather(t).tolist(),
        "broadcast": strategy.broadcast({"from": rank}, src=world - 1),
        "any": strategy.reduce_boolean_decision(rank == 1, all=False),
        "all": strategy.reduce_boolean_decision(rank == 1, all=True),
        "input_untouched": t.item() == rank + 1,
    }


CHECKS = {
    "mlp": lambda r, w: parity("mlp", r, w),
    "tied": lambda r, w: parity("tied", r, w),
    "unused": lambda r, w: parity("unused", r, w, {"find_unused_parameters": True}),
    "batchnorm": lambda r, w: parity("batchnorm", r, w),
    "accumulation": lambda r, w: parity("mlp", r, w, accumulate_grad_batches=2),
    "manual": lambda r, w: parity("manual", r, w),
    "lbfgs": lambda r, w: parity("lbfgs", r, w),
    "collectives": check_user_collectives,
}


def suite(rank: int, world: int) -> dict:
    join_as_rank(rank, world)
    out = {}
    for name, check in CHECKS.items():
        try:
            out[name] = check(rank, world)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request) -> list[dict]:
    return run_ranks(suite, request.param, timeout=110)


def results(ranks: list[dict], name: str) -> list[dict]:
    for rank, r in enumerate(ranks):
        assert "error" not in r[name], f"rank {rank}:\n{r[name]['error']}"
    return [r[name] for r in ranks]


@pytest.mark.parametrize("name", ["mlp", "tied", "unused", "accumulation", "manual", "lbfgs"])
def test_n_ranks_with_batch_b_train_like_one_process_with_batch_n_times_b(ranks, name):
    got = results(ranks, name)
    assert got[0]["vs_single_grads"] <= TOL, "gradients after the first step differ"
    assert got[0]["vs_single_weights"] <= TOL, f"weights after {STEPS} steps differ"
    for r in got[1:]:
        assert diff(r["weights"], got[0]["weights"]) == 0.0  # every rank holds the same model


def test_batchnorm_buffers_are_rank_zeros_on_every_rank(ranks):
    got = results(ranks, "batchnorm")
    for r in got[1:]:
        assert diff(r["weights"], got[0]["weights"]) == 0.0  # running stats included


def test_accumulation_communicates_only_on_the_last_micro_batch(ranks):
    comms = results(ranks, "accumulation")[0]["comms"]
    assert len(comms) == 2 * STEPS
    for i, counts in enumerate(comms):
        if i % 2 == 0:
            assert sum(counts.values()) == 0, f"micro-batch {i} communicated: {counts}"
        else:
            assert counts["all_reduce"] >= 1, f"window end {i} did not reduce: {counts}"


def test_epoch_metrics_are_identical_on_every_rank_and_equal_one_process(ranks):
    got = results(ranks, "mlp")
    for r in got:
        assert r["metrics"] == got[0]["metrics"]
    # 21 validation samples do not split evenly: no padding, so the mean is the exact one.
    assert got[0]["metrics"]["val_loss"] == pytest.approx(got[0]["single_metrics"]["val_loss"], rel=1e-5)


def test_reduce_all_gather_broadcast_for_user_code(ranks):
    got = results(ranks, "collectives")
    world = len(ranks)
    for r in got:
        assert r["sum"] == sum(range(1, world + 1)) and r["max"] == world
        assert r["mean"] == pytest.approx(sum(range(1, world + 1)) / world)
        assert r["gather"] == [float(i + 1) for i in range(world)]
        assert r["broadcast"] == {"from": world - 1}
        assert r["any"] is True and r["all"] is False and r["input_untouched"]


def test_local_ranks_split_the_cpu_cores_unless_the_user_chose(monkeypatch):
    # Two CPU ranks each running every core oversubscribe the machine (OpenMP threads spin);
    # each rank gets cores // local ranks intra-op threads, restored at teardown.
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    strategy = DDPStrategy(devices=[torch.device("cpu")] * 2)
    try:
        strategy._share_cpu_threads(local_world_size=2)
        assert torch.get_num_threads() == max(1, cores // 2)
    finally:
        strategy.teardown()
    assert torch.get_num_threads() == before

    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    strategy._share_cpu_threads(local_world_size=2)
    assert torch.get_num_threads() == before  # the user's choice wins


class OneWeight(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(1, 1, bias=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.w(x), y)

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=5, tolerance_change=1e-3)


def lbfgs_with_a_rank_whose_loss_never_changes(rank: int, world: int) -> list[float]:
    join_as_rank(rank, world)
    # Rank 0's shard (even positions) has x = 0, y = 0: its own loss is 0 whatever the weight, so on its
    # own LBFGS would stop after one iteration while rank 1 goes on, and the ranks would call the
    # closure (and the gradient all-reduce) a different number of times.
    x = torch.tensor([[0.0], [1.0]] * 4)
    y = torch.tensor([[0.0], [5.0]] * 4)
    module = OneWeight()
    torch.nn.init.zeros_(module.w.weight)
    ember.Trainer(
        strategy="ddp", devices=world, max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    ).fit(module, DataLoader(TensorDataset(x, y), batch_size=4))
    return module.w.weight.detach().flatten().tolist()


def test_lbfgs_ranks_decide_from_the_same_loss():
    weights = run_ranks(lbfgs_with_a_rank_whose_loss_never_changes, 2, timeout=40)
    assert weights[0] == weights[1] and weights[0][0] > 0.5  # trained together, towards y = 5x on rank 1's half


def _cuda_rank(local_rank: int, devices: list[int], **kwargs) -> DDPStrategy:
    # Only device objects: nothing here touches CUDA, so it runs on any machine.
    strategy = DDPStrategy(accelerator="cuda", devices=[torch.device("cuda", i) for i in devices], **kwargs)
    strategy._world = World(
        rank=local_rank,
        world_size=2,
        local_rank=local_rank,
        local_world_size=2,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=1,
        source="torchrun",
    )
    return strategy


def test_each_local_rank_takes_its_own_listed_device():
    assert _cuda_rank(0, [1, 3]).root_device == torch.device("cuda", 1)
    assert _cuda_rank(1, [1, 3]).root_device == torch.device("cuda", 3)


def test_a_local_rank_beyond_the_listed_devices_is_an_error_not_a_shared_gpu():
    strategy = _cuda_rank(1, [1])
    with pytest.raises(
        ValueError,
        match=r"local rank 1 of a ddp job with 2 process\(es\) per machine, but "
        r"devices=\[1\] lists only 1 CUDA device.*devices=2",
    ):
        _ = strategy.root_device


def test_nccl_is_bound_to_the_rank_device_and_gloo_to_none():
    assert _cuda_rank(1, [1, 3])._nccl_device == torch.device("cuda", 3)
    assert _cuda_rank(1, [1, 3], process_group_backend="gloo")._nccl_device is None
    assert DDPStrategy(accelerator="cpu", devices=[torch.device("cpu")] * 2)._nccl_device is None


_ONE_PROCESS_FIT = """
import os, torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import ember

class Net(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
ember.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=2, enable_progress_bar=False).fit(
    Net(), DataLoader(data, batch_size=2)
)
print([open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")])
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc (Linux)")
def test_a_one_process_fit_frees_its_group_and_the_groups_threads(tmp_path):
    # In a fresh process: the group's gloo threads are joined when the fit releases its private group,
    # even though the first optimizer imports torch._dynamo (and with it torch.distributed.fsdp) after
    # the group exists (see ember.strategies.launchers.launcher.import_before_the_group).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.path.join(root, "src"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _ONE_PROCESS_FIT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    assert out.returncode == 0, out.stderr
    threads = out.stdout.strip().splitlines()[-1]
    assert "gloo" not in threads, threads
