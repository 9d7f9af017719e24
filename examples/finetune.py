"""Finetune a pretrained backbone with a new head: the head trains alone first, then the backbone
joins with a smaller learning rate that grows each epoch (``BackboneFinetuning``, as in Lightning).

    python examples/finetune.py                         # one process
    python examples/finetune.py --strategy ddp --devices 2

The "pretrained" backbone is a small CNN trained here for a few epochs on scikit-learn's digits 0-4
(bundled, no download); finetuning then learns all ten digits. Prints, on rank zero::

    backbone frozen in epoch 0, trained from epoch 1 (lr 0.0003 -> ...)
    validation accuracy 0.9.. on 10 digits
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import BackboneFinetuning, Callback


def backbone(channels: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, channels, 3, padding=1),
        torch.nn.BatchNorm2d(channels),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
    )


class Classifier(ember.TrainModule):
    """``backbone`` + ``head``: the attribute names BackboneFinetuning looks for."""

    def __init__(self, features: torch.nn.Module, classes: int, lr: float = 3e-3) -> None:
        super().__init__()
        self.backbone = features
        self.head = torch.nn.Linear(16 * 16, classes)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/acc", (self(x).argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        # Only what trains now: the frozen backbone joins the optimizer when BackboneFinetuning unfreezes it.
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=self.lr)


class ReportBackbone(Callback):
    """Records, per epoch, whether the backbone trains and at which learning rate."""

    def __init__(self) -> None:
        self.epochs: list[tuple[int, bool, float | None]] = []

    def on_train_epoch_start(self, trainer, module):
        groups = trainer.optimizers[0].param_groups
        trains = module.backbone[0].weight.requires_grad
        self.epochs.append((trainer.current_epoch, trains, groups[-1]["lr"] if len(groups) > 1 else None))


def loaders(classes: int, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    keep = y < classes
    x, y = x[keep], y[keep]
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(x))
    train, val = perm[:split], perm[split:]
    return (
        DataLoader(TensorDataset(x[train], y[train]), batch_size=64, shuffle=True),
        DataLoader(TensorDataset(x[val], y[val]), batch_size=256),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-epochs", type=int, default=4)
    parser.add_argument("--pretrain-epochs", type=int, default=3)
    args = parser.parse_args()

    ember.seed_everything(0)
    features = backbone()
    quiet = dict(
        accelerator="cpu",
        strategy=args.strategy,
        devices=args.devices,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    ember.Trainer(max_epochs=args.pretrain_epochs, **quiet).fit(Classifier(features, 5), *loaders(5))

    report = ReportBackbone()
    finetune = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1)
    trainer = ember.Trainer(
        accelerator="cpu",
        strategy=args.strategy,
        devices=args.devices,
        max_epochs=args.max_epochs,
        log_every_n_steps=5,  # an epoch is 23 batches here: log more often than every 50
        callbacks=[finetune, report],
    )
    trainer.fit(Classifier(features, 10), *loaders(10))
    if trainer.is_global_zero:
        trained = [(e, lr) for e, trains, lr in report.epochs if trains]
        frozen = [e for e, trains, _ in report.epochs if not trains]
        rates = " -> ".join(f"{lr:.2g}" for _, lr in trained)
        print(
            f"backbone frozen in epoch {', '.join(map(str, frozen))}, trained from epoch {trained[0][0]} (lr {rates})"
        )
        print(f"validation accuracy {float(trainer.callback_metrics['val/acc']):.4f} on 10 digits")


if __name__ == "__main__":
    main()
