"""ember's DistributedDataParallel against PyTorch's on real gloo ranks (2 and 3 processes).

Spawning costs seconds, so each world size runs once (a module-scoped fixture) and every rank
returns a dict of measurements; the tests below assert on them. Each check compares ember with
``torch.nn.parallel.DistributedDataParallel`` on identical models and data, and where it applies
with one process on the concatenated global batch.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ember.parallel.distributed import DistributedDataParallel as EmberDDP
from tests.helpers.dist import count_collectives, run_ranks

B, STEPS, TOL = 4, 20, 1e-5
SMALL_BUCKETS = 0.002  # MiB: several buckets even for these tiny models
pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]


# ------------------------------------------------------------------------------ models
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.mid, self.dec = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.dec.weight = self.enc.weight

    def forward(self, x):
        return self.dec(torch.tanh(self.mid(torch.tanh(self.enc(x)))))[:, :3]


def wide() -> nn.Module:
    """A 256x256 layer: large enough for the reducer's copy-in path (LARGE_NUMEL)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 3))


def batchnorm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


class Unused(nn.Module):
    """``spare`` is never used; ``sometimes`` only on rank 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.spare, self.sometimes = nn.Linear(6, 3), nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x):
        out = self.body(x)
        return out + self.sometimes(x) if dist.get_rank() == 0 else out


class Steps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def training_step(self, x, y):
        return F.mse_loss(self.net(x), y)


# ------------------------------------------------------------------------------ helpers
def data(world: int, steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(steps, world * B, 6, generator=g), torch.randn(steps, world * B, 3, generator=g)


def train(
    model: nn.Module,
    wrap: Callable | None,
    rank: int,
    world: int,
    steps: int = STEPS,
    micro: int = 1,
    set_to_none: bool = True,
) -> dict:
    """SGD on this rank's shard (or the whole batch when ``wrap`` is None)."""
    xs, ys = data(world, steps)
    net = wrap(model) if wrap else model
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out: dict = {"counts": []}
    for s in range(steps):
        lo, hi = (rank * B, (rank + 1) * B) if wrap else (0, world * B)
        opt.zero_grad(set_to_none=set_to_none)
        with count_collectives() as counts:
            F.mse_loss(net(xs[s, lo:hi]), ys[s, lo:hi]).backward()
        out["counts"].append(counts["all_reduce"] + counts["broadcast"])
        if s == 0:
            out["grads"] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.step()
    out["weights"] = [t.detach().clone() for t in model.state_dict().values()]
    return out


def diff(a: list, b: list) -> float:
    if any((x is None) != (y is None) for x, y in zip(a, b)):
        return float("inf")
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b) if x is not None)


def compare(
    model_fn: Callable[[], nn.Module], rank: int, world: int, single: bool = True, set_to_none: bool = True, **kwargs
) -> dict:
    ours = train(model_fn(), lambda m: EmberDDP(m, **kwargs), rank, world, set_to_none=set_to_none)
    theirs = train(model_fn(), lambda m: TorchDDP(m, **kwargs), rank, world, set_to_none=set_to_none)
    out = {
        "grads": diff(ours["grads"], theirs["grads"]),
        "weights": diff(ours["weights"], theirs["weights"]),
        "counts": ours["counts"][:3],
    }
    if single:
        alone = train(model_fn(), None, rank, world, set_to_none=set_to_none)
        out["single"] = max(diff(ours["grads"], alone["grads"]), diff(ours["weights"], alone["weights"]))
    return out


# ------------------------------------------------------------------------------ checks
def check_unused_error(rank: int, world: int) -> dict:
    ddp = EmberDDP(Unused())
    try:
        ddp(torch.randn(B, 6)).sum().backward()
        message = ""
    except RuntimeError as exc:
        message = str(exc)
    alive = torch.ones(1)
    dist.all_reduce(alive)  # the group is still usable: nothing was left in flight
    return {"message": message, "alive": alive.item()}


def check_no_sync(rank: int, world: int) -> dict:
    xs, ys = data(world)
    results, inside = [], []
    for cls in (EmberDDP, TorchDDP):
        model = mlp()
        ddp = cls(model, bucket_cap_mb=SMALL_BUCKETS)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for s in range(0, 12, 3):
            with count_collectives() as counts, ddp.no_sync():
                for m in range(2):
                    x, y = xs[s + m, rank * B : (rank + 1) * B], ys[s + m, rank * B : (rank + 1) * B]
                    F.mse_loss(ddp(x), y).backward()
            inside.append(sum(counts.values()))
            x, y = xs[s + 2, rank * B : (rank + 1) * B], ys[s + 2, rank * B : (rank + 1) * B]
            F.mse_loss(ddp(x), y).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        results.append((grads, list(model.parameters())))
    return {
        "grads": diff(results[0][0], results[1][0]),
        "weights": diff(results[0][1], results[1][1]),
        "collectives_inside": inside[:4],
    }


def check_hooks(rank: int, world: int) -> dict:
    def bf16_torch(state, bucket):  # torch's own hook, run through ember's GradBucket
        return default_hooks.bf16_compress_hook(state, bucket)

    def first_grads(**kwargs) -> list:
        return train(mlp(), lambda m: EmberDDP(m, bucket_cap_mb=SMALL_BUCKETS, **kwargs), rank, world, steps=1)["grads"]

    exact = first_grads()
    scale = max(g.abs().max().item() for g in exact)
    out = {
        name: diff(first_grads(comm_hook=hook), exact) / scale for name, hook in (("bf16", "bf16"), ("fp16", "fp16"))
    }
    out["torch_bf16_hook"] = (
        diff(first_grads(comm_hook=lambda b: bf16_torch(None, b)), first_grads(comm_hook="bf16")) / scale
    )
    out["allreduce_hook"] = diff(first_grads(comm_hook=lambda b: default_hooks.allreduce_hook(None, b)), exact)
    return out


def check_call(rank: int, world: int) -> dict:
    xs, ys = data(world, 1)
    x, y = xs[0, rank * B : (rank + 1) * B], ys[0, rank * B : (rank + 1) * B]
    module = Steps()
    reference = TorchDDP(copy.deepcopy(module.net))
    ddp = EmberDDP(module)  # kept alive: a dropped wrapper's hooks go quiet, as with torch
    ddp.call("training_step", x, y).backward()
    F.mse_loss(reference(x), y).backward()
    return {"grads": diff([p.grad for p in module.parameters()], [p.grad for p in reference.parameters()])}


def check_rebuild_agreement(rank: int, world: int) -> dict:
    class RankOrder(nn.Module):  # the layers run in a different order on each rank
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(world))

        def forward(self, x):
            for i in range(world):
                x = torch.tanh(self.layers[(i + rank) % world](x))
            return x

    ddp = EmberDDP(RankOrder(), bucket_cap_mb=72 * 4 / 2**20)
    for _ in range(2):
        ddp(torch.randn(B, 8)).sum().backward()
    return {"buckets": ddp.reducer.bucket_indices}


def check_join(rank: int, world: int) -> dict:
    counts = [5, 8, 6][:world]
    xs, ys = data(world, max(counts))
    out = {}
    for divide in (True, False):
        weights = []
        for cls in (EmberDDP, TorchDDP):
            model = mlp()
            ddp = cls(model, bucket_cap_mb=SMALL_BUCKETS)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            with ddp.join(divide_by_initial_world_size=divide):
                for s in range(counts[rank]):
                    opt.zero_grad()
                    x, y = xs[s, rank * B : (rank + 1) * B], ys[s, rank * B : (rank + 1) * B]
                    F.mse_loss(ddp(x), y).backward()
                    opt.step()
            weights.append([p.detach().clone() for p in model.parameters()])
        out[f"weights_divide_{divide}"] = diff(*weights)
        out.setdefault("final", weights[0])
    return out


CHECKS = {
    "mlp": lambda r, w: compare(mlp, r, w, bucket_cap_mb=SMALL_BUCKETS),
    "tied": lambda r, w: compare(Tied, r, w, bucket_cap_mb=SMALL_BUCKETS),
    "batchnorm": lambda r, w: compare(batchnorm, r, w, single=False),
    "unused": lambda r, w: compare(Unused, r, w, single=False, find_unused_parameters=True),
    "static_graph": lambda r, w: compare(Unused, r, w, single=False, static_graph=True),
    "bucket_view": lambda r, w: compare(mlp, r, w, gradient_as_bucket_view=True, bucket_cap_mb=SMALL_BUCKETS),
    # Large gradients are copied in by their hooks when dropped, divided in place when kept.
    "large": lambda r, w: compare(wide, r, w, bucket_cap_mb=SMALL_BUCKETS),
    "large_kept": lambda r, w: compare(wide, r, w, set_to_none=False, bucket_cap_mb=SMALL_BUCKETS),
    "unused_error": check_unused_error,
    "no_sync": check_no_sync,
    "hooks": check_hooks,
    "call": check_call,
    "rebuild": check_rebuild_agreement,
    "join": check_join,
}


def suite(rank: int, world: int) -> dict:
    out = {}
    for name, check in CHECKS.items():
        try:
            out[name] = check(rank, world)
        except Exception:  # recorded per check so one failure does not hide the others
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request) -> list[dict]:
    return run_ranks(suite, request.param, timeout=80)


def results(ranks: list[dict], name: str) -> list[dict]:
    for rank, r in enumerate(ranks):
        assert "error" not in r[name], f"rank {rank}:\n{r[name]['error']}"
    return [r[name] for r in ranks]


@pytest.mark.parametrize(
    "name", ["mlp", "tied", "batchnorm", "unused", "static_graph", "bucket_view", "large", "large_kept"]
)
def test_matches_torch_ddp_after_one_step_and_twenty(ranks, name):
    for r in results(ranks, name):
        assert r["grads"] <= TOL and r["weights"] <= TOL, r
        assert r.get("single", 0) <= TOL, "differs from one process on the global batch"


def test_collectives_per_step_are_the_buckets_plus_one_rebuild(ranks):
    for r in results(ranks, "mlp"):
        first, second, third = r["counts"]
        assert second == first + 1 and third == first > 1, r["counts"]


def test_missing_gradient_is_a_clear_error_not_a_hang(ranks):
    for r in results(ranks, "unused_error"):
        assert "spare.weight" in r["message"] and "find_unused_parameters=True" in r["message"]
        assert r["alive"] == len(ranks)


def test_no_sync_is_silent_and_matches_torch(ranks):
    for r in results(ranks, "no_sync"):
        assert r["collectives_inside"] == [0, 0, 0, 0]
        assert r["grads"] <= TOL and r["weights"] <= TOL, r


def test_compression_hooks_stay_close_to_fp32(ranks):
    for r in results(ranks, "hooks"):
        # Relative to the largest gradient: bf16 keeps 8 significant bits, fp16 11.
        assert r["bf16"] <= 1e-2 and r["fp16"] <= 2e-3, r
        assert r["torch_bf16_hook"] <= 1e-2 and r["allreduce_hook"] <= TOL, r


def test_call_runs_training_step_with_the_same_gradients(ranks):
    for r in results(ranks, "call"):
        assert r["grads"] <= TOL


def test_ranks_agree_on_rebuilt_buckets(ranks):
    buckets = [r["buckets"] for r in results(ranks, "rebuild")]
    assert all(b == buckets[0] for b in buckets) and len(buckets[0]) > 1


def test_join_with_uneven_inputs_matches_torch(ranks):
    joined = results(ranks, "join")
    for r in joined:
        assert r["weights_divide_True"] <= TOL and r["weights_divide_False"] <= TOL, r
    assert diff(joined[0]["final"], joined[-1]["final"]) == 0.0  # every rank ends in sync
