"""Step time of ``trainer.fit(torch.compile(module))`` against the same module eager, on the CPU.

Both train the same seeded MLP (256 -> 512 -> 512 -> 10, batch 128, SGD, one intra-op thread) on
the same pre-built batches with a bare Trainer (no logger, no progress bar, no checkpoints). A
callback takes the time between consecutive ``on_train_batch_end`` calls, so the compilation
(paid in one warm-up fit per module, not timed) is left out. Each round fits the eager and the
compiled module once, in a shuffled order, and the reported ratio is the median over rounds of
(compiled median step / eager median step), because this machine is shared and noisy. Run:

    python benchmarks/compile.py [--steps 60] [--rounds 5]

torch.compile's default backend (inductor) needs a C compiler on the CPU.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

import ember
from ember.callbacks import Callback


class Mlp(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(256, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepClock(Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())


def fit_steps(module, batches: list, steps: int) -> float:
    """The median time of one training step over ``steps`` batches (the first interval starts at batch 1)."""
    clock = StepClock()
    trainer = ember.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[clock],
    )
    trainer.fit(module, batches[:steps])
    return statistics.median(b - a for a, b in zip(clock.ends, clock.ends[1:]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(128, 256, generator=g), torch.randint(0, 10, (128,), generator=g)) for _ in range(args.steps)
    ]
    eager, compiled = Mlp(), torch.compile(Mlp())
    start = time.perf_counter()
    fit_steps(compiled, batches, 3)  # compiles forward and training_step; later fits reuse the compiled code
    print(f"compilation (warm-up fit of 3 steps): {time.perf_counter() - start:.1f} s")
    fit_steps(eager, batches, 3)
    ratios, times = [], {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        order = ["eager", "compiled"]
        random.shuffle(order)
        this = {name: fit_steps(eager if name == "eager" else compiled, batches, args.steps) for name in order}
        for name, t in this.items():
            times[name].append(t)
        ratios.append(this["compiled"] / this["eager"])
    for name, ts in times.items():
        print(
            f"{name:>8}: median step {statistics.median(ts) * 1e3:.3f} ms  (rounds: "
            + ", ".join(f"{t * 1e3:.3f}" for t in ts)
            + ")"
        )
    print(
        f"compiled / eager step time: {statistics.median(ratios):.3f}  (median of {args.rounds} paired rounds; "
        f"per round: {', '.join(f'{r:.3f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
