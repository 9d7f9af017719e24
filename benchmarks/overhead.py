"""Per-step overhead of ember's Trainer over a hand-written PyTorch loop, and import time.

Both loops train the same seeded MLP (32 -> 64 -> 10, batch 64, SGD, one intra-op thread) on the
same pre-built batches (``--loader``: a shuffled ``DataLoader`` over the same samples), so the
difference is what the trainer itself adds per step. Rounds of the plain loop and of each ember
configuration run in a shuffled order, and medians are reported, because this machine is shared and
noisy. Run:

    python benchmarks/overhead.py [--steps 400] [--rounds 7] [--loader]

Beside them, "no trainer: module.training_step" is the plain loop calling the benchmark module's own
``training_step`` (a method call, and ``self.net``, which ``nn.Module.__getattr__`` resolves): the part of any
trainer's overhead that is the module's own Python, which a trainer cannot take away.

With PyTorch Lightning installed (``pip install lightning`` or ``pytorch-lightning``), the same work
under Lightning's Trainer (progress bar, per-step ``self.log``, TensorBoard every 50 steps) runs in
the same rounds.

``--metrics N`` measures instead what logging many values costs: each step computes N scalars (one
vector op, then ``unbind``, as a model with several losses and accuracies does) and the trainers log
each with ``self.log(name, v, on_step=True, on_epoch=True)`` (TensorBoard every 50 steps, no bar); the
plain loop computes the same N scalars and keeps an exact epoch mean of each by hand (one in-place add
per value per step), the work the logging needs. Printed: the cost per logged value per step over that
plain loop, and over ember computing the same values but logging none of them.

``--clock cpu`` times with the process's CPU time (all threads) instead of wall time: on a machine shared
with other jobs, time spent waiting for a core is then left out of every loop alike.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import ember

BATCH = 64
#: ``--once``: the batches of the warm-up run before the one counted.
WARM_UP_BATCHES = 20
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = [time.perf_counter]


def clock() -> float:
    """The clock steps are timed with: wall time, or (``--clock cpu``) the CPU time of this process, all its
    threads, which on a shared machine leaves out the time spent waiting for a core."""
    return _clock[0]()


def use_clock(name: str) -> None:
    _clock[0] = CLOCKS[name]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def metric_values(loss: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The N scalars a step logs in ``--metrics N`` (a stand-in for several losses and accuracies)."""
    return (loss.detach() * scales).unbind()


class Module(ember.TrainModule):
    def __init__(self, log: bool, metrics: int = 0, log_metrics: bool = True) -> None:
        super().__init__()
        self.net = make_model()
        self.do_log = log
        self.names = [f"m{i}" for i in range(metrics)]
        self.scales = torch.arange(1.0, metrics + 1)
        self.log_metrics = log_metrics

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.do_log:
            self.log("loss", loss, prog_bar=True)
        if self.names:
            values = metric_values(loss, self.scales)
            if self.log_metrics:
                for name, value in zip(self.names, values):
                    self.log(name, value, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def plain_loop(batches: list) -> float:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = clock()
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (clock() - start) / len(batches)


def module_step_loop(batches: list) -> float:
    """The plain loop calling the benchmark module's ``training_step`` (no trainer): what the module's own Python
    costs (a method call; ``self.net``, which ``nn.Module.__getattr__`` resolves), which any trainer running it
    pays, so that the trainer's own part of its overhead is the rest."""
    module = Module(log=False)
    opt = module.configure_optimizers()
    start = clock()
    for batch_idx, batch in enumerate(batches):
        loss = module.training_step(batch, batch_idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (clock() - start) / len(batches)


def plain_metrics_loop(batches: list, metrics: int) -> float:
    """The plain loop computing the N values of ``--metrics N`` and an exact epoch mean of each (batch-size
    weighted): one in-place add per value per step, what logging them needs at the least."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scales = torch.arange(1.0, metrics + 1)
    totals = [torch.zeros(()) for _ in range(metrics)]
    seen = 0
    start = clock()
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        for total, value in zip(totals, metric_values(loss, scales)):
            total.add_(value, alpha=len(x))
        seen += len(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    means = [t / seen for t in totals]  # noqa: F841 (the epoch means; computing them is the work)
    return (clock() - start) / len(batches)


CONFIGS = {
    "bare": dict(log=False, trainer=dict(enable_progress_bar=False, logger=False)),
    "bar+log": dict(log=True, trainer=dict(enable_progress_bar=True, logger=False, log_every_n_steps=1)),
    # What turning the simple profiler on costs (off, the default, is "bare").
    "bare+profiler=simple": dict(log=False, trainer=dict(enable_progress_bar=False, logger=False, profiler="simple")),
}


def _tensorboard() -> type | None:
    try:
        return ember.loggers.TensorBoardLogger
    except AttributeError:
        return None


def optional_configs(root: str) -> dict:
    """Configurations that need optional callbacks, when this build has them."""
    extra = {}
    tb = _tensorboard()
    if tb is not None:
        extra["bar+log+tensorboard"] = dict(
            log=True,
            trainer=dict(enable_progress_bar=True, log_every_n_steps=50, logger_factory=lambda: tb(save_dir=root)),
        )
    if _lightning_package() is not None:  # optional: `pip install lightning` to compare
        extra[LIGHTNING] = None
    return extra


def metrics_configs(root: str, metrics: int) -> dict:
    """``--metrics N``: ember computing N values per step and logging none or all of them (TensorBoard every 50
    steps, no bar; without the TensorBoard logger in this build, no logger), and Lightning logging them."""
    tb = _tensorboard()
    trainer: dict = dict(enable_progress_bar=False, log_every_n_steps=50)
    if tb is not None:
        trainer["logger_factory"] = lambda: tb(save_dir=root)
    else:
        trainer["logger"] = False
    configs: dict = {
        "logging none": dict(log=False, metrics=metrics, log_metrics=False, trainer=trainer),
        f"logging {metrics} values": dict(log=False, metrics=metrics, trainer=trainer),
    }
    if _lightning_package() is not None:
        configs[LIGHTNING_METRICS] = dict(metrics=metrics)
    return configs


LIGHTNING = "Lightning: bar+log+tensorboard"
MODULE_STEP = "no trainer: module.training_step"
#: ``--once`` only: the plain loop in a process with one more (idle) thread, see ``_idle_thread``.
PLAIN_WITH_A_THREAD = "plain, one idle thread"
LIGHTNING_METRICS = "Lightning: logging N values"


def _lightning_package() -> str | None:
    """The importable name of an installed Lightning (``lightning``, else ``pytorch_lightning``), or None."""
    for name in ("lightning", "pytorch_lightning"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def run_config(name: str, cfg: dict | None, batches: list, root: str) -> float:
    if name == MODULE_STEP:
        return module_step_loop(batches)
    if name == LIGHTNING:
        return lightning_loop(batches, root)
    if name == LIGHTNING_METRICS:
        assert cfg is not None
        return lightning_loop(batches, root, metrics=cfg["metrics"])
    assert cfg is not None
    return ember_loop(batches, cfg, root)


def lightning_loop(batches: list, root: str, metrics: int = 0) -> float:
    """The same work under PyTorch Lightning, when installed: bar, per-step log, TensorBoard every 50 steps;
    with ``metrics``, no bar and N values logged per step (on_step and on_epoch) instead."""
    import importlib

    package = _lightning_package()
    L = importlib.import_module(package if package == "pytorch_lightning" else "lightning.pytorch")
    TensorBoardLogger = L.loggers.TensorBoardLogger
    names = [f"m{i}" for i in range(metrics)]

    class LitModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()
            self.scales = torch.arange(1.0, metrics + 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            if names:
                for name, value in zip(names, metric_values(loss, self.scales)):
                    self.log(name, value, on_step=True, on_epoch=True)
            else:
                self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    timings: list[float] = []

    class Clock(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            timings.append(clock())

        def on_train_epoch_end(self, trainer, module):
            timings.append(clock())

    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=not names,
        num_sanity_val_steps=0,
        log_every_n_steps=50,
        logger=TensorBoardLogger(save_dir=root),
        callbacks=[Clock()],
        default_root_dir=root,
    )
    # (a bare list would be read as a list of loaders)
    trainer.fit(LitModule(), _Batches(batches) if isinstance(batches, list) else batches)
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
    module = Module(cfg["log"], cfg.get("metrics", 0), cfg.get("log_metrics", True))
    timings: list[float] = []

    class Clock(ember.callbacks.Callback):
        # Time the epoch from inside, so Trainer construction and setup are not counted.
        def on_train_epoch_start(self, trainer, module):
            timings.append(clock())

        def on_train_epoch_end(self, trainer, module):
            timings.append(clock())

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


def make_batches(steps: int, loader: bool) -> Any:
    """``steps`` seeded batches: a list, or (``loader``) a shuffled DataLoader over the same samples."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(BATCH, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(steps)]
    if not loader:
        return batches
    dataset = torch.utils.data.TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--loader", action="store_true", help="a shuffled DataLoader instead of a list of batches")
    parser.add_argument("--clock", choices=CLOCKS, default="wall", help="wall time, or this process's CPU time")
    parser.add_argument(
        "--metrics", type=int, default=0, metavar="N", help="time logging N values per step (on_step and on_epoch)"
    )
    parser.add_argument(
        "--once",
        metavar="CONFIG",
        help="run one configuration (plain, bare, bar+log, ...) once and print nothing: what "
        "benchmarks/step_instructions.py counts the instructions of",
    )
    args = parser.parse_args()
    use_clock(args.clock)
    torch.set_num_threads(1)
    batches = make_batches(args.steps, args.loader)
    n = args.metrics
    if args.once is not None:
        run_once(parser, args.once, batches)
        return

    def plain() -> float:
        return plain_metrics_loop(batches, n) if n else plain_loop(batches)

    with tempfile.TemporaryDirectory() as root:
        configs = metrics_configs(root, n) if n else {MODULE_STEP: None, **CONFIGS, **optional_configs(root)}
        plain()  # warm-up
        with _quiet():
            for name, cfg in configs.items():
                run_config(name, cfg, batches, root)
        results: dict[str, list[float]] = {"plain": [], **{k: [] for k in configs}}
        order = ["plain", *configs]
        rng = random.Random(0)
        for _ in range(args.rounds):
            rng.shuffle(order)  # no configuration always runs first (or right after another) in a round
            for name in order:
                if name == "plain":
                    results["plain"].append(plain())
                    continue
                with _quiet():  # the bar's output is not what we time
                    results[name].append(run_config(name, configs[name], batches, root))

    data = "a shuffled DataLoader" if args.loader else "pre-built batches"
    what = f"MLP 32-64-10, batch {BATCH}, 1 thread, {data}, {args.clock} clock"
    if n:
        report_metrics(results, configs, n, args, what)
        return
    plain_t = statistics.median(results["plain"])
    print(f"per-step time, median of {args.rounds} rounds x {args.steps} steps ({what})")
    print("  (paired: the median and quartiles of each round's own trainer/plain ratio, a check on the noise)")
    print(f"  {'plain PyTorch loop':32s} {plain_t * 1e6:8.1f} us   1.000x")
    for name in configs:
        t = statistics.median(results[name])
        q1, q2, q3 = _quartiles([e / p for e, p in zip(results[name], results["plain"])])
        label = name if name in (LIGHTNING, MODULE_STEP) else "ember " + name
        print(
            f"  {label:32s} {t * 1e6:8.1f} us   {t / plain_t:.3f}x  (+{(t / plain_t - 1) * 100:.1f}%)"
            f"   paired +{(q2 - 1) * 100:.1f}% [+{(q1 - 1) * 100:.1f}%, +{(q3 - 1) * 100:.1f}%]"
        )

    t_torch = import_time("import torch", 5)
    # What a script imports (``import ember`` alone is lazy: it imports torch with the first name it is asked for).
    t_ember = import_time("from ember import Trainer, TrainModule", 5)
    line = f"import time, median of 5: torch {t_torch:.3f} s, ember {t_ember:.3f} s ({t_ember - t_torch:+.3f} s)"
    package = _lightning_package()
    if package is not None:
        t_lightning = import_time(f"import {package}", 5)
        line += f", {package} {t_lightning:.3f} s ({t_lightning - t_torch:+.3f} s)"
    print(line)


def run_once(parser: argparse.ArgumentParser, name: str, batches: Any) -> None:
    """``--once NAME``: one run of one configuration, its output (the bar's) thrown away, after a warm-up run
    of a few batches (what a process does once: torch's lazy imports and first-call set-up) and a collection.

    Under ``benchmarks/step_instructions.py`` (``EMBER_CALLGRIND_TOGGLE`` names its helper library), callgrind
    counts only the run: not the imports, the batches' making, the warm-up, or the interpreter's exit."""
    toggle = _callgrind_toggle()
    warm = batches[:WARM_UP_BATCHES] if isinstance(batches, list) else batches
    with tempfile.TemporaryDirectory() as root:
        configs = {MODULE_STEP: None, **CONFIGS, **optional_configs(root)}
        if name not in ("plain", PLAIN_WITH_A_THREAD) and name not in configs:
            parser.error(f"--once {name!r}: not a configuration; known: {['plain', PLAIN_WITH_A_THREAD, *configs]}")

        def run(run_batches: Any) -> None:
            if name in ("plain", PLAIN_WITH_A_THREAD):
                plain_loop(run_batches)
            else:
                run_config(name, configs[name], run_batches, root)

        with _quiet(), _idle_thread(name == PLAIN_WITH_A_THREAD):
            run(warm)
            gc.collect()
            toggle()
            run(batches)
            toggle()


@contextlib.contextmanager
def _idle_thread(start: bool):
    """With ``start``, one more thread, waiting on an event until the end, as a fit has one (ember's preemption
    grace clock, a logger's writer): in a process with more than one thread glibc's ``malloc`` and ``free`` take
    their arena's lock, which a process that never started one skips. A cost of the process, not of the loop
    it runs: timed in one process (``main``), the plain loop pays it too, once any fit has started a thread."""
    if not start:
        yield
        return
    done = threading.Event()
    thread = threading.Thread(target=done.wait, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _callgrind_toggle() -> Callable[[], Any]:
    """Callgrind's "collect or not" switch (``CALLGRIND_TOGGLE_COLLECT``, from the library
    ``EMBER_CALLGRIND_TOGGLE`` names), or a function that does nothing."""
    path = os.environ.get("EMBER_CALLGRIND_TOGGLE")
    if not path:
        return lambda: None
    return ctypes.CDLL(path).ember_callgrind_toggle


@contextlib.contextmanager
def _quiet():
    """Standard output (the progress bar's) goes to the null device inside, and comes back after."""
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


def _quartiles(values: list[float]) -> list[float]:
    return statistics.quantiles(values, n=4) if len(values) > 1 else values * 3


def report_metrics(results: dict[str, list[float]], configs: dict, n: int, args: argparse.Namespace, what: str) -> None:
    """``--metrics N``: per-step times, and the cost per logged value per step over the plain loop (and over
    ember logging none of them), each round's own difference, median [quartiles]."""
    plain_t = statistics.median(results["plain"])
    nothing = results["logging none"]
    print(f"logging {n} values per step (on_step and on_epoch), median of {args.rounds} rounds x {args.steps} steps")
    print(f"  ({what}; TensorBoard every 50 steps, no bar; per value: each round's own difference / {n})")
    print(f"  {'plain loop (N values, epoch means)':36s} {plain_t * 1e6:8.1f} us   1.000x")
    for name in configs:
        t = statistics.median(results[name])
        label = name.replace("N values", f"{n} values") if name == LIGHTNING_METRICS else "ember " + name
        line = f"  {label:36s} {t * 1e6:8.1f} us   {t / plain_t:.3f}x"
        if name != "logging none":
            over_plain = _quartiles([(e - p) / n * 1e6 for e, p in zip(results[name], results["plain"])])
            line += f"   per value over plain {over_plain[1]:6.2f} us [{over_plain[0]:.2f}, {over_plain[2]:.2f}]"
            if name != LIGHTNING_METRICS:
                over_nothing = _quartiles([(e - z) / n * 1e6 for e, z in zip(results[name], nothing)])
                line += f", over ember logging none {over_nothing[1]:.2f} us"
        print(line)


if __name__ == "__main__":
    main()
