"""A training script with the default Trainer configuration (logger and checkpointing on) that the
exit-status tests run as a real program: ``python exit_script.py --out DIR [--strategy ddp_spawn]``.

Each rank writes ``<out>/pid<r>`` when fit starts (so a test can check that no process outlived
the job) and ``<out>/training<r>`` once it has taken a few steps (so a test knows when a signal
lands mid-training). Steps are slowed down a little so that training outlasts any signal.
``--end exit3|segv|term --end-rank r`` makes rank ``r`` end that way at step 3: ``os._exit(3)``,
SIGSEGV, or a SIGTERM sent to itself alone.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember

atexit.register(gc.freeze)  # end without the shutdown garbage collection: see tests/conftest.py

STEPS = 3000  # far more than any test lets run


class Net(ember.TrainModule):
    def __init__(self, out: str, end: str = "none", end_rank: int = -1) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.out, self.end, self.end_rank = out, end, end_rank

    def on_fit_start(self) -> None:
        self._touch(f"pid{self.global_rank}", str(os.getpid()))

    def training_step(self, batch, batch_idx):
        if batch_idx == 3 and self.global_rank == self.end_rank:
            if self.end == "exit3":
                os._exit(3)
            if self.end == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if self.end == "term":
                os.kill(os.getpid(), signal.SIGTERM)
        if batch_idx == 5:
            self._touch(f"training{self.global_rank}", "")
        time.sleep(0.01)
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def _touch(self, name: str, text: str) -> None:
        with open(os.path.join(self.out, name), "w") as f:
            f.write(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--end", default="none")
    parser.add_argument("--end-rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(STEPS * 2, 4, generator=g), torch.randn(STEPS * 2, 1, generator=g))
    trainer = ember.Trainer(
        strategy=args.strategy, devices=2, accelerator="cpu", max_epochs=1, enable_progress_bar=False
    )
    trainer.fit(Net(args.out, args.end, args.end_rank), DataLoader(data, batch_size=1))


if __name__ == "__main__":
    main()
