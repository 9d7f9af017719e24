"""``ddp`` over loaders without a length whose ranks yield different numbers of batches.

Each rank feeds itself from an ``IterableDataset`` (rank ``r`` yields ``counts[r]`` samples). Before
the fix, a rank that ran out went on to the epoch's end while the other waited in the gradient
all-reduce, and the job hung. Now the ranks agree before each step that every rank still has a
batch, stop the epoch together, and rank zero warns with each rank's count. Sized loaders must not
pay for this: their per-step collectives are counted.

One spawn of two gloo ranks runs every scenario; each returns numbers the tests assert on.
"""

from __future__ import annotations

import glob
import os
import traceback
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ember
from tests.helpers.dist import count_collectives, join_as_rank, run_ranks

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]

B, LR = 2, 0.1
UNEVEN = "yielded a different number of batches"


def samples(rank: int, n: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s stream: ``n`` samples ``(x, y)`` with ``y`` a fixed linear function of ``x``."""
    g = torch.Generator().manual_seed(100 * rank + offset)
    x = torch.randn(n, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)


class Stream(IterableDataset):
    """Yields ``counts[rank]`` samples on each rank (the rank read from torch.distributed)."""

    def __init__(self, counts: list[int], offset: int = 0) -> None:
        self.counts, self.offset = counts, offset

    def __iter__(self):
        rank = dist.get_rank()
        x, y = samples(rank, self.counts[rank], self.offset)
        return iter(zip(x, y))


class Net(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class PerStepCollectives(ember.callbacks.Callback):
    """Snapshots a ``count_collectives`` counter at every batch start: differences are per-step counts."""

    def __init__(self, counts: Counter) -> None:
        self.counts, self.snapshots = counts, []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.snapshots.append(Counter(self.counts))

    def per_step(self) -> list[dict]:
        return [dict(b - a) for a, b in zip(self.snapshots, self.snapshots[1:])]


def quiet_trainer(**kwargs) -> ember.Trainer:
    kwargs.setdefault("max_epochs", 1)
    return ember.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def fit(trainer: ember.Trainer, train, val=None) -> dict:
    module = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train, val)
    return {
        "weights": [p.detach().clone() for p in module.parameters()],
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "warnings": [str(w.message) for w in caught],
    }


def reference_weights(counts: list[int], epochs: int, k: int = 1, limit: int | None = None) -> list[torch.Tensor]:
    """One process training on both ranks' batches side by side, for as many batches as the shortest
    rank has, averaging each accumulation window of ``k`` batches (a short last window too)."""
    steps = min(counts) // B if limit is None else min(min(counts) // B, limit)
    streams = [samples(r, n) for r, n in enumerate(counts)]
    module = Net()
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    for _ in range(epochs):
        for start in range(0, steps, k):
            window = range(start, min(start + k, steps))
            opt.zero_grad()
            for i in window:
                x = torch.cat([x[i * B : (i + 1) * B] for x, _ in streams])
                y = torch.cat([y[i * B : (i + 1) * B] for _, y in streams])
                (F.mse_loss(module(x), y) / len(window)).backward()
            opt.step()
    return [p.detach().clone() for p in module.parameters()]


def diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ---------------------------------------------------------------------- scenarios (run on every rank)
def uneven_default_config(rank: int, root: str) -> dict:
    # 64 and 40 samples: 32 and 20 batches. Logger, checkpointing and progress bar as by default.
    trainer = ember.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=2, default_root_dir=root)
    out = fit(trainer, DataLoader(Stream([64, 40]), batch_size=B), DataLoader(Stream([10, 6], offset=1), batch_size=B))
    out["checkpoints"] = sorted(
        os.path.basename(p) for p in glob.glob(os.path.join(root, "**", "*.ckpt"), recursive=True)
    )
    if rank == 0:
        out["vs_reference"] = diff(out["weights"], reference_weights([64, 40], epochs=2))
        x, y = (torch.cat(t) for t in zip(samples(0, 10, 1), samples(1, 6, 1)))
        with torch.no_grad():
            module = Net()
            for p, w in zip(module.parameters(), out["weights"]):
                p.copy_(w)
            out["val_reference"] = F.mse_loss(module(x), y).item()
    return out


def even_stream(rank: int) -> dict:
    return fit(quiet_trainer(max_epochs=2), DataLoader(Stream([32, 32]), batch_size=B))


def accumulation(rank: int) -> dict:
    # 20 batches in windows of 3: six full windows and a last one of 2 batches, on both ranks together.
    out = fit(quiet_trainer(accumulate_grad_batches=3), DataLoader(Stream([64, 40]), batch_size=B))
    if rank == 0:
        out["vs_reference"] = diff(out["weights"], reference_weights([64, 40], epochs=1, k=3))
    return out


def limited(rank: int, limit: int) -> dict:
    out = fit(quiet_trainer(limit_train_batches=limit), DataLoader(Stream([64, 40]), batch_size=B))
    if rank == 0:
        out["vs_reference"] = diff(out["weights"], reference_weights([64, 40], epochs=1, limit=limit))
    return out


def collectives_per_step(rank: int, sized: bool) -> list[dict]:
    if sized:  # 20 batches on each rank through ember's sharded sampler
        x, y = samples(0, 80)
        loader = DataLoader(TensorDataset(x, y), batch_size=B)
    else:
        loader = DataLoader(Stream([40, 40]), batch_size=B)
    with count_collectives() as counts:
        recorder = PerStepCollectives(counts)
        trainer = quiet_trainer(callbacks=[recorder])
        trainer.preemption_signals = ()  # no periodic preemption agreement: only what each step needs
        trainer.fit(Net(), loader)
    return recorder.per_step()


def evaluation(rank: int) -> dict:
    # 5 and 3 batches: rank 1 adds two padding batches; the epoch metric is the mean over all 16 samples.
    module = Net()
    loader = DataLoader(Stream([10, 6], offset=2), batch_size=B)
    out = {
        "validate": quiet_trainer().validate(module, loader)[0]["val_loss"],
        "test": quiet_trainer().test(module, loader)[0]["test_loss"],
        "predict": len(quiet_trainer().predict(module, loader)),
    }
    x, y = (torch.cat(t) for t in zip(samples(0, 10, 2), samples(1, 6, 2)))
    with torch.no_grad():
        out["reference"] = F.mse_loss(module(x), y).item()
    return out


def error_of(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def empty_rank(rank: int) -> dict:
    return {
        "fit": error_of(lambda: quiet_trainer().fit(Net(), DataLoader(Stream([8, 0]), batch_size=B))),
        "validate": error_of(lambda: quiet_trainer().validate(Net(), DataLoader(Stream([8, 0]), batch_size=B))),
    }


SCENARIOS = {
    "uneven": lambda rank, root: uneven_default_config(rank, root),
    "even": lambda rank, root: even_stream(rank),
    "accumulation": lambda rank, root: accumulation(rank),
    "limit_below": lambda rank, root: limited(rank, 15),
    "limit_above": lambda rank, root: limited(rank, 25),
    "sized_comms": lambda rank, root: collectives_per_step(rank, sized=True),
    "unsized_comms": lambda rank, root: collectives_per_step(rank, sized=False),
    "evaluation": lambda rank, root: evaluation(rank),
    "empty_rank": lambda rank, root: empty_rank(rank),
}


def suite(rank: int, world: int, root: str) -> dict:
    join_as_rank(rank, world)
    out = {}
    for name, scenario in SCENARIOS.items():
        try:
            out[name] = scenario(rank, root)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
            break  # a failed collective leaves the ranks out of step: stop rather than hang
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(suite, 2, str(tmp_path_factory.mktemp("uneven")), timeout=130)


def results(ranks: list[dict], name: str) -> list:
    for rank, r in enumerate(ranks):
        assert name in r, f"rank {rank} stopped before {name!r}: {[v for v in r.values() if 'error' in v]}"
        assert not (isinstance(r[name], dict) and "error" in r[name]), f"rank {rank}:\n{r[name]['error']}"
    return [r[name] for r in ranks]


def uneven_warnings(result: dict) -> list[str]:
    return [w for w in result["warnings"] if UNEVEN in w]


# ---------------------------------------------------------------------- tests
def test_uneven_stream_stops_every_rank_together_with_the_default_configuration(ranks):
    r0, r1 = results(ranks, "uneven")
    # Two epochs of 20 steps (the shorter rank's count) on both ranks, the same weights on both.
    assert r0["global_step"] == r1["global_step"] == 40 and r0["epochs"] == r1["epochs"] == 2
    assert diff(r0["weights"], r1["weights"]) == 0.0
    # Each step averaged both ranks' batches; the longer rank's extra batches were never used.
    assert r0["vs_reference"] <= 1e-6
    assert "last.ckpt" in r0["checkpoints"]  # rank zero writes them


def test_rank_zero_warns_once_with_each_ranks_batch_count(ranks):
    r0, r1 = results(ranks, "uneven")
    (message,) = uneven_warnings(r0)  # once per fit, though both epochs were uneven
    assert "rank 0: 32, rank 1: 20" in message and "ended after 20 batches on every rank" in message
    assert "IterableDataset" in message
    assert uneven_warnings(r1) == []


def test_uneven_validation_stream_gives_the_exact_metric_over_every_rank(ranks):
    r0, r1 = results(ranks, "uneven")
    # 5 and 3 validation batches (and 2 padding batches that count for nothing), reduced once, weighted by samples.
    assert r0["metrics"]["val_loss"] == r1["metrics"]["val_loss"]
    assert r0["metrics"]["val_loss"] == pytest.approx(r0["val_reference"], rel=1e-5)


def test_even_stream_under_ddp_does_not_warn(ranks):
    for r in results(ranks, "even"):
        assert r["global_step"] == 32
        assert uneven_warnings(r) == []
        # The only warnings: ember cannot shard an IterableDataset (the test shards it by rank), and, on rank
        # zero, Lightning's notice that Net's validation_step has no validation data in this fit.
        assert all(
            "cannot be sharded" in w or "defines validation_step, but this fit has no validation data" in w
            for w in r["warnings"]
        ), r["warnings"]


def test_accumulation_windows_close_together_including_the_short_last_one(ranks):
    r0, r1 = results(ranks, "accumulation")
    assert r0["global_step"] == r1["global_step"] == 7  # 6 windows of 3 batches and one of 2
    assert diff(r0["weights"], r1["weights"]) == 0.0
    assert r0["vs_reference"] <= 1e-6


def test_limit_train_batches_below_the_shortest_rank_is_not_uneven(ranks):
    r0, r1 = results(ranks, "limit_below")
    assert r0["global_step"] == r1["global_step"] == 15
    assert uneven_warnings(r0) == uneven_warnings(r1) == []
    assert r0["vs_reference"] <= 1e-6


def test_limit_train_batches_above_the_shortest_rank_counts_within_the_limit(ranks):
    r0, r1 = results(ranks, "limit_above")
    assert r0["global_step"] == r1["global_step"] == 20
    (message,) = uneven_warnings(r0)
    assert "rank 0: 25, rank 1: 20" in message
    assert r0["vs_reference"] <= 1e-6


def all_reduces(steps: list[dict]) -> list[int]:
    return [s.get("all_reduce", 0) for s in steps]


def others(steps: list[dict]) -> list[dict]:
    return [{k: v for k, v in s.items() if k != "all_reduce"} for s in steps]


def test_sized_loader_steps_issue_only_the_gradient_all_reduce(ranks):
    for sized, unsized in zip(results(ranks, "sized_comms"), results(ranks, "unsized_comms")):
        assert len(sized) == len(unsized) == 19
        assert all_reduces(sized) == [1] * 19  # one gradient bucket per step, nothing more
        # The engine's own (a one-off bucket rebuild broadcast after the first step) does not depend on the loader.
        assert others(sized) == others(unsized)


def test_unsized_loader_steps_add_exactly_one_small_all_reduce(ranks):
    for steps in results(ranks, "unsized_comms"):
        assert all_reduces(steps) == [2] * 19  # the gradient bucket and the "every rank has a batch" count


def test_evaluation_over_uneven_streams_reduces_over_every_sample(ranks):
    r0, r1 = results(ranks, "evaluation")
    for stage in ("validate", "test"):
        assert r0[stage] == r1[stage] == pytest.approx(r0["reference"], rel=1e-5)
    assert (r0["predict"], r1["predict"]) == (5, 3)  # each rank predicts its own batches


def test_a_rank_without_any_batch_raises_on_every_rank_instead_of_hanging(ranks):
    for r in results(ranks, "empty_rank"):
        assert "no batch on some ranks" in r["fit"] and "rank 0: 4, rank 1: 0" in r["fit"]
        assert "validation dataloader yielded no batch on some ranks" in r["validate"]
        assert "rank 0: 4, rank 1: 0" in r["validate"]
