"""ModelCheckpoint's scores as Lightning keeps them: kth_value before the top k is full, tensors in the file."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from ember.callbacks import ModelCheckpoint
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


class Scores(BoringModel):
    """Logs ``score`` = the given value of each epoch."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("score", self.scores[self.current_epoch])
        return super().training_step(batch, batch_idx)


def _fit(cb: ModelCheckpoint, scores: list[float]) -> None:
    trainer = fast_trainer(max_epochs=len(scores), callbacks=[cb], limit_val_batches=0, enable_checkpointing=True)
    trainer.fit(Scores(scores), regression_loader(n=8))


@pytest.mark.parametrize("mode", ["min", "max"])
def test_kth_value_is_the_worst_possible_until_k_checkpoints_are_kept(tmp_path, mode):
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="score", mode=mode, save_top_k=3, save_last=False)
    worst = math.inf if mode == "min" else -math.inf
    assert cb.kth_value == worst and cb.kth_best_model_path == ""
    _fit(cb, [0.3, 0.1])
    assert cb.kth_value == worst and cb.kth_best_model_path == ""  # two kept of three
    assert len(cb.best_k_models) == 2


def test_kth_value_follows_the_worst_kept_once_full_and_with_save_top_k_minus_one(tmp_path):
    full = ModelCheckpoint(dirpath=tmp_path / "a", monitor="score", save_top_k=2, save_last=False)
    _fit(full, [0.3, 0.1, 0.2])
    assert full.kth_value.item() == pytest.approx(0.2) and full.kth_best_model_path.endswith("epoch=2-step=3.ckpt")
    every = ModelCheckpoint(dirpath=tmp_path / "b", monitor="score", save_top_k=-1, save_last=False)
    _fit(every, [0.3])
    assert every.kth_value.item() == pytest.approx(0.3) and every.kth_best_model_path.endswith("epoch=0-step=1.ckpt")


def test_the_checkpoint_holds_the_scores_as_tensors_and_a_resume_reads_them_back(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="score", save_top_k=2, save_last=False)
    _fit(cb, [0.3, 0.1])
    state = next(iter(torch.load(cb.best_model_path, weights_only=True)["callbacks"].values()))
    for name in ("current_score", "best_model_score", "kth_value"):
        assert isinstance(state[name], torch.Tensor), name
    assert state["best_model_score"].item() == pytest.approx(0.1)
    assert state["kth_value"].item() == pytest.approx(0.3)  # written when both were kept
    first = next(iter(torch.load(tmp_path / "epoch=0-step=1.ckpt", weights_only=True)["callbacks"].values()))
    assert first["kth_value"].item() == math.inf  # written when one of two was kept
    assert all(isinstance(v, torch.Tensor) for v in state["best_k_models"].values())
    again = ModelCheckpoint(dirpath=tmp_path, monitor="score", save_top_k=2, save_last=False)
    again.load_state_dict(state)
    assert again.best_model_score.item() == pytest.approx(0.1)
    assert {k: round(v.item(), 4) for k, v in again.best_k_models.items()} == {
        k: round(v.item(), 4) for k, v in state["best_k_models"].items()
    }


def test_scores_saved_as_numbers_by_earlier_versions_still_load(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="score")
    cb.load_state_dict(
        {"dirpath": str(tmp_path), "best_model_score": 0.5, "kth_value": 0.5, "best_k_models": {"a.ckpt": 0.5}}
    )
    assert isinstance(cb.best_model_score, torch.Tensor) and cb.best_model_score.item() == 0.5
    assert isinstance(cb.kth_value, torch.Tensor) and isinstance(cb.best_k_models["a.ckpt"], torch.Tensor)
