"""Per-step overhead of ember's Trainer over a hand-written PyTorch loop, and import time.

Both loops train the same seeded MLP (32 -> 64 -> 10, batch 64, SGD, one intra-op thread) on the
same pre-built batches, so the difference is what the trainer itself adds per step. Rounds of the
plain loop and of each ember configuration run in a shuffled order, and medians are reported, because this
machine is shared and noisy. Run:

    python benchmarks/overhead.py [--steps 400] [--rounds 7]

With PyTorch Lightning installed (``pip install lightning``), the same work under Lightning's
Trainer (progress bar, per-step ``self.log``, TensorBoard every 50 steps) runs in the same rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
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
    # What turning the simple profiler on costs (off, the default, is "bare").
    "bare+profiler=simple": dict(log=False, trainer=dict(enable_progress_bar=False, logger=False, profiler="simple")),
}


def optional_configs(root: str) -> dict:
    """Configurations that need optional callbacks, when this build has them."""
    extra = {}
    try:
        tb = ember.loggers.TensorBoardLogger
    except AttributeError:
        tb = None
    if tb is not None:
        extra["bar+log+tensorboard"] = dict(
            log=True,
            trainer=dict(enable_progress_bar=True, log_every_n_steps=50, logger_factory=lambda: tb(save_dir=root)),
        )
    if importlib.util.find_spec("lightning") is not None:  # optional: `pip install lightning` to compare
        extra[LIGHTNING] = None
    return extra


LIGHTNING = "Lightning: bar+log+tensorboard"


def run_config(name: str, cfg: dict | None, batches: list, root: str) -> float:
    return lightning_loop(batches, root) if name == LIGHTNING else ember_loop(batches, cfg, root)


def lightning_loop(batches: list, root: str) -> float:
    """The same work under PyTorch Lightning (bar, per-step log, TensorBoard every 50 steps), when installed."""
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    class LitModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    timings: list[float] = []

    class Clock(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            timings.append(time.perf_counter())

        def on_train_epoch_end(self, trainer, module):
            timings.append(time.perf_counter())

    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=50,
        logger=TensorBoardLogger(save_dir=root),
        callbacks=[Clock()],
        default_root_dir=root,
    )
    trainer.fit(LitModule(), _Batches(batches))  # (a bare list would be read as a list of loaders)
    return (timings[1] - timings[0]) / len(batches)


class _Batches:
    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def ember_loop(batches: list, cfg: dict, root: str) -> float:
    kwargs = dict(cfg["trainer"])
    factory = kwargs.pop("logger_factory", None)
    if factory is not None:
        kwargs["logger"] = factory()
    trainer = ember.Trainer(
        max_epochs=1,
        accelerator="cpu",
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **kwargs,
    )
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
                for name, cfg in configs.items():
                    run_config(name, cfg, batches, root)
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
                        results[name].append(run_config(name, configs[name], batches, root))
                    finally:
                        sys.stdout = stdout

    plain = statistics.median(results["plain"])
    print(f"per-step time, median of {args.rounds} rounds x {args.steps} steps (MLP 32-64-10, batch 64, 1 thread)")
    print("  (paired: the median and quartiles of each round's own trainer/plain ratio, a check on the noise)")
    print(f"  {'plain PyTorch loop':32s} {plain * 1e6:8.1f} us   1.000x")
    for name in configs:
        t = statistics.median(results[name])
        ratios = [e / p for e, p in zip(results[name], results["plain"])]
        q1, q2, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        label = name if name == LIGHTNING else "ember " + name
        print(
            f"  {label:32s} {t * 1e6:8.1f} us   {t / plain:.3f}x  (+{(t / plain - 1) * 100:.1f}%)"
            f"   paired +{(q2 - 1) * 100:.1f}% [+{(q1 - 1) * 100:.1f}%, +{(q3 - 1) * 100:.1f}%]"
        )

    t_torch = import_time("import torch", 5)
    t_ember = import_time("import ember", 5)
    line = f"import time, median of 5: torch {t_torch:.3f} s, ember {t_ember:.3f} s (+{t_ember - t_torch:.3f} s)"
    if LIGHTNING in configs:
        t_lightning = import_time("import lightning", 5)
        line += f", lightning {t_lightning:.3f} s (+{t_lightning - t_torch:.3f} s)"
    print(line)


if __name__ == "__main__":
    main()
