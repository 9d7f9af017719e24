"""Per-step overhead of ember's Trainer over a hand-written PyTorch loop, and import time.

Both loops train the same seeded MLP (32 -> 64 -> 10, batch 64, SGD, one intra-op thread) on the
same pre-built batches, so the difference is what the trainer itself adds per step. Rounds of the
plain loop and of each ember configuration run in a shuffled order, and medians are reported, because this
machine is shared and noisy. Run:

    python benchmarks/overhead.py [--steps 400] [--rounds 7]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import ember


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


class Module(ember.TrainModule):
    def __init__(self, log: bool) -> None:
        super().__init__()
        self.net = make_model()
        self.do_log = log

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.do_log:
            self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def plain_loop(batches: list) -> float:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = time.perf_counter()
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - start) / len(batches)


CONFIGS = {
    "bare": dict(log=False, trainer=dict(enable_progress_bar=False, logger=False)),
    "bar+log": dict(log=True, trainer=dict(enable_progress_bar=True, logger=False, log_every_n_steps=1)),
}


def optional_configs(root: str) -> dict:
    """Configurations that need optional callbacks, when this build has them."""
    extra = {}
    try:
        tb = ember.callbacks.TensorBoardLogger
    except AttributeError:
        tb = None
    if tb is not None:
        extra["bar+log+tensorboard"] = dict(log=True, trainer=dict(enable_progress_bar=True, log_every_n_steps=50,
                                                                    logger_factory=lambda: tb(save_dir=root)))
    return extra


def ember_loop(batches: list, cfg: dict, root: str) -> float:
    kwargs = dict(cfg["trainer"])
    factory = kwargs.pop("logger_factory", None)
    if factory is not None:
        kwargs["logger"] = factory()
    trainer = ember.Trainer(max_epochs=1, accelerator="cpu", enable_checkpointing=False, num_sanity_val_steps=0,
                            default_root_dir=root, **kwargs)
    module = Module(cfg["log"])
    timings: list[float] = []

    class Clock(ember.callbacks.Callback):
        # Time the epoch from inside, so Trainer construction and setup are not counted.
        def on_train_epoch_start(self, trainer, module):
            timings.append(time.perf_counter())

        def on_train_epoch_end(self, trainer, module):
            timings.append(time.perf_counter())

    trainer.callbacks.append(Clock())
    trainer.fit(module, batches)
    return (timings[1] - timings[0]) / len(batches)


def import_time(stmt: str, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", stmt], check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(args.steps)]

    with tempfile.TemporaryDirectory() as root:
        configs = {**CONFIGS, **optional_configs(root)}
        stdout = sys.stdout
        plain_loop(batches)  # warm-up
        with open(os.devnull, "w") as devnull:
            sys.stdout = devnull
            try:
                for cfg in configs.values():
                    ember_loop(batches, cfg, root)
            finally:
                sys.stdout = stdout
        results: dict[str, list[float]] = {"plain": [], **{k: [] for k in configs}}
        order = ["plain", *configs]
        rng = random.Random(0)
        for _ in range(args.rounds):
            rng.shuffle(order)  # no configuration always runs first (or right after another) in a round
            for name in order:
                if name == "plain":
                    results["plain"].append(plain_loop(batches))
                    continue
                with open(os.devnull, "w") as devnull:  # the bar's output is not what we time
                    sys.stdout = devnull
                    try:
                        results[name].append(ember_loop(batches, configs[name], root))
                    finally:
                        sys.stdout = stdout

    plain = statistics.median(results["plain"])
    print(f"per-step time, median of {args.rounds} rounds x {args.steps} steps (MLP 32-64-10, batch 64, 1 thread)")
    print("  (paired: the median and quartiles of each round's own ember/plain ratio, a check on the noise)")
    print(f"  {'plain PyTorch loop':28s} {plain * 1e6:8.1f} us   1.000x")
    for name in configs:
        t = statistics.median(results[name])
        ratios = [e / p for e, p in zip(results[name], results["plain"])]
        q1, q2, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(f"  {'ember ' + name:28s} {t * 1e6:8.1f} us   {t / plain:.3f}x  (+{(t / plain - 1) * 100:.1f}%)"
              f"   paired +{(q2 - 1) * 100:.1f}% [+{(q1 - 1) * 100:.1f}%, +{(q3 - 1) * 100:.1f}%]")

    t_torch = import_time("import torch", 5)
    t_ember = import_time("import ember", 5)
    print(f"import time, median of 5: torch {t_torch:.3f} s, ember {t_ember:.3f} s (+{t_ember - t_torch:.3f} s)")


if __name__ == "__main__":
    main()
