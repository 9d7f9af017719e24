"""DeviceStatsMonitor on the CPU: psutil's statistics, written when and where a Lightning 2.6.6 run of the
same script writes them (its recorded calls are the expected list below)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("psutil")

import ember  # noqa: E402
from ember.callbacks import DeviceStatsMonitor  # noqa: E402
from ember.loggers import Logger  # noqa: E402


class Rec(Logger):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def log_metrics(self, metrics, step=None):
        hooks = sorted({k.split("/")[0] for k in metrics if k.startswith("DeviceStatsMonitor.")})
        if hooks:
            assert all(0 <= v <= 100 for v in metrics.values())
            self.calls.append((step, hooks, sorted({k.split("/")[1] for k in metrics})))


class M(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.l(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_cpu_stats_at_lightnings_steps_and_names():
    logger = Rec()
    data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = ember.Trainer(
        max_epochs=2,
        logger=logger,
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=[DeviceStatsMonitor()],
    )
    trainer.fit(M(), data, data)
    stats = ["cpu_percent", "cpu_swap_percent", "cpu_vm_percent"]
    train = [["DeviceStatsMonitor.on_train_batch_start"], ["DeviceStatsMonitor.on_train_batch_end"]]
    val = [["DeviceStatsMonitor.on_validation_batch_start"], ["DeviceStatsMonitor.on_validation_batch_end"]] * 2
    expected = [
        (step, hook, stats)
        for step, hooks in ((1, train), (3, train + val), (5, train), (7, train + val))
        for hook in hooks
    ]
    assert logger.calls == expected


def test_without_a_logger_it_says_what_to_do():
    trainer = ember.Trainer(
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[DeviceStatsMonitor()],
    )
    with pytest.raises(ValueError, match="no logger|has none"):
        trainer.fit(M(), DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2))
