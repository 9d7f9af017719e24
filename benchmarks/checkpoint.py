"""Checkpoint save time: ember's atomic, fsynced save of a ~100 MB model vs a bare ``torch.save``.

    python benchmarks/checkpoint.py [--mb 100] [--repeats 5] [--dir DIR]

Measured in one run, interleaved; medians and minima reported (minima are the least noisy).
"bare" is ``torch.save(model.state_dict(), path)``
(no fsync: the data may still be in the page cache when it returns). "ember" is
``trainer.save_checkpoint(path)``: the full training state (SGD without momentum holds no
optimizer tensors, so the bytes written are the same) to a temporary file, fsync, rename, fsync of
the directory. "bare+fsync" shows what durability alone costs. Target: ember <= 1.5x bare.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

# Run from a clone without installing.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import ember  # noqa: E402


class Big(ember.TrainModule):
    def __init__(self, mb: int = 100) -> None:
        super().__init__()
        width = 2048
        rows = mb * 2**20 // 4 // width // 8
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, rows, bias=False) for _ in range(8))
        self.head = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    module = Big(args.mb)
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
    trainer = ember.Trainer(max_steps=1, enable_progress_bar=False, logger=False, enable_checkpointing=False)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(4, 2), torch.randn(4, 1)), batch_size=2))
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        bare_path, ember_path, sync_path = (os.path.join(d, n) for n in ("bare.pt", "ember.ckpt", "sync.pt"))

        def bare() -> None:
            torch.save(module.state_dict(), bare_path)

        def bare_fsync() -> None:
            with open(sync_path, "wb") as f:
                torch.save(module.state_dict(), f)
                f.flush()
                os.fsync(f.fileno())

        def ember_save() -> None:
            trainer.save_checkpoint(ember_path)

        results: dict[str, list[float]] = {"bare torch.save": [], "bare+fsync": [], "ember save_checkpoint": []}
        for fn in (bare, bare_fsync, ember_save):  # warm up: allocate files, fault pages in
            fn()
        for _ in range(args.repeats):
            results["bare torch.save"].append(timed(bare))
            results["bare+fsync"].append(timed(bare_fsync))
            results["ember save_checkpoint"].append(timed(ember_save))
        size = os.path.getsize(ember_path)
    base = statistics.median(results["bare torch.save"])
    print(f"model: {nbytes / 2**20:.1f} MiB of parameters; checkpoint file {size / 2**20:.1f} MiB; "
          f"{args.repeats} repeats")
    best = min(results["bare torch.save"])
    for name, times in results.items():
        med, low = statistics.median(times), min(times)
        print(f"  {name:24s} median {med * 1000:7.1f} ms ({med / base:4.2f}x bare)   "
              f"min {low * 1000:7.1f} ms ({low / best:4.2f}x bare)   {nbytes / 2**20 / med:6.0f} MiB/s")


if __name__ == "__main__":
    main()
