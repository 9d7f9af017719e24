"""strategy="dp" with torchmetrics on CUDA: each replica's Metric keeps its states on its own device.

A shallow replica's Metric would keep the original's states on GPU 0 (and report GPU 0 as its
``device``), so the update of the replica on GPU 1 would fail on a device mismatch. The values equal
one GPU's on the same data (the metrics' inputs are elementwise functions of the batch, so exactly).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.strategies.dp import DataParallelStrategy
from tests.cuda.cuda_helpers import needs_cuda, needs_two_gpus, trainer

torchmetrics = pytest.importorskip("torchmetrics")
pytestmark = [needs_cuda, pytest.mark.timeout(120)]
CUDA0 = torch.device("cuda", 0)


class Placed(ember.TrainModule):
    """Logs metrics with list and tensor states; records, per replica and step, where their states are."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.auroc = torchmetrics.classification.BinaryAUROC()  # list states
        self.accuracy = torchmetrics.classification.BinaryAccuracy()  # tensor states, forward
        self.seen = torchmetrics.CatMetric()
        # A plain list: the replicas append to the original's, one entry each per step.
        self.placement: list[tuple[str, set[str]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        preds = x[:, 0].sigmoid()
        self.auroc.update(preds, y)
        self.log("auroc", self.auroc, on_step=False, on_epoch=True)
        self.accuracy(preds, y)
        self.log("acc", self.accuracy, on_step=True, on_epoch=True)
        self.seen.update(preds)
        states = [self.accuracy.tp, *self.auroc.preds, *self.seen.value]
        self.placement.append((str(x.device), {str(self.accuracy.device)} | {str(t.device) for t in states}))
        return F.binary_cross_entropy_with_logits(self.layer(x).squeeze(1), y.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(45, 4, generator=g), (torch.rand(45, generator=g) > 0.5).long()), 8)


def fit(devices: Any) -> tuple[Placed, ember.Trainer]:
    module = Placed()
    t = trainer(strategy=DataParallelStrategy(devices=devices) if len(devices) > 1 else "single", max_epochs=1)
    t.fit(module, loader())
    return module, t


def assert_same_results(got: tuple[Placed, ember.Trainer], expected: tuple[Placed, ember.Trainer]) -> None:
    assert {k: float(v) for k, v in got[1].callback_metrics.items()} == {
        k: float(v) for k, v in expected[1].callback_metrics.items()
    }
    assert torch.equal(got[0].seen.compute(), expected[0].seen.compute())


@needs_two_gpus
def test_each_replica_keeps_its_metric_states_on_its_gpu_and_values_equal_one_gpu():
    one = fit([CUDA0])
    two = fit([CUDA0, torch.device("cuda", 1)])
    assert_same_results(two, one)
    for where, states in two[0].placement:
        assert states == {where}, (where, states)
    assert {where for where, _ in two[0].placement} == {"cuda:0", "cuda:1"}
    assert two[0].seen.device == CUDA0 and all(t.device == CUDA0 for t in two[0].seen.value)


def test_two_replicas_on_gpu_0_equal_one_gpu():
    assert_same_results(fit([CUDA0, CUDA0]), fit([CUDA0]))
