"""TrainModule.all_gather and print, and the strategy's all_gather / broadcast / barrier, as Lightning 2.6.6 has
them (checked there): in one process all_gather returns the data unchanged (numbers become tensors), under ddp
every tensor gets a leading world-size dimension; print prints on global rank zero only."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

import ember
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


class Gathers(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict = {}

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            rank = float(self.global_rank)
            self.seen.update(
                {  # update: under dp this runs in a replica, which shares the dict
                    "scalar": self.all_gather(torch.tensor(rank)).tolist(),
                    "vector": self.all_gather(torch.full((2,), rank)).tolist(),
                    "number": self.all_gather(3).tolist(),
                    "nested": {
                        k: [t.tolist() for t in v] for k, v in self.all_gather({"a": [torch.ones(1) * rank]}).items()
                    },
                    "strategy": self.trainer.strategy.all_gather(torch.ones(2)).shape,
                    "broadcast": self.trainer.strategy.broadcast({"from": self.global_rank}),
                    "barrier": self.trainer.strategy.barrier("in the step"),
                }
            )
            self.print("hello from", self.global_rank)
            gathered = self.all_gather(self.layer.weight.sum(), sync_grads=True)
            self.seen["sync_grads"] = gathered.requires_grad
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_in_one_process_all_gather_returns_the_data_unchanged(strategy, capsys):
    module = Gathers()
    fast_trainer(strategy=strategy, devices=2 if strategy == "dp" else 1, max_steps=1).fit(module, regression_loader())
    assert module.seen == {
        "scalar": 0.0,
        "vector": [0.0, 0.0],
        "number": 3,
        "nested": {"a": [[0.0]]},
        "strategy": torch.Size([2]),
        "broadcast": {"from": 0},
        "barrier": None,
        "sync_grads": True,
    }
    assert "hello from 0\n" in capsys.readouterr().out


def test_print_outside_a_trainer_prints(capsys):
    BoringModel().print("alone", end="!")
    assert capsys.readouterr().out == "alone!"


def _two_ranks(rank: int, world: int) -> dict:
    from tests.helpers.dist import join_as_rank

    join_as_rank(rank, world)
    module = Gathers()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ember.Trainer(
            strategy="ddp",
            devices=world,
            accelerator="cpu",
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
        ).fit(module, regression_loader())
    return {**module.seen, "printed": out.getvalue()}


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_under_ddp_every_tensor_gets_a_world_dimension_and_only_rank_zero_prints():
    from tests.helpers.dist import run_ranks

    ranks = run_ranks(_two_ranks, 2, timeout=90)
    for r in ranks:
        assert r["scalar"] == [0.0, 1.0]
        assert r["vector"] == [[0.0, 0.0], [1.0, 1.0]]
        assert r["number"] == [3, 3]
        assert r["nested"] == {"a": [[[0.0], [1.0]]]}
        assert r["strategy"] == torch.Size([2, 2])
        assert r["broadcast"] == {"from": 0}
        assert r["sync_grads"] is True
    assert "hello from 0" in ranks[0]["printed"]
    assert "hello from" not in ranks[1]["printed"]
