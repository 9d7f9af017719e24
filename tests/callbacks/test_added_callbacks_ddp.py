"""SpikeDetection, EMAWeightAveraging and BasePredictionWriter under 2-process ddp (one set of ranks for the three):
the ranks stop together on one rank's spike, end with the same average, and each writes its own shard."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import BasePredictionWriter, Callback, EMAWeightAveraging, SpikeDetection
from ember.callbacks.spike_detection import TrainingSpikeException
from tests.helpers.dist import join_as_rank, run_ranks


class Scripted(ember.TrainModule):
    """Loss 1.0 at every batch, but 50.0 at batch 3 of rank 1."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        spike = self.trainer.global_rank == 1 and batch_idx == 3
        return (self.w * batch[0]).sum() * 0 + (50.0 if spike else 1.0)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Net(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.layer(batch[0]), 2 * batch[0])

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return batch[0].reshape(-1)  # the samples themselves: each output says which samples it was

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Steps(Callback):
    def __init__(self) -> None:
        self.weights: list[list[torch.Tensor]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.weights.append([p.detach().clone() for p in module.parameters()])


class Writer(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__("batch_and_epoch")
        self.batches: list[list[float]] = []
        self.indices: list[list[int]] = []
        self.epoch: list[list[float]] = []
        self.epoch_indices: Any = None

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append(prediction.tolist())
        self.indices.append(batch_indices)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.epoch = [p.tolist() for p in predictions]
        self.epoch_indices = batch_indices


def trainer(tmp: str, callbacks: list[Any], world: int) -> ember.Trainer:
    return ember.Trainer(
        max_epochs=1, strategy="ddp", devices=world, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp, callbacks=callbacks,
    )  # fmt: skip


def _ranks(rank: int, world: int, tmp: str) -> dict[str, Any]:
    join_as_rank(rank, world)
    warnings.simplefilter("ignore")
    data = TensorDataset(torch.arange(12, dtype=torch.float32).reshape(12, 1))
    spike = SpikeDetection()
    stopped_at = None
    try:
        trainer(tmp, [spike], world).fit(Scripted(), DataLoader(data, batch_size=1))
    except TrainingSpikeException as exc:
        stopped_at = exc.batch_idx

    torch.manual_seed(0)
    module, steps = Net(), Steps()
    trainer(tmp, [EMAWeightAveraging(decay=0.5), steps], world).fit(module, DataLoader(data, batch_size=2))
    expected = [w.clone() for w in steps.weights[0]]
    for current in steps.weights[1:]:
        expected = [0.5 * a + 0.5 * c for a, c in zip(expected, current)]

    writer = Writer()
    trainer(tmp, [writer], world).predict(Net(), DataLoader(TensorDataset(torch.arange(5.0)[:, None]), batch_size=2))
    return {
        "stopped_at": stopped_at,
        "bad_batches": spike.bad_batches,
        "weights": [p.detach().clone() for p in module.parameters()],
        "ema_matches": all(torch.equal(e, p.detach()) for e, p in zip(expected, module.parameters())),
        "written": writer.batches,
        "written_at_end": writer.epoch,
        "indices": writer.indices,
        "indices_at_end": writer.epoch_indices,
    }


@pytest.mark.processes
@pytest.mark.timeout(150)
def test_ranks_stop_together_average_alike_and_write_their_own_shards(tmp_path: Any) -> None:
    r0, r1 = run_ranks(_ranks, 2, str(tmp_path), timeout=120)
    # Rank 1's loss spiked at batch 3: both ranks stop there, and rank zero wrote the batches to skip.
    assert r0["stopped_at"] == r1["stopped_at"] == 3
    assert r0["bad_batches"] == r1["bad_batches"] == [2, 3]
    assert (tmp_path / "skip_batches.json").read_text().split() == ["[", "2,", "3", "]"]
    # The average is the EMA of the (shared) steps, the same on both ranks.
    assert r0["ema_matches"] and r1["ema_matches"]
    assert all(torch.equal(a, b) for a, b in zip(r0["weights"], r1["weights"]))
    # Each rank wrote its own shard, every sample once: 0, 2, 4 on rank 0 and 1, 3 on rank 1.
    assert r0["written"] == [[0.0, 2.0], [4.0]]
    assert r1["written"] == [[1.0, 3.0]]
    assert r0["written_at_end"] == r0["written"] and r1["written_at_end"] == r1["written"]
    # The dataset indices of each rank's batches (the sample at index i is i here).
    assert r0["indices"] == [[0, 2], [4]] and r1["indices"] == [[1, 3]]
    assert r0["indices_at_end"] == [r0["indices"]] and r1["indices_at_end"] == [r1["indices"]]
