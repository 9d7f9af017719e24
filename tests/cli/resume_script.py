"""An ``EmberCLI`` program for the resume tests (test_cli_resume.py), run as a user runs one:

    python resume_script.py fit --trainer.default_root_dir DIR [--ckpt_path last] ...

With ``STOP_AT_STEP=N`` in the environment it sends itself SIGTERM after the N-th optimizer step (the
stop is not part of the config, so the rerun's command is the same). ``DIR/starts.txt`` gets one line
per fit: the global step its training began at and the one it ended at.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.cli import EmberCLI

atexit.register(gc.freeze)  # end without the shutdown garbage collection: see tests/conftest.py


class Net(ember.TrainModule):
    def __init__(self, hidden: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def on_train_start(self) -> None:
        self._record(f"start {self.trainer.global_step}")

    def on_train_end(self) -> None:
        self._record(f"end {self.trainer.global_step}")

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.trainer.global_step == int(os.environ.get("STOP_AT_STEP", "-1")):
            os.kill(os.getpid(), signal.SIGTERM)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def _record(self, line: str) -> None:
        with open(os.path.join(self.trainer.default_root_dir, "starts.txt"), "a") as fh:
            fh.write(line + "\n")


class Data(ember.DataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=self.batch_size)


if __name__ == "__main__":
    EmberCLI(Net, Data)
