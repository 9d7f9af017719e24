"""Finetune with torchmetrics: a backbone pretrained on digits 0-4 learns all ten digits, frozen for the
first epoch and then trained with a smaller, growing learning rate (``BackboneFinetuning``); accuracy and
macro F1 are torchmetrics ``Metric`` objects logged with ``self.log`` / ``self.log_dict``.

    pip install 'ember[examples]'                       # scikit-learn's digits (bundled) and torchmetrics
    python examples/metrics_finetune.py
    python examples/metrics_finetune.py --strategy ddp --devices 2

The Metrics accumulate over the epoch and sync across processes themselves under ddp; ember calls their
``compute()`` at the epoch's end and ``reset()`` after. Prints, on rank zero, one line per epoch and then::

    epoch 2: backbone lr 0.0006, train/acc 0.9..., val/acc 0.9..., val/f1 0.9...
    validation accuracy 0.9... macro F1 0.9... on 10 digits
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

import ember
from ember.callbacks import BackboneFinetuning, Callback


class Classifier(ember.TrainModule):
    """A small CNN ``backbone`` and a linear ``head`` (the names BackboneFinetuning looks for)."""

    def __init__(self, backbone: torch.nn.Module, classes: int, lr: float = 3e-3) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(16 * 16, classes)
        self.lr = lr
        self.train_acc = MulticlassAccuracy(num_classes=classes)
        self.val_metrics = MetricCollection(
            {
                "acc": MulticlassAccuracy(num_classes=classes),
                "f1": MulticlassF1Score(num_classes=classes, average="macro"),
            },
            prefix="val/",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)  # the batch's accuracy, and the epoch's state
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_metrics.update(self(x), y)
        self.log_dict(self.val_metrics, prog_bar=True)  # computed once, at the epoch's end

    def configure_optimizers(self):
        # Only what trains now: the frozen backbone joins the optimizer when BackboneFinetuning unfreezes it.
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=self.lr)


class EpochReport(Callback):
    """One line per epoch on rank zero: the backbone's learning rate and the epoch's metrics."""

    monitors_metrics = True  # run after the epoch's values are computed, so this epoch's train/acc is there

    def on_train_epoch_end(self, trainer, module):
        if not trainer.is_global_zero:
            return
        groups = trainer.optimizers[0].param_groups
        lr = f"{groups[-1]['lr']:.2g}" if len(groups) > 1 else "frozen"
        m = trainer.callback_metrics
        shown = ", ".join(f"{k} {float(m[k]):.4f}" for k in ("train/acc", "val/acc", "val/f1") if k in m)
        print(f"epoch {trainer.current_epoch}: backbone lr {lr}, {shown}")


def backbone() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten()
    )


def loaders(classes: int) -> tuple[DataLoader, DataLoader]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    x, y = x[y < classes], y[y < classes]
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, val = perm[: int(0.8 * len(x))], perm[int(0.8 * len(x)) :]
    return (
        DataLoader(TensorDataset(x[train], y[train]), batch_size=64, shuffle=True),
        DataLoader(TensorDataset(x[val], y[val]), batch_size=256),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-epochs", type=int, default=4)
    parser.add_argument("--pretrain-epochs", type=int, default=2)
    args = parser.parse_args()

    ember.seed_everything(0)
    common = dict(accelerator="cpu", strategy=args.strategy, devices=args.devices, enable_progress_bar=False)
    features = backbone()
    pretrain = ember.Trainer(max_epochs=args.pretrain_epochs, logger=False, enable_checkpointing=False, **common)
    pretrain.fit(Classifier(features, 5), *loaders(5))

    finetune = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1)
    # An epoch is 23 batches here: log more often than the default every 50 steps.
    trainer = ember.Trainer(
        max_epochs=args.max_epochs, log_every_n_steps=5, callbacks=[finetune, EpochReport()], **common
    )
    trainer.fit(Classifier(features, 10), *loaders(10))
    if trainer.is_global_zero:
        m = trainer.callback_metrics
        print(f"validation accuracy {float(m['val/acc']):.4f} macro F1 {float(m['val/f1']):.4f} on 10 digits")


if __name__ == "__main__":
    main()
