"""trainer.history: the epoch-level metrics of the last fit, one dict per epoch, without any logger."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import EarlyStopping


class Deterministic(ember.TrainModule):
    """Logs values whose epoch reductions are known in advance."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("idx", float(batch_idx), on_step=True, on_epoch=True)  # epoch mean of 0..3 = 1.5
        self.log("step_only", 1.0)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/m", 10.0 * self.current_epoch + 1)

    def on_train_epoch_end(self):
        self.log("custom", self.current_epoch * 2.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(max_epochs=3, callbacks=None, logger=False, **kw):
    ds = TensorDataset(torch.randn(16, 2), torch.randn(16, 1))
    trainer = ember.Trainer(
        max_epochs=max_epochs,
        logger=logger,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=callbacks,
        **kw,
    )
    trainer.fit(Deterministic(), DataLoader(ds, batch_size=4), DataLoader(ds, batch_size=8))
    return trainer


def test_one_row_per_epoch_with_epoch_level_values():
    trainer = fit()
    assert [(row["epoch"], row["step"]) for row in trainer.history] == [(0, 4), (1, 8), (2, 12)]
    for e, row in enumerate(trainer.history):
        assert row["idx_epoch"] == 1.5
        assert row["val/m"] == 10.0 * e + 1
        assert row["custom"] == 2.0 * e
        assert "idx_step" not in row
        assert all(type(v) in (int, float) for v in row.values())  # plain numbers: ready to plot


def test_history_belongs_to_the_last_fit_and_stops_with_it(tmp_path):
    trainer = fit(max_epochs=2)
    assert len(trainer.history) == 2
    trainer.fit(Deterministic(), DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=4))
    assert [row["epoch"] for row in trainer.history] == [0, 1] and trainer.history[-1]["step"] == 4
    stopped = fit(max_epochs=10, callbacks=[EarlyStopping(monitor="idx_epoch", patience=1)])
    assert len(stopped.history) == 2  # 1.5 never improves on 1.5: stops after the second epoch


def test_history_matches_what_the_loggers_got(tmp_path):
    csv_logger = ember.loggers.CSVLogger(save_dir=tmp_path)
    trainer = fit(logger=csv_logger, log_every_n_steps=1)
    import csv

    with open(csv_logger.metrics_file, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["val/m"]]
    # history's "step" is trainer.global_step at the epoch's end (steps taken); the loggers got the epoch's
    # validation, as Lightning writes it, at the index of the epoch's last step: one lower.
    assert [(int(r["step"]), float(r["val/m"])) for r in rows] == [
        (row["step"] - 1, row["val/m"]) for row in trainer.history
    ]
