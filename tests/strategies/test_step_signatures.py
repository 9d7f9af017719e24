"""``def training_step(self, batch)`` (no ``batch_idx``) works as in Lightning 2.6.6, where the step's
signature decides whether ``batch_idx`` is passed: a step with fewer than two parameters
and no ``batch_idx`` / ``*args`` gets the batch alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember


def _loader(n: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 2), torch.randn(n, 1)), batch_size=4)


class NoIndex(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: list[tuple[str, int]] = []

    def training_step(self, batch: Any) -> torch.Tensor:
        self.seen.append(("train", len(batch)))
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any) -> None:
        self.seen.append(("val", len(batch)))

    def predict_step(self, batch: Any) -> torch.Tensor:
        return self.layer(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("strategy, devices", [("single", 1), ("dp", 2)])
def test_steps_without_batch_idx(strategy, devices):
    module = NoIndex()
    trainer = ember.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, _loader(), _loader())
    assert trainer.global_step == 2
    replicas = devices if strategy == "dp" else 1
    assert module.seen == [("train", 2)] * (2 * replicas) + [("val", 2)] * (2 * replicas)
    out = trainer.predict(module, _loader())
    assert len(out) == 2 and out[0].shape == (4, 1)


def test_which_signatures_take_batch_idx():
    from ember.module import takes_batch_idx

    class Steps:
        def a(self, batch): ...
        def b(self, batch, batch_idx): ...
        def c(self, batch, i): ...
        def d(self, batch, *args): ...
        def e(self, batch, dataloader_idx=0): ...

    s = Steps()
    assert [takes_batch_idx(getattr(s, n)) for n in "abcde"] == [False, True, True, True, True]


def _ddp_rank(rank: int, world: int) -> list[tuple[str, int]]:
    from tests.helpers.dist import join_as_rank

    join_as_rank(rank, world)
    module = NoIndex()
    ember.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=world,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    ).fit(module, _loader(16), _loader(16))
    return module.seen


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_steps_without_batch_idx_under_ddp():
    from tests.helpers.dist import run_ranks

    # 16 samples over 2 ranks in batches of 4: 2 training and 2 validation batches per rank.
    assert run_ranks(_ddp_rank, 2, timeout=50) == [[("train", 2)] * 2 + [("val", 2)] * 2] * 2
