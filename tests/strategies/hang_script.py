"""A training script that hangs or dawdles on purpose, run as a real program by the watchdog and
SIGTERM-grace tests (``python hang_script.py ...`` in a fresh directory: default logger, checkpoints
and progress bar).

- ``--hang-rank r --hang-step s``: rank ``r`` sleeps for good in ``training_step`` at batch ``s``,
  after writing ``<out>/hanging<r>`` so a test knows when the hang has begun. With ``--hang-in-loader``
  the sleep is in one of rank ``r``'s two DataLoader workers instead, fetching batch ``s``'s samples: the
  rank waits for that batch for good.
- ``--slow-rank r --slow SECONDS[,SECONDS...]``: rank ``r``'s steps sleep that long (the last value
  repeats), so the other ranks wait for it in every gradient all-reduce.
- ``--timeout``, ``--watchdog`` (seconds, or ``none``), ``--grace``, ``--start-method``:
  DDPStrategy(timeout=..., watchdog_timeout=..., start_method=...) and ``trainer.preemption_grace``.

Every rank writes ``<out>/pid<r>`` when fit starts, and ``<out>/done<r>`` (JSON: the watchdog's
last deadline and slowest step) when fit returns.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.strategies import DDPStrategy

atexit.register(gc.freeze)  # end without the shutdown garbage collection: see tests/conftest.py


class StuckInWorker(torch.utils.data.Dataset):
    """A dataset whose samples of one batch never come, on one rank (in a loader worker, as a stuck read)."""

    def __init__(self, data: TensorDataset, args: argparse.Namespace, rank: int) -> None:
        self.data, self.args, self.rank = data, args, rank

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        a = self.args
        if self.rank == a.hang_rank and i // 2 == a.hang_step:  # batch_size 2, in order
            with open(os.path.join(a.out, f"hanging{self.rank}"), "w"):
                pass
            while True:
                time.sleep(3600)
        return self.data[i]


class Net(ember.TrainModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.args = args

    def on_fit_start(self) -> None:
        with open(os.path.join(self.args.out, f"pid{self.global_rank}"), "w") as f:
            f.write(str(os.getpid()))

    def training_step(self, batch, batch_idx):
        a = self.args
        if self.global_rank == a.hang_rank and batch_idx == a.hang_step and not a.hang_in_loader:
            with open(os.path.join(a.out, f"hanging{self.global_rank}"), "w"):
                pass
            while True:
                time.sleep(3600)  # the hang: a stuck read, a lost lock, ...
        if self.global_rank == a.slow_rank:
            time.sleep(a.slow[min(batch_idx, len(a.slow) - 1)])
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-step", type=int, default=3)
    parser.add_argument("--hang-in-loader", action="store_true")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow", type=lambda v: [float(s) for s in v.split(",")], default=[0.0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--watchdog", default=None)
    parser.add_argument("--grace", type=float, default=None)
    parser.add_argument("--start-method", default="popen", help="popen (ddp) or spawn (ddp_spawn)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    options = {"start_method": args.start_method}
    if args.timeout is not None:
        options["timeout"] = args.timeout
    if args.watchdog is not None:
        options["watchdog_timeout"] = None if args.watchdog == "none" else float(args.watchdog)
    strategy = DDPStrategy(**options) if args.devices > 1 else "auto"
    trainer = ember.Trainer(
        strategy=strategy, devices=args.devices, accelerator="cpu", max_epochs=1, log_every_n_steps=1
    )
    if args.grace is not None:
        trainer.preemption_grace = args.grace
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(args.steps * args.devices * 2, 4, generator=g),
        torch.randn(args.steps * args.devices * 2, 2, generator=g),
    )
    module = Net(args)
    if args.hang_in_loader:
        rank = int(os.environ.get("RANK", "0"))  # the script's own copy per rank (ddp re-runs it)
        loader = DataLoader(StuckInWorker(data, args, rank), batch_size=2, num_workers=2)
    else:
        loader = DataLoader(data, batch_size=2)
    trainer.fit(module, loader)
    watchdog = getattr(trainer.strategy, "watchdog", None)
    with open(os.path.join(args.out, f"done{trainer.global_rank}"), "w") as f:
        json.dump(
            {"deadline": getattr(watchdog, "deadline", None), "slowest_step": getattr(watchdog, "slowest_step", None)},
            f,
        )


if __name__ == "__main__":
    main()
