"""``training_step(self, dataloader_iter)`` (and ``validation_step``) under ``ddp``, on 2 real gloo ranks.

Each rank's step fetches from its own shard. One spawn of two ranks runs every scenario: the one-batch step
against the usual step (bitwise), two batches per step with an exact mid-epoch resume (the data position
counts the batches fetched on every rank), a step asking past the last batch on both ranks (the epoch ends
on both, and the next forward finds the gradient reducer ready), streams of different lengths (the ranks
agree on the last batch, so neither waits for the other) and a validation whose shards are padded.
"""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ember
from tests.helpers.dist import join_as_rank, run_ranks
from tests.trainer.test_dataloader_iter import OneBatchPerStep, StopAt, TwoBatchesPerStep, UsualStep, run

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]
WORLD = 2


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def ddp(root: str, cls: type, **kwargs: Any) -> tuple[Any, ember.Trainer]:
    return run(cls, root, strategy="ddp", devices=WORLD, **kwargs)


def parity(rank: int, root: str) -> dict:
    usual, t1 = ddp(os.path.join(root, "usual"), UsualStep, val_check_interval=0.5)
    fetching, t2 = ddp(os.path.join(root, "iter"), OneBatchPerStep, val_check_interval=0.5)
    return {
        "usual": weights(usual),
        "iter": weights(fetching),
        "steps": (t1.global_step, t2.global_step),
        "seen": (usual.seen, fetching.seen),
    }


def resume(rank: int, root: str) -> dict:
    reference, trainer = ddp(os.path.join(root, "ref"), TwoBatchesPerStep)
    out = {"ref": weights(reference), "ref_steps": trainer.global_step, "ref_seen": reference.seen}
    stopped = os.path.join(root, "stopped")
    try:  # both ranks raise at step 5, after the checkpoint of step 4 (epoch 1, its first step done)
        ddp(stopped, TwoBatchesPerStep, callbacks=[StopAt(5)])
    except RuntimeError:
        pass
    resumed, trainer = ddp(stopped, TwoBatchesPerStep, ckpt_path="last")
    out.update(resumed=weights(resumed), steps=trainer.global_step, seen=resumed.seen)
    return out


class Indexed(IterableDataset):
    """Rank ``r`` yields ``counts[r]`` indexed samples of its own (x = y = 100 * r + i)."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def __iter__(self):
        rank = dist.get_rank()
        for i in range(self.counts[rank]):
            x = torch.full((4,), float(100 * rank + i))
            yield x, x[:1].clone(), torch.tensor(100 * rank + i)


def quiet(**kwargs: Any) -> ember.Trainer:
    kwargs.setdefault("max_epochs", 2)
    return ember.Trainer(
        strategy="ddp",
        devices=WORLD,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def fit_recorded(module: Any, loader: Any, **kwargs: Any) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = quiet(**kwargs)
        trainer.fit(module, loader)
    return {
        "weights": weights(module),
        "steps": trainer.global_step,
        "epochs": trainer.current_epoch,
        "seen": module.seen,
        "warnings": [str(w.message) for w in caught if "yielded a different number of batches" in str(w.message)],
    }


def past_the_end(rank: int, root: str) -> dict:
    # 40 samples: 5 batches of 4 per rank; the third step of each epoch gets the fifth, then StopIteration.
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g), torch.arange(40))
    return fit_recorded(TwoBatchesPerStep(), DataLoader(data, batch_size=4))


def streams(rank: int, root: str) -> dict:
    # 20 and 12 samples, batches of 2: 10 and 6 batches, of which the ranks agree to use 6.
    return {
        "two": fit_recorded(TwoBatchesPerStep(), DataLoader(Indexed([20, 12]), batch_size=2), max_epochs=1),
        "one": fit_recorded(OneBatchPerStep(), DataLoader(Indexed([20, 12]), batch_size=2), max_epochs=1),
    }


class Validates(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))


class ValidatesFetching(Validates):
    def validation_step(self, dataloader_iter: Any) -> None:  # type: ignore[override]
        batch, batch_idx, _ = next(dataloader_iter)
        super().validation_step(batch, batch_idx)


def evaluation(rank: int, root: str) -> dict:
    # 17 samples in batches of 4: 9 and 8 per rank, so rank 1's shard ends with a padding batch.
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(17, 4, generator=g), torch.randn(17, 1, generator=g), torch.arange(17))
    module = ValidatesFetching()
    out = {"iter": quiet().validate(module, DataLoader(data, batch_size=4), verbose=False)[0]["val_loss"]}
    out["usual"] = quiet().validate(Validates(), DataLoader(data, batch_size=4), verbose=False)[0]["val_loss"]
    with torch.no_grad():
        out["exact"] = F.mse_loss(module.layer(data.tensors[0]), data.tensors[1]).item()
    return out


SCENARIOS = {
    "parity": parity,
    "resume": resume,
    "past_the_end": past_the_end,
    "streams": streams,
    "evaluation": evaluation,
}


def suite(rank: int, world: int, root: str) -> dict:
    warnings.simplefilter("ignore")
    join_as_rank(rank, world)
    out: dict = {}
    for name, scenario in SCENARIOS.items():
        try:
            out[name] = scenario(rank, root)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
            break  # a failed collective leaves the ranks out of step: stop rather than hang
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(suite, WORLD, str(tmp_path_factory.mktemp("dliter")), timeout=130)


def results(ranks: list[dict], name: str) -> list[Any]:
    for rank, r in enumerate(ranks):
        assert name in r, f"rank {rank} stopped before {name!r}: {[v for v in r.values() if 'error' in v]}"
        assert not (isinstance(r[name], dict) and "error" in r[name]), f"rank {rank}:\n{r[name]['error']}"
    return [r[name] for r in ranks]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_one_batch_per_step_trains_bitwise_as_the_usual_step_under_ddp(ranks):
    for r in results(ranks, "parity"):
        assert same(r["usual"], r["iter"])
        assert r["steps"] == (18, 18)  # 48 samples, batches of 4 on 2 ranks: 6 steps per epoch
        assert r["seen"][0] == r["seen"][1]
    r0, r1 = results(ranks, "parity")
    assert same(r0["iter"], r1["iter"])
    # Each rank fetched its own shard: together every sample once per epoch.
    assert sorted(r0["seen"][1][:24] + r1["seen"][1][:24]) == list(range(48))


def test_two_batches_per_step_resume_mid_epoch_bitwise_under_ddp(ranks):
    r0, r1 = results(ranks, "resume")
    for r in (r0, r1):
        assert r["ref_steps"] == r["steps"] == 9  # 6 batches per rank and epoch, 2 per step
        assert same(r["resumed"], r["ref"])
        # Resumed from step 4: epoch 1 after its first step, 2 batches of 4 fetched on each rank.
        assert r["seen"] == r["ref_seen"][(4 * 2 * 4) :]
    assert same(r0["resumed"], r1["resumed"])


def test_a_step_asking_past_the_last_batch_ends_the_epoch_on_every_rank(ranks):
    r0, r1 = results(ranks, "past_the_end")
    assert r0["steps"] == r1["steps"] == 4 and r0["epochs"] == r1["epochs"] == 2
    assert same(r0["weights"], r1["weights"])
    # Each epoch, each rank trained on 4 of its 5 batches (the dropped step fetched the fifth).
    assert len(r0["seen"]) == len(r1["seen"]) == 2 * 4 * 4


def test_streams_of_different_lengths_end_together(ranks):
    r0, r1 = results(ranks, "streams")
    # Two per step: three steps, the third fetching the last batch the ranks agreed on.
    assert r0["two"]["steps"] == r1["two"]["steps"] == 3
    assert same(r0["two"]["weights"], r1["two"]["weights"])
    # One per step: six steps, ending with the sixth batch, where the shorter rank's stream ends.
    assert r0["one"]["steps"] == r1["one"]["steps"] == 6
    assert r0["one"]["seen"] == list(range(12)) and r1["one"]["seen"] == list(range(100, 112))
    assert len(r0["one"]["warnings"]) == 1 and "rank 0: 10, rank 1: 6" in r0["one"]["warnings"][0]


def test_validation_over_padded_shards_gives_the_exact_metric(ranks):
    for r in results(ranks, "evaluation"):
        assert r["iter"] == pytest.approx(r["exact"], rel=1e-5)
        assert r["iter"] == pytest.approx(r["usual"], rel=1e-6)
