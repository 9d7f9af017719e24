"""A training script the launcher tests run as a real program (``python ddp_script.py ...``).

Every rank writes ``<out>/rank<r>.pt`` (weights, epoch metrics, pid) when fit returns, and
``<out>/pid<r>`` as soon as it starts, so a test can check that no process outlived the job.
``--fail raise|kill --fail-rank r`` makes rank ``r`` raise or SIGKILL itself at step 3, after writing
the time it fails (``time.time()``) to ``<out>/failed_at``.
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

B, N = 4, 32


class Net(ember.TrainModule):
    def __init__(self, fail: str = "none", fail_rank: int = -1, out: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.fail, self.fail_rank, self.out = fail, fail_rank, out

    def on_fit_start(self) -> None:
        if self.out:
            with open(os.path.join(self.out, f"pid{self.global_rank}"), "w") as f:
                f.write(str(os.getpid()))

    def training_step(self, batch, batch_idx):
        if batch_idx == 3 and self.global_rank == self.fail_rank:
            if self.out and self.fail in ("raise", "kill"):
                with open(os.path.join(self.out, "failed_at"), "w") as f:
                    f.write(repr(time.time()))
            if self.fail == "raise":
                raise ValueError("boom: a deliberate failure at step 3")
            if self.fail == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loaders(batch: int) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 6, generator=g), torch.randn(N, 3, generator=g)
    return (
        DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True),
        DataLoader(TensorDataset(x[:13], y[:13]), batch_size=3),
    )


def train(strategy: str, devices: int, batch: int, module: Net | None = None) -> tuple[Net, ember.Trainer]:
    module = module or Net()  # before seeding: Net's own manual_seed must not move the stream
    ember.seed_everything(3)
    trainer = ember.Trainer(
        strategy=strategy,
        devices=devices,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, *loaders(batch))
    return module, trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--fail", default="none")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    module, trainer = train(args.strategy, args.devices, B, Net(args.fail, args.fail_rank, args.out))
    weights = trainer.strategy.whole_state_dict()  # every rank: fsdp gathers its shards
    torch.save(
        {
            "weights": weights,
            "pid": os.getpid(),
            "world_size": trainer.world_size,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        },
        os.path.join(args.out, f"rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main()
