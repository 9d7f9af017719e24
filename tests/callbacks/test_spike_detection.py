"""SpikeDetection: Lightning's rules for a spike, the file of batches to skip, the exception, its state."""

from __future__ import annotations

import json
import math
import types
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import SpikeDetection
from ember.callbacks.spike_detection import TrainingSpikeException


class Scripted(ember.TrainModule):
    """A module whose loss at batch i is ``losses[i]`` (with a gradient, so the optimizer steps)."""

    def __init__(self, losses: list[float]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.losses = losses

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self.w * 0).sum() + self.losses[batch_idx]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(losses: list[float], callback: SpikeDetection, root: Any) -> ember.Trainer:
    trainer = ember.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(root),
        callbacks=[callback],
    )
    trainer.fit(Scripted(losses), DataLoader(TensorDataset(torch.zeros(len(losses), 1)), batch_size=1))
    return trainer


def test_a_spike_stops_the_fit_and_writes_the_batches_to_skip(tmp_path: Any) -> None:
    callback = SpikeDetection()
    with pytest.raises(TrainingSpikeException, match="Training spike detected in batch 4") as caught:
        fit([1.0, 0.9, 0.95, 0.8, 3.5, 1.0, 1.0], callback, tmp_path)
    assert caught.value.batch_idx == 4
    assert callback.bad_batches == [3, 4]  # the batch and the one before it (whose step may be the culprit)
    assert json.loads((tmp_path / "skip_batches.json").read_text()) == [3, 4]


def test_a_loss_that_stays_near_its_mean_runs_through(tmp_path: Any) -> None:
    callback = SpikeDetection(exclude_batches_path=tmp_path / "elsewhere")
    fit([1.0, 1.2, 0.9, 1.5, 1.1, 2.9], callback, tmp_path)  # 2.9 < 1.12 + 2 * 1.12: no spike
    assert callback.bad_batches == [] and not (tmp_path / "elsewhere").exists()
    callback = SpikeDetection(exclude_batches_path=tmp_path / "elsewhere")  # a directory: gets skip_batches.json
    with pytest.raises(TrainingSpikeException):
        fit([1.0, 1.2, 0.9, 1.5, 1.1, 3.5], callback, tmp_path)
    assert json.loads((tmp_path / "elsewhere" / "skip_batches.json").read_text()) == [4, 5]


class OneProcess:
    def gather_per_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().unsqueeze(0)


def first_spike(callback: SpikeDetection, losses: list[float], root: Any, start: int = 0) -> int | None:
    trainer = types.SimpleNamespace(strategy=OneProcess(), default_root_dir=str(root), is_global_zero=True)
    for i, loss in enumerate(losses[start:], start):
        try:
            callback.on_train_batch_end(trainer, None, {"loss": torch.tensor(loss)}, None, i)  # type: ignore[arg-type]
        except TrainingSpikeException:
            return i
    return None


# Lightning 2.6's SpikeDetection, given the same losses, stops at the same batch (None: it does not stop).
LIGHTNINGS_ANSWERS = [
    (dict(), [1.0, 1.2, 1.3, 1.4, 1.5, 4.6, 4.7], 5),
    (dict(rtol=None, atol=0.5), [1.0, 1.2, 1.6, 1.1, 1.7, 1.0], 2),
    (dict(rtol=None, atol=None), [1.0, 0.9, 0.91], 2),  # no tolerance: any loss worse than the last one
    (dict(mode="max", rtol=0.5), [1.0, 2.0, 1.9, 0.5, 0.2], 3),
    (dict(window=2), [1.0, 1.0, 5.0, 5.0, 5.0, 9.0, 30.0], 2),
    (dict(warmup=3), [1.0, 5.0, 20.0, 21.0, 100.0], 4),
    (dict(warmup=0), [1.0, 2.0], None),  # batch 0 has no mean to differ from
    (dict(), [1.0, 0.9, math.nan, 1.0], 2),
    (dict(finite_only=False), [1.0, 0.9, math.nan, 0.95, math.inf, 5.0], 4),
    (dict(window=3, rtol=1.0), [2.0, 1.0, 1.5, 1.4, 1.45, 2.9, 3.0], 5),
]


@pytest.mark.parametrize(("kwargs", "losses", "spike"), LIGHTNINGS_ANSWERS)
def test_spikes_are_where_lightning_finds_them(kwargs: dict, losses: list[float], spike: int | None, tmp_path) -> None:
    assert first_spike(SpikeDetection(**kwargs), losses, tmp_path) == spike


def test_the_state_continues_the_running_means_exactly(tmp_path: Any) -> None:
    losses = [3.0, 3.2, 3.1, 1.0, 2.5, 2.4]
    assert first_spike(SpikeDetection(window=3, rtol=1.0), losses, tmp_path) is None  # uninterrupted
    first = SpikeDetection(window=3, rtol=1.0)
    assert first_spike(first, losses[:3], tmp_path) is None
    resumed = SpikeDetection(window=3, rtol=1.0)
    resumed.load_state_dict(first.state_dict())
    assert first_spike(resumed, losses, tmp_path, start=3) is None
    assert resumed.state_dict()["windows"] == [pytest.approx([1.0, 2.5, 2.4])]
    # Without the state the mean at batch 4 is 1.0's alone, and 2.5 is a spike.
    assert first_spike(SpikeDetection(window=3, rtol=1.0), losses, tmp_path, start=3) == 4


def test_the_state_is_saved_in_the_fits_checkpoint(tmp_path: Any) -> None:
    callback = SpikeDetection(window=2)
    every = ember.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = ember.Trainer(
        max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[callback, every]
    )
    trainer.fit(Scripted([1.0, 1.1, 0.9]), DataLoader(TensorDataset(torch.zeros(3, 1)), batch_size=1))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"][callback.state_key]
    assert saved == {"bad_batches": [], "last": [pytest.approx(0.9)], "windows": [pytest.approx([1.1, 0.9])]}


def test_mistakes_are_explained(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="'min' or 'max'"):
        SpikeDetection(mode="lowest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        SpikeDetection(window=0)
    trainer = types.SimpleNamespace(strategy=OneProcess(), default_root_dir=str(tmp_path), is_global_zero=True)
    with pytest.raises(TypeError, match="a tensor or a dict with a 'loss'"):
        SpikeDetection().on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
