"""LearningRateMonitor: names per optimizer and param group, values at the right steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import LearningRateMonitor
from ember.loggers import Logger


class Recorder(Logger):
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics, step):
        self.calls.append((step, dict(metrics)))

    def values(self, key):
        return [(step, m[key]) for step, m in self.calls if key in m]


class Tiny(ember.TrainModule):
    def __init__(self, optim="sgd_step") -> None:
        super().__init__()
        self.a = torch.nn.Linear(2, 1)
        self.b = torch.nn.Linear(2, 1)
        self.optim = optim

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.a(x) + self.b(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optim == "sgd_step":
            opt = torch.optim.SGD(self.parameters(), lr=1.0, momentum=0.9, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.optim == "groups_epoch":
            opt = torch.optim.Adam(
                [{"params": self.a.parameters(), "lr": 0.1}, {"params": self.b.parameters(), "lr": 0.2}],
                betas=(0.8, 0.99),
            )
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "name": "my-lr"}}
        return torch.optim.SGD(self.parameters(), lr=0.3)


def fit(module, cb, logger, **kw):
    ds = TensorDataset(torch.randn(16, 2), torch.randn(16, 1))
    args = dict(
        max_epochs=2,
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=logger,
        callbacks=[cb],
    )
    args.update(kw)
    trainer = ember.Trainer(**args)
    trainer.fit(module, DataLoader(ds, batch_size=4))
    return trainer


def test_step_interval_logs_the_rate_each_logged_step_used():
    rec = Recorder()
    cb = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    fit(Tiny("sgd_step"), cb, rec)
    # As Lightning: step metrics are written at the step's index (0, 1, ...), every 2nd step: 1, 3, 5, 7.
    # StepLR halves the rate after every step; the rate step index s used is 0.5 ** s
    assert rec.values("lr-SGD") == [(s, 0.5**s) for s in (1, 3, 5, 7)]
    assert rec.values("lr-SGD-momentum") == [(s, 0.9) for s in (1, 3, 5, 7)]
    assert rec.values("lr-SGD-weight_decay") == [(s, 0.01) for s in (1, 3, 5, 7)]
    # written beside the step metrics of the same step
    assert [s for s, _ in rec.values("loss")] == [1, 3, 5, 7]


def test_epoch_interval_param_groups_and_scheduler_name():
    rec = Recorder()
    fit(Tiny("groups_epoch"), LearningRateMonitor(log_momentum=True), rec, max_epochs=3)
    assert rec.values("my-lr/pg1") == [(0, 0.1), (4, pytest.approx(0.01)), (8, pytest.approx(0.001))]
    assert rec.values("my-lr/pg2") == [(0, 0.2), (4, pytest.approx(0.02)), (8, pytest.approx(0.002))]
    assert rec.values("my-lr/pg1-momentum") == [(0, 0.8), (4, 0.8), (8, 0.8)]


def test_plain_optimizer_forced_to_step_interval_and_csv(tmp_path):
    csv_logger = ember.loggers.CSVLogger(save_dir=tmp_path)
    trainer = fit(Tiny("plain"), LearningRateMonitor(logging_interval="step"), csv_logger, max_epochs=1)
    import csv

    with open(csv_logger.metrics_file, newline="") as fh:
        rows = list(csv.DictReader(fh))
    # 4 steps, every 2nd written (as Lightning) at its index: 1 and 3, the rate beside the loop's step metrics
    assert [(r["step"], r["lr-SGD"], r["loss"] != "") for r in rows] == [("1", "0.3", True), ("3", "0.3", True)]
    # As Lightning 2.6.6: the monitor writes to the loggers directly; logged_metrics holds self.log's values only.
    assert "lr-SGD" not in trainer.logged_metrics and "loss" in trainer.logged_metrics


def test_needs_a_logger_and_a_valid_interval():
    with pytest.raises(ValueError, match="has none"):
        fit(Tiny("plain"), LearningRateMonitor(), False)
    with pytest.raises(ValueError, match="logging_interval"):
        LearningRateMonitor(logging_interval="batch")
