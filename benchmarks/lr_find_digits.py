"""lr_find on the digits example, with ember or with PyTorch Lightning: the same model, data and seed.

    python benchmarks/lr_find_digits.py --framework ember
    python benchmarks/lr_find_digits.py --framework lightning   # in an environment with pytorch-lightning

Each prints the suggested learning rate and the number of points the sweep recorded. The model is
examples/digits.py's CNN (AdamW); the data is scikit-learn's bundled 8x8 digits, split and shuffled
with the same seeds. Lightning's defaults are used on both sides: min_lr=1e-8, max_lr=1,
num_training=100, mode "exponential", early_stop_threshold=4.0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def digits_loaders(batch_size: int = 64, seed: int = 0) -> DataLoader:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train = perm[: int(0.8 * len(x))]
    return DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True)


def make_module(base: type) -> type:
    """examples/digits.py's DigitsCNN on ``base`` (ember.TrainModule or lightning's LightningModule)."""

    class DigitsCNN(base):  # type: ignore[misc, valid-type]
        def __init__(self, lr: float = 3e-3, channels: int = 32) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(
                torch.nn.Conv2d(1, channels, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.Conv2d(channels, channels, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.MaxPool2d(2),
                torch.nn.Flatten(),
                torch.nn.Dropout(0.2),
                torch.nn.Linear(channels * 16, 10),
            )

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    return DigitsCNN


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["ember", "lightning"], default="ember")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if args.framework == "ember":
        import ember
        from ember.tuner import Tuner

        base, seed, make_trainer = ember.TrainModule, ember.seed_everything, ember.Trainer
    else:
        pl = importlib.import_module("pytorch_lightning")
        Tuner = importlib.import_module("pytorch_lightning.tuner").Tuner
        base, seed, make_trainer = pl.LightningModule, pl.seed_everything, pl.Trainer
    with tempfile.TemporaryDirectory() as root:
        seed(args.seed)
        model = make_module(base)()
        loader = digits_loaders()
        trainer = make_trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=20,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        stdout, sys.stdout = sys.stdout, open(os.devnull, "w")
        try:
            finder = Tuner(trainer).lr_find(model, train_dataloaders=loader)
        finally:
            sys.stdout.close()
            sys.stdout = stdout
    print(
        f"{args.framework}: suggestion {finder.suggestion():.4g} (model.hparams.lr = {model.hparams.lr:.4g}), "
        f"{len(finder.results['lr'])} points"
    )


if __name__ == "__main__":
    main()
