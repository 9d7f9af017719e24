"""One Lightning-style run, written once for both frameworks: hooks that log, a scheduler, checkpointing,
early stopping and a recording logger. ``run(pl, ...)`` takes the framework's namespace (ember's, or
Lightning's when the expectation is recorded) and returns what a user's dashboards and scripts read.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset


def _data() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).long()
    train = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=16)  # 4 batches
    val = DataLoader(TensorDataset(x[64:], y[64:]), batch_size=16)  # 2 batches
    return train, val


def _round(value: Any) -> float:
    return round(float(value), 4)


def run(pl: Any, root: str) -> dict[str, Any]:
    """Fit the scenario with framework ``pl`` (needs ``TrainModule``-or-``LightningModule``, ``Trainer``,
    ``callbacks.ModelCheckpoint``, ``callbacks.EarlyStopping``, a ``Logger`` base class) under ``root``: fit,
    then validate, then test from the best checkpoint."""

    class Module(pl.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(8, 2)

        def _loss_acc(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = batch
            logits = self.layer(x)
            return torch.nn.functional.cross_entropy(logits, y), (logits.argmax(1) == y).float().mean()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss, acc = self._loss_acc(batch)
            self.log("train_loss", loss)
            self.log("train_acc", acc, on_step=True, on_epoch=True, prog_bar=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            loss, acc = self._loss_acc(batch)
            self.log("val_loss", loss)
            self.log("val_acc", acc, prog_bar=True)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            loss, acc = self._loss_acc(batch)
            self.log("test_loss", loss)
            self.log("test_acc", acc)

        def on_train_epoch_end(self) -> None:
            self.log("epoch_marker", float(self.current_epoch))

        def on_validation_epoch_end(self) -> None:
            self.log("val_marker", float(self.current_epoch) + 0.5)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    class Recorder(pl.Logger):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[int, dict[str, float]]] = []

        @property
        def name(self) -> str:
            return "recorder"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.calls.append(
                (int(step) if step is not None else -1, {k: _round(v) for k, v in sorted(metrics.items())})
            )

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    dirpath = os.path.join(root, "checkpoints")
    checkpoint = pl.ModelCheckpoint(
        dirpath=dirpath, monitor="val_loss", save_top_k=2, filename="{epoch}-{step}", save_last=True
    )
    # min_delta so large that only the first epoch improves: the run stops after patience=1 more epoch.
    stopping = pl.EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)
    logger = Recorder()
    trainer = pl.Trainer(
        max_epochs=6,
        log_every_n_steps=2,
        logger=logger,
        callbacks=[checkpoint, stopping],
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        default_root_dir=root,
    )
    train, val = _data()
    module = Module()
    trainer.fit(module, train, val)
    fit_calls = len(logger.calls)
    validated = trainer.validate(module, val)
    tested = trainer.test(module, val, ckpt_path="best")
    return {
        "validate_results": [{k: _round(v) for k, v in sorted(r.items())} for r in validated],
        "test_results": [{k: _round(v) for k, v in sorted(r.items())} for r in tested],
        "fit_logger_calls": fit_calls,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "callback_metrics": {k: _round(v) for k, v in sorted(trainer.callback_metrics.items())},
        "progress_bar_metrics": sorted(trainer.progress_bar_metrics),
        "logged_metrics": sorted(trainer.logged_metrics),
        "logger_calls": [[step, metrics] for step, metrics in logger.calls],
        "checkpoint_files": sorted(os.listdir(dirpath)),
        "best_model_path": os.path.basename(checkpoint.best_model_path),
        "stopped_epoch": stopping.stopped_epoch,
    }
