"""Run the digits example from a YAML file with ``EmberCLI`` (needs ``pip install 'ember[cli]'``).

    python examples/cli_digits.py fit --config examples/cli_digits.yaml
    python examples/cli_digits.py fit --config examples/cli_digits.yaml --model.lr 0.01 --trainer.max_epochs 3
    python examples/cli_digits.py fit --print_config                  # every setting, with its default
    python examples/cli_digits.py test --config examples/cli_digits.yaml --ckpt_path <run>/checkpoints/last.ckpt

The resolved configuration is saved as ``config.yaml`` in the run's log folder; ``--config`` that
file repeats the run (with the same seed). ``num_classes`` is linked: the model gets the number the
datamodule found in the data.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import ember
from ember.cli import EmberCLI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits import digits_loaders  # noqa: E402  (the loaders of examples/digits.py)


class DigitsData(ember.DataModule):
    """scikit-learn's 8x8 digits, split 80/20 with a fixed seed.

    Args:
        batch_size: training batch size.
        split_seed: the seed of the train/validation split.
    """

    def __init__(self, batch_size: int = 64, split_seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.split_seed = batch_size, split_seed
        self.num_classes = 10

    def setup(self, stage: str) -> None:
        self.train, self.val = digits_loaders(self.batch_size, self.split_seed)

    def train_dataloader(self):
        return self.train

    def val_dataloader(self):
        return self.val

    def test_dataloader(self):
        return self.val


class DigitsClassifier(ember.TrainModule):
    """A small CNN.

    Args:
        num_classes: output classes (linked from the datamodule).
        lr: AdamW's learning rate.
        channels: convolution channels.
    """

    def __init__(self, num_classes: int = 10, lr: float = 3e-3, channels: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, channels, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(channels * 16, num_classes),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/acc", (self.net(x).argmax(1) == y).float().mean(), prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/acc", (self.net(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class DigitsCLI(EmberCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The model's output size comes from the datamodule, once it is built.
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")


if __name__ == "__main__":
    DigitsCLI(DigitsClassifier, DigitsData)
