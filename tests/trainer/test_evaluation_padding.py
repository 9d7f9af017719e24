"""``ddp`` evaluation over shards with different batch counts, with per-step collectives in the step.

33 samples, batch 4, 2 ranks: rank 0's shard has 17 samples (5 batches), rank 1's 16 (4 batches).
Before the fix each rank ran its own number of batches, so ``self.log(..., on_step=True,
sync_dist=True)`` or ``trainer.strategy.all_gather`` in ``validation_step`` met a collective that the other rank
never joined (or met the epoch-end reduction instead) and the job hung. Now the shorter rank runs a
padding batch, so every rank runs the same steps; the padding batch counts toward no epoch value,
so epoch values still equal the single-process ones over the 33 samples exactly.

One spawn of two gloo ranks runs every scenario; each returns numbers the tests assert on.
"""

from __future__ import annotations

import glob
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ember
from tests.helpers.dist import join_as_rank, run_ranks
from tests.helpers.models import RecordingLogger

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]

N, B = 33, 4


def data(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y, torch.arange(n))


class Net(ember.TrainModule):
    """Logs a per-step synced loss and all-gathers in every evaluation step; records what it ran."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.ran: list[list[int]] = []  # indices of every evaluation batch this rank's step saw
        self.gathered: list[list[int]] = []  # what all_gather returned, per step
        self.batch_ends = 0

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return F.mse_loss(self(x), y)

    def _evaluate(self, batch, batch_idx, prefix):
        x, y, idx = batch
        loss = F.mse_loss(self(x), y)
        self.log(f"{prefix}_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log(f"{prefix}_own", loss, on_step=True, on_epoch=False)  # this rank's own step value
        self.log(f"{prefix}_count", float(len(idx)), reduce_fx="sum")
        # 1 only for a batch that holds sample 0 on rank 1 (whose shard has only odd samples): a padding batch.
        self.log(f"{prefix}_padding_seen", float(self.global_rank == 1 and bool((idx == 0).any())), reduce_fx="max")
        if batch_idx == 4:  # rank 0's last real batch (sample 32), rank 1's padding batch (sample 0)
            for fx in ("mean", "sum", "max", "min"):
                self.log(f"{prefix}_fifth_{fx}", idx[0].float(), reduce_fx=fx)
        self.ran.append(idx.tolist())
        self.gathered.append(self.trainer.strategy.all_gather(idx).flatten().tolist())

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, batch_idx, "test")

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.batch_ends += 1

    def predict_step(self, batch, batch_idx):
        return batch[2]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def reference_loss(module: Net, n: int = N) -> float:
    x, y, _ = data(n).tensors
    with torch.no_grad():
        return F.mse_loss(module(x), y).item()


def quiet_trainer(**kwargs) -> ember.Trainer:
    return ember.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **kwargs,
    )


def floats(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------- scenarios (run on every rank)
def fit_default(rank: int, root: str) -> dict:
    # Logger, checkpointing (monitoring the epoch value) and the sanity check as by default.
    module = Net()
    checkpoint = ember.callbacks.ModelCheckpoint(monitor="val_loss", save_last=True)
    trainer = ember.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_epochs=2,
        limit_train_batches=3,
        default_root_dir=root,
        callbacks=[checkpoint],
        enable_progress_bar=False,
    )
    trainer.fit(module, DataLoader(data(), batch_size=B), DataLoader(data(), batch_size=B))
    return {
        "metrics": floats(trainer.callback_metrics),
        "reference": reference_loss(module),
        "steps": len(module.ran),
        "batch_ends": module.batch_ends,
        "checkpoints": sorted(os.path.basename(p) for p in glob.glob(f"{root}/**/*.ckpt", recursive=True)),
    }


def validate(rank: int, drop_last: bool = False, n: int = N) -> dict:
    module = Net()
    (result,) = quiet_trainer().validate(module, DataLoader(data(n), batch_size=B, drop_last=drop_last))
    return {
        "result": result,
        "reference": reference_loss(module, n),
        "ran": module.ran,
        "gathered": module.gathered,
        "batch_ends": module.batch_ends,
    }


def run_test(rank: int) -> dict:
    module = Net()
    (result,) = quiet_trainer().test(module, DataLoader(data(), batch_size=B))
    return {"result": result, "reference": reference_loss(module), "ran": module.ran}


class Stream(IterableDataset):
    """Rank ``r`` feeds itself ``counts[r]`` samples of ``data()`` (its own, disjoint), as a user shards a stream."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def __iter__(self):
        rank = dist.get_rank()
        start = sum(self.counts[:rank])
        return iter(data()[i] for i in range(start, start + self.counts[rank]))


def stream(rank: int) -> dict:
    # Batches of 4: rank 0 has 5 (20 samples), rank 1 has 3 (12 samples), so rank 1 runs two padding batches.
    module = Net()
    loader = DataLoader(Stream([20, 12]), batch_size=B)
    (result,) = quiet_trainer().validate(module, loader)
    x, y, _ = data().tensors
    with torch.no_grad():
        reference = F.mse_loss(module(x[:32]), y[:32]).item()
    return {
        "result": result,
        "reference": reference,
        "ran": module.ran,
        "gathered": module.gathered,
        "empty": error_of(lambda: quiet_trainer().validate(Net(), DataLoader(Stream([8, 0]), batch_size=B))),
    }


def stream_rank0_short(rank: int) -> dict:
    # Rank 0 (which writes the logs) has 3 batches, rank 1 has 5: rank 0 runs two padding batches.
    logger = RecordingLogger()
    trainer = ember.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.validate(Net(), DataLoader(Stream([12, 20]), batch_size=B))
    return {"own": len(logger.steps_with("val_own")), "synced": len(logger.steps_with("val_loss_step"))}


def error_of(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def predict(rank: int) -> dict:
    predictions = quiet_trainer().predict(Net(), DataLoader(data(), batch_size=B))
    return {"predictions": [p.tolist() for p in predictions]}


SCENARIOS = {
    "fit": fit_default,
    "validate": lambda rank, root: validate(rank),
    "drop_last": lambda rank, root: validate(rank, drop_last=True, n=31),
    "test": lambda rank, root: run_test(rank),
    "predict": lambda rank, root: predict(rank),
    "stream": lambda rank, root: stream(rank),
    "stream_rank0_short": lambda rank, root: stream_rank0_short(rank),
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
    return run_ranks(suite, 2, str(tmp_path_factory.mktemp("padding")), timeout=130)


def results(ranks: list[dict], name: str) -> list:
    for rank, r in enumerate(ranks):
        assert name in r, f"rank {rank} stopped before {name!r}: {[v for v in r.values() if 'error' in v]}"
        assert "error" not in r[name], f"rank {rank}:\n{r[name]['error']}"
    return [r[name] for r in ranks]


# ---------------------------------------------------------------------- tests
def test_fit_with_per_step_synced_validation_values_finishes_with_exact_epoch_values(ranks):
    r0, r1 = results(ranks, "fit")
    # Sanity check (2 steps) and two validations of 5 steps on both ranks: rank 1's fifth is its padding batch.
    assert r0["steps"] == r1["steps"] == 2 + 5 + 5
    assert r0["batch_ends"] == r1["batch_ends"] == 2 + 5 + 5
    for r in (r0, r1):
        assert r["metrics"]["val_loss"] == pytest.approx(r0["reference"], rel=1e-6)
        assert r["metrics"]["val_count"] == N  # the padding batch's sample is not counted
        assert r["metrics"]["val_padding_seen"] == 0.0
    assert r0["metrics"] == r1["metrics"]
    assert "last.ckpt" in r0["checkpoints"]


def test_validate_pads_the_shorter_rank_with_a_batch_shaped_like_the_longer_ranks_last(ranks):
    r0, r1 = results(ranks, "validate")
    assert [len(b) for b in r0["ran"]] == [4, 4, 4, 4, 1]
    assert [len(b) for b in r1["ran"]] == [4, 4, 4, 4, 1]
    real = sorted(i for b in r0["ran"] + r1["ran"][:4] for i in b)
    assert real == list(range(N))  # every sample once, outside the padding batch
    assert r1["ran"][4] == [0]  # the padding batch repeats the order's first sample
    # all_gather met its partner on every step, the padding step included.
    assert r0["gathered"] == r1["gathered"] and len(r0["gathered"]) == 5
    assert r0["gathered"][4] == [32, 0]
    for r in (r0, r1):
        assert r["result"]["val_loss_epoch"] == pytest.approx(r0["reference"], rel=1e-6)
        assert r["result"]["val_count"] == N and r["result"]["val_padding_seen"] == 0.0
        assert r["batch_ends"] == 5
        # A key rank 1 logs only in its padding batch: reduced over rank 0's real value alone.
        assert [r["result"][f"val_fifth_{fx}"] for fx in ("mean", "sum", "max", "min")] == [32.0] * 4


def test_drop_last_pads_with_the_batch_it_would_have_dropped_and_counts_only_full_batches(ranks):
    r0, r1 = results(ranks, "drop_last")
    # 31 samples: shards of 16 and 15; with drop_last rank 0 has 4 batches and rank 1 three.
    assert [len(b) for b in r0["ran"]] == [4, 4, 4, 4] == [len(b) for b in r1["ran"]]
    for r in (r0, r1):
        assert r["result"]["val_count"] == 7 * B  # the 7 full real batches; rank 1's fourth is padding
        assert r["result"]["val_padding_seen"] == 0.0


def test_test_stage_pads_too_and_keeps_the_exact_epoch_value(ranks):
    r0, r1 = results(ranks, "test")
    assert len(r0["ran"]) == len(r1["ran"]) == 5
    for r in (r0, r1):
        assert r["result"]["test_loss_epoch"] == pytest.approx(r0["reference"], rel=1e-6)
        assert r["result"]["test_count"] == N


def test_predict_returns_every_sample_exactly_once(ranks):
    r0, r1 = results(ranks, "predict")
    flat = sorted(i for r in (r0, r1) for p in r["predictions"] for i in p)
    assert flat == list(range(N))


def test_unsized_streams_of_different_lengths_run_the_same_steps_with_exact_epoch_values(ranks):
    r0, r1 = results(ranks, "stream")
    assert len(r0["ran"]) == len(r1["ran"]) == 5  # rank 1: three batches, then two padding batches
    assert r1["ran"][3] == r1["ran"][4] == r1["ran"][0]  # copies of its own first batch
    assert r0["gathered"] == r1["gathered"] and len(r0["gathered"]) == 5
    for r in (r0, r1):
        assert r["result"]["val_loss_epoch"] == pytest.approx(r0["reference"], rel=1e-6)
        assert r["result"]["val_count"] == 32 and r["result"]["val_padding_seen"] == 0.0


def test_a_rank_with_an_empty_stream_raises_on_every_rank(ranks):
    for r in results(ranks, "stream"):
        assert "validation dataloader yielded no batch on some ranks" in r["empty"]
        assert "rank 0: 2, rank 1: 0" in r["empty"]


def test_a_padding_batch_logs_no_step_value_of_its_own_but_joins_synced_ones(ranks):
    r0, _ = results(ranks, "stream_rank0_short")
    assert r0["synced"] == 5  # every step's value averaged over the ranks, the padding steps' too
    assert r0["own"] == 3  # rank 0's own value only for its real batches
