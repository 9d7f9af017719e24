"""A training script for the restart tests (test_elastic.py): run as is, under torchrun, or with a
SLURM-like environment. It kills one of its own ranks with SIGKILL (or sends itself a stop signal)
at a chosen step of the first attempt, and writes the final weights of the finished run.

    python elastic_script.py OUT_DIR [--kill-at STEP[,STEP...]] [--kill-rank R] [--signal-at STEP]
                             [--workers N] [--auto] [--every K]

Runs in OUT_DIR with the default logger and checkpointing (ModelCheckpoint every K steps), so
restarts resume the way a user's job does. Attempts are counted in OUT_DIR/attempts (one line per
start of rank 0), and attempt i is killed at the i-th step of --kill-at; only the first is signalled.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import signal
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ModelCheckpoint

atexit.register(gc.freeze)  # end without the shutdown garbage collection: see tests/conftest.py


def attempt(out: str) -> int:
    """Which attempt of the job this is: 0 first, then 1, 2, ... (the launcher's restart count; in a
    shell loop, the starts recorded in OUT_DIR/attempts)."""
    for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        if var in os.environ:
            return int(os.environ[var])
    with open(os.path.join(out, "attempts")) as f:
        return f.read().count("\n") - 1


class Net(ember.TrainModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        a, rank, step, n = self.args, self.global_rank, self.trainer.global_step, attempt(self.args.out)
        if n < len(a.kill_at) and step == a.kill_at[n] and rank == a.kill_rank:
            with open(os.path.join(a.out, "killed"), "a") as f:
                f.write(f"{time.time()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        if step == a.signal_at and rank == 0 and n == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        if rank == 0 and n > 0 and not os.path.exists(os.path.join(a.out, f"restarted{n}")):
            # The first step a restarted attempt runs (the recovery time ends here).
            with open(os.path.join(a.out, f"restarted{n}"), "w") as f:
                f.write(f"{time.time()} {step}\n")
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument(
        "--kill-at",
        type=lambda v: [int(s) for s in v.split(",")],
        default=[],
        help="the step at which attempt 0, 1, ... is killed: 7 or 7,15",
    )
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--signal-at", type=int, default=-1)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--auto", action="store_true")
    args = p.parse_args()
    os.chdir(args.out)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    if rank == 0:
        with open("attempts", "a") as f:
            f.write(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '-')} {time.time()}\n")
    ember.seed_everything(7)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=args.workers, persistent_workers=args.workers > 0)
    module = Net(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = ember.Trainer(
        max_epochs=args.epochs,
        strategy="ddp" if world > 1 else "auto",
        devices=world,
        enable_progress_bar=False,
        log_every_n_steps=2,
        callbacks=[ModelCheckpoint(every_n_train_steps=args.every, save_top_k=-1)],
    )
    trainer.fit(module, loader, ckpt_path="auto" if args.auto else None)
    if trainer.is_global_zero:
        torch.save(module.state_dict(), "final.pt")


if __name__ == "__main__":
    main()
