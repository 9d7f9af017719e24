"""ember DataParallel: overhead against the plain module, and 2 CPU replicas against 1.

Each step is zero_grad / forward / cross-entropy / backward / SGD step. Variants run in
interleaved rounds inside one process, so machine noise hits them alike, and the median step
time per variant is reported, with ratios.

1. Overhead: ``DataParallel(model, ["cpu"])`` against the plain module (target: <= 5 %), and
   the per-forward cost of the machinery with 2 replicas of a small and a deep module
   (scatter + replicate + threads + gather), with and without the cached module-tree plan.
2. Scaling: a compute-bound MLP (1024 -> 2048 -> 2048 -> 10, batch 512). One replica with one
   intra-op thread (the plain module under ``torch.set_num_threads(1)``) against two CPU
   replicas with one intra-op thread each (target: >= 1.5x throughput), with the replicas'
   backward in parallel threads (the default) and in one graph (``parallel_backward=False``,
   PyTorch's design). A breakdown shows where the two-replica step spends its time.
3. With CUDA devices: ember's DataParallel against ``torch.nn.DataParallel`` on all GPUs.
4. The Trainer: ``strategy="dp"`` with one device against ``strategy="single"`` (overhead,
   target <= 5 %), and ``dp`` with two CPU replicas against ``single`` with one intra-op thread
   on the compute-bound MLP. Step time is measured by a callback from on_train_batch_start to
   on_train_batch_end (training_step, backward, optimizer step), in interleaved fits.

Run: ``python benchmarks/dp.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a clone without installing

import ember  # noqa: E402
from ember.parallel import data_parallel as dp_module  # noqa: E402
from ember.parallel import parallel_apply as pa_module  # noqa: E402
from ember.parallel.data_parallel import DataParallel  # noqa: E402
from ember.parallel.replicate import Replicator  # noqa: E402


def mlp(sizes: list[int]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Step:
    """One training step of ``model`` (which wraps or is ``params_of``) on a fixed batch."""

    def __init__(
        self, model: nn.Module, params_of: nn.Module, x: torch.Tensor, y: torch.Tensor, threads: int | None = None
    ) -> None:
        self.model, self.x, self.y, self.threads = model, x, y, threads
        self.opt = torch.optim.SGD(params_of.parameters(), lr=1e-4)

    def __call__(self) -> float:
        saved = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            start = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            F.cross_entropy(self.model(self.x), self.y).backward()
            self.opt.step()
            return time.perf_counter() - start
        finally:
            torch.set_num_threads(saved)


def interleaved(variants: dict[str, Callable[[], float]], rounds: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each variant, measured in interleaved rounds."""
    times: dict[str, list[float]] = defaultdict(list)
    for r in range(warmup + rounds):
        for name, fn in variants.items():
            t = fn()
            if r >= warmup:
                times[name].append(t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def timed_call(fn: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def overhead(rounds: int) -> None:
    print("== 1. Overhead of the DataParallel machinery ==")
    model = mlp([512, 1024, 1024, 10])
    x, y = torch.randn(128, 512), torch.randint(0, 10, (128,))
    res = interleaved(
        {
            "plain": Step(model, model, x, y),
            "dp-1": Step(DataParallel(model, ["cpu"]), model, x, y),
        },
        rounds,
    )
    print(f"MLP 512-1024-1024-10, batch 128, {torch.get_num_threads()} threads")
    print(f"  plain module            {res['plain'] * 1e3:8.2f} ms/step")
    print(
        f"  DataParallel, 1 device  {res['dp-1'] * 1e3:8.2f} ms/step   "
        f"overhead {100 * (res['dp-1'] / res['plain'] - 1):+.1f} %  (target <= 5 %)"
    )

    small = nn.Linear(8, 8)
    deep = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU()) for _ in range(60)])
    xs, xd = torch.randn(16, 8), torch.randn(16, 64)
    dp_small, dp_deep = DataParallel(small, ["cpu", "cpu"]), DataParallel(deep, ["cpu", "cpu"])
    cached = Replicator()
    res = interleaved(
        {
            "small-plain": timed_call(lambda: small(xs)),
            "small-dp": timed_call(lambda: dp_small(xs)),
            "deep-plain": timed_call(lambda: deep(xd)),
            "deep-dp": timed_call(lambda: dp_deep(xd)),
            "replicate-cached": timed_call(lambda: cached.replicate(deep, ["cpu", "cpu"], "leaf")),
            "replicate-fresh": timed_call(lambda: Replicator().replicate(deep, ["cpu", "cpu"], "leaf")),
        },
        rounds * 10,
    )
    n_modules = len(list(deep.modules()))
    print("Forward with grad, 2 CPU replicas, microseconds (machinery dominates at this size):")
    print(
        f"  Linear(8, 8), batch 16:       plain {res['small-plain'] * 1e6:7.0f}   "
        f"DataParallel {res['small-dp'] * 1e6:7.0f}"
    )
    print(
        f"  {n_modules}-module MLP, batch 16:     plain {res['deep-plain'] * 1e6:7.0f}   "
        f"DataParallel {res['deep-dp'] * 1e6:7.0f}"
    )
    print(
        f"  replicate {n_modules} modules x 2: cached plan {res['replicate-cached'] * 1e6:7.0f}"
        f"   fresh traversal {res['replicate-fresh'] * 1e6:7.0f}   "
        f"(saved {100 * (1 - res['replicate-cached'] / res['replicate-fresh']):.0f} %)"
    )


class Breakdown:
    """Wall time spent in the DataParallel phases, by patching the module-level functions."""

    PHASES = ("scatter", "replicate", "forward threads", "gather", "backward threads")

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self._undo: list[Callable[[], None]] = []

    def _wrap(self, owner: object, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.total[phase] += time.perf_counter() - start

        setattr(owner, name, wrapper)
        self._undo.append(lambda: setattr(owner, name, original))

    def __enter__(self) -> Breakdown:
        self._wrap(dp_module, "scatter_kwargs", "scatter")
        self._wrap(Replicator, "replicate", "replicate")
        self._wrap(dp_module, "parallel_apply", "forward threads")
        self._wrap(dp_module, "gather", "gather")
        self._wrap(pa_module, "parallel_apply", "backward threads")
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()


def scaling(rounds: int) -> None:
    print("\n== 2. Two CPU replicas vs one, compute-bound, one intra-op thread per replica ==")
    model = mlp([1024, 2048, 2048, 10])
    x, y = torch.randn(512, 1024), torch.randint(0, 10, (512,))
    two = DataParallel(model, ["cpu", "cpu"], threads_per_replica=1)
    serial = DataParallel(model, ["cpu", "cpu"], threads_per_replica=1, parallel_backward=False)
    res = interleaved(
        {
            "one": Step(model, model, x, y, threads=1),
            "two": Step(two, model, x, y, threads=1),
            "two-caller2": Step(two, model, x, y, threads=2),
            "two-serial": Step(serial, model, x, y, threads=1),
        },
        rounds,
    )
    print(
        f"MLP 1024-2048-2048-10 ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters), batch 512, SGD"
    )
    rows = [
        ("one", "1 replica, 1 thread"),
        ("two", "2 replicas, parallel backward (caller 1 thread)"),
        ("two-caller2", "2 replicas, parallel backward (caller 2 threads)"),
        ("two-serial", "2 replicas, one graph: backward serial (caller 1 thread)"),
    ]
    for key, label in rows:
        print(f"  {label:58s} {res[key] * 1e3:7.1f} ms/step   throughput x{res['one'] / res[key]:.2f}")
    print("  (target: 2 replicas >= 1.5x the throughput of 1)")

    steps = max(3, rounds // 2)
    step = Step(two, model, x, y, threads=1)
    step()
    with Breakdown() as bd:
        wall = sum(step() for _ in range(steps))
    accounted = sum(bd.total.values())
    print(f"Where a 2-replica step goes (mean of {steps} steps, {wall / steps * 1e3:.1f} ms):")
    for phase in Breakdown.PHASES:
        print(f"  {phase:18s} {bd.total[phase] / steps * 1e3:7.2f} ms")
    print(
        f"  {'the rest':18s} {(wall - accounted) / steps * 1e3:7.2f} ms  "
        "(loss, summing leaf gradients, optimizer step, thread start-up)"
    )


def cuda(rounds: int) -> None:
    if not torch.cuda.is_available():
        print("\n== 3. vs torch.nn.DataParallel: skipped (no CUDA device) ==")
        return
    n = torch.cuda.device_count()
    print(f"\n== 3. ember vs torch.nn.DataParallel on {n} GPU(s) ==")
    model = mlp([1024, 4096, 4096, 10]).cuda()
    x, y = torch.randn(1024, 1024), torch.randint(0, 10, (1024,)).cuda()
    ids = list(range(n))

    def synced(step: Step) -> Callable[[], float]:
        def run() -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            return time.perf_counter() - start

        return run

    res = interleaved(
        {
            "torch": synced(Step(torch.nn.DataParallel(model, ids), model, x, y)),
            "ember": synced(Step(DataParallel(model, ids), model, x, y)),
        },
        rounds,
    )
    print(f"  torch.nn.DataParallel {res['torch'] * 1e3:8.2f} ms/step")
    print(f"  ember DataParallel    {res['ember'] * 1e3:8.2f} ms/step   ratio {res['ember'] / res['torch']:.2f}")


class _Classifier(ember.TrainModule):
    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.net = mlp(sizes)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class _StepTimer(ember.callbacks.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx > 0:  # the first step of a fit pays for warm-up
            self.times.append(time.perf_counter() - self._start)


def _fit_step_times(
    variants: dict[str, tuple[str, int, int]], sizes: list[int], batch: int, steps: int, rounds: int
) -> dict[str, float]:
    """Median step time per variant: (strategy, devices, caller threads), interleaved fits."""
    g = torch.Generator().manual_seed(0)
    n = batch * steps
    data = torch.utils.data.TensorDataset(
        torch.randn(n, sizes[0], generator=g), torch.randint(0, sizes[-1], (n,), generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    timers = {name: _StepTimer() for name in variants}
    saved = torch.get_num_threads()
    try:
        for _ in range(rounds):
            for name, (strategy, devices, threads) in variants.items():
                torch.set_num_threads(threads)
                trainer = ember.Trainer(
                    strategy=strategy,
                    devices=devices,
                    accelerator="cpu",
                    max_epochs=1,
                    callbacks=[timers[name]],
                    logger=False,
                    enable_progress_bar=False,
                    enable_checkpointing=False,
                )
                trainer.fit(_Classifier(sizes), loader)
    finally:
        torch.set_num_threads(saved)
    return {name: statistics.median(t.times) for name, t in timers.items()}


def trainer(rounds: int) -> None:
    print("\n== 4. The Trainer: strategy='dp' vs strategy='single' ==")
    fits = max(2, rounds // 4)
    threads = torch.get_num_threads()
    res = _fit_step_times(
        {"single": ("single", 1, threads), "dp-1": ("dp", 1, threads)}, [512, 1024, 1024, 10], 128, 12, fits
    )
    print(f"MLP 512-1024-1024-10, batch 128, {threads} threads, median of {fits} x 11 steps")
    print(f"  single              {res['single'] * 1e3:8.2f} ms/step")
    print(
        f"  dp, 1 device        {res['dp-1'] * 1e3:8.2f} ms/step   "
        f"overhead {100 * (res['dp-1'] / res['single'] - 1):+.1f} %  (target <= 5 %)"
    )
    res = _fit_step_times({"single": ("single", 1, 1), "dp-2": ("dp", 2, 1)}, [1024, 2048, 2048, 10], 512, 8, fits)
    print(f"MLP 1024-2048-2048-10, batch 512, one intra-op thread per replica, median of {fits} x 7 steps")
    print(f"  single, 1 thread    {res['single'] * 1e3:8.1f} ms/step")
    print(
        f"  dp, 2 CPU replicas  {res['dp-2'] * 1e3:8.1f} ms/step   "
        f"throughput x{res['single'] / res['dp-2']:.2f}  (target >= 1.5x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="measured rounds per variant")
    parser.add_argument(
        "--only",
        choices=["overhead", "scaling", "cuda", "trainer"],
        action="append",
        help="run only these sections (repeatable)",
    )
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads by default, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (other processes "
        "running on these CPUs distort the ratios)\n"
    )
    sections = (("overhead", overhead), ("scaling", scaling), ("cuda", cuda), ("trainer", trainer))
    for name, section in sections:
        if not args.only or name in args.only:
            section(args.rounds)


if __name__ == "__main__":
    main()
