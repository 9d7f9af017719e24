"""Per-step time on one GPU: a plain CUDA loop against ember's Trainer (and Lightning's, if installed).

Two models, because a trainer's cost shows differently on each:

- GPU-bound: a small ResNet (3 stages of 2 basic blocks, 32/64/128 channels, channels_last) on
  random 32x32 images, batch 256, ``bf16-mixed`` autocast: the trainer's per-step Python work
  should hide behind the GPU's queue, so ember should cost ~0 %.
- Launch-bound: the tiny MLP (32 -> 64 -> 10, batch 64, float32): each step is a few tiny kernels,
  so the CPU-side cost of every step (and any host-device synchronisation, which drains the
  queue) shows in full.

Configurations, in the same interleaved rounds (shuffled order per round, medians, and each
round's own ratio to the plain loop as a check on noise):

- ``plain``: the hand-written loop (batches copied with ``non_blocking`` from pinned memory).
- ``ember bare``: no bar, no logger, no checkpointing.
- ``ember bar+log+tb``: tqdm bar (written to /dev/null), ``self.log(..., prog_bar=True)`` every step,
  TensorBoard every 50 steps.
- ``Lightning bar+log+tb``: the same under Lightning (``lightning`` or ``pytorch_lightning``).
- On the ResNet, ``ember dp x2 on GPU 0`` against ``ember dp x1``: ember's dp with two replicas on
  the one GPU (supported; see docs/strategies.md) against one replica.

Each fit's time is measured inside the fit, from the first batch start to the last batch end
(with ``torch.cuda.synchronize()`` at both ends), so construction and setup are not counted.

Run: ``python benchmarks/gpu.py`` (about 90 s on an H200; ``--quick`` about 30 s).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a clone without installing

import ember  # noqa: E402
from ember.callbacks import Callback, ProgressBar  # noqa: E402
from ember.loggers import TensorBoardLogger
from ember.strategies.dp import DataParallelStrategy  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Models and data
# ---------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


def resnet() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()]
    cin = 32
    for cout, stride in ((32, 1), (64, 2), (128, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)]
    return nn.Sequential(*layers).to(memory_format=torch.channels_last)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


class Workload:
    """One model, its batches (pinned CPU tensors, as a pin_memory loader gives) and precision."""

    def __init__(
        self, name: str, make: Callable[[], nn.Module], shape: tuple[int, ...], steps: int, precision: str
    ) -> None:
        self.name, self.make, self.precision = name, make, precision
        g = torch.Generator().manual_seed(0)
        self.batches = [
            (torch.randn(*shape, generator=g).pin_memory(), torch.randint(0, 10, (shape[0],), generator=g).pin_memory())
            for _ in range(steps)
        ]
        self.autocast = torch.bfloat16 if precision == "bf16-mixed" else None


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


# ---------------------------------------------------------------------------------------------
# The contenders
# ---------------------------------------------------------------------------------------------
def plain_loop(w: Workload, root: str) -> float:
    model = w.make().cuda()
    opt = _optimizer(model.parameters())
    torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in w.batches:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        if x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=w.autocast or torch.float32, enabled=w.autocast is not None):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / len(w.batches)


class Module(ember.TrainModule):
    def __init__(self, make: Callable[[], nn.Module], log: bool) -> None:
        super().__init__()
        self.net = make()
        self.do_log = log

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        loss = F.cross_entropy(self.net(x), y)
        if self.do_log:
            self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _optimizer(self.parameters())


class _Clock:
    """From the first batch start to the last batch end, with the GPU drained at both ends."""

    def __init__(self, steps: int) -> None:
        self.steps, self.t0, self.t1 = steps, 0.0, 0.0

    def start(self, batch_idx: int) -> None:
        if batch_idx == 0:
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

    def end(self, batch_idx: int) -> None:
        if batch_idx == self.steps - 1:
            torch.cuda.synchronize()
            self.t1 = time.perf_counter()

    def per_step(self) -> float:
        return (self.t1 - self.t0) / self.steps


class _Batches:
    """The pre-built batches as a sized iterable (a bare list would be read as a list of loaders)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def ember_fit(w: Workload, root: str, *, full: bool, replicas: int = 0) -> float:
    clock = _Clock(len(w.batches))

    class Clock(Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            clock.start(batch_idx)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            clock.end(batch_idx)

    callbacks: list[Callback] = [Clock()]
    kwargs: dict[str, Any] = dict(enable_progress_bar=False, logger=False)
    if full:
        devnull = open(os.devnull, "w")  # noqa: SIM115 - closed with the fit below
        callbacks.append(ProgressBar(mode="bar", stream=devnull))
        kwargs = dict(enable_progress_bar=True, logger=TensorBoardLogger(save_dir=root), log_every_n_steps=50)
    if replicas:
        kwargs["strategy"] = DataParallelStrategy(devices=[torch.device("cuda", 0)] * replicas)
    trainer = ember.Trainer(
        max_epochs=1,
        accelerator="cuda",
        devices=1,
        precision=w.precision,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=callbacks,
        **kwargs,
    )
    try:
        trainer.fit(Module(w.make, log=full), _Batches(w.batches))
    finally:
        if full:
            devnull.close()
    return clock.per_step()


def lightning_module() -> Any:
    """Lightning's package, whichever name is installed, or None."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            return importlib.import_module(name)
    return None


def lightning_tensorboard(root: str) -> Any:
    L = lightning_module()
    return importlib.import_module(L.__name__ + ".loggers").TensorBoardLogger(save_dir=root)


def lightning_fit(w: Workload, root: str) -> float:
    L = lightning_module()
    clock = _Clock(len(w.batches))

    class LitModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = w.make()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _optimizer(self.parameters())

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            clock.start(batch_idx)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            clock.end(batch_idx)

    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cuda",
        devices=1,
        precision=w.precision,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=50,
        logger=lightning_tensorboard(root),
        callbacks=[Clock()],
        default_root_dir=root,
    )
    trainer.fit(LitModule(), _Batches(w.batches))
    return clock.per_step()


# ---------------------------------------------------------------------------------------------
# Rounds
# ---------------------------------------------------------------------------------------------
def contenders(w: Workload, with_dp: bool) -> dict[str, Callable[[Workload, str], float]]:
    out: dict[str, Callable[[Workload, str], float]] = {
        "plain": plain_loop,
        "ember bare": lambda w_, r: ember_fit(w_, r, full=False),
        "ember bar+log+tb": lambda w_, r: ember_fit(w_, r, full=True),
    }
    if lightning_module() is not None:
        out["Lightning bar+log+tb"] = lightning_fit
    if with_dp:
        out["ember dp x1"] = lambda w_, r: ember_fit(w_, r, full=False, replicas=1)
        out["ember dp x2 on GPU 0"] = lambda w_, r: ember_fit(w_, r, full=False, replicas=2)
    return out


@contextlib.contextmanager
def quiet() -> Any:
    """Trainer output (summaries, bars, Lightning's banners) away from the report."""
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        yield


def measure(
    runs: dict[str, Callable[[Workload, str], float]], w: Workload, rounds: int, root: str
) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            with quiet():
                results[name].append(runs[name](w, root))
    return results


def warm_up(w: Workload, with_dp: bool, root: str) -> tuple[dict[str, Callable[[Workload, str], float]], list[str]]:
    """Run every contender once (cuDNN's choices, kernels, allocator pools); drop those that fail.

    A contender that fails (Lightning missing a piece, say) is reported and left out, so that one
    failure does not cost the rest of a scarce GPU session.
    """
    runs, failed = contenders(w, with_dp), []
    for name, fn in list(runs.items()):
        try:
            with quiet():
                fn(w, root)
        except Exception as exc:  # noqa: BLE001 - reported, the other contenders still run
            failed.append(f"  {name:24s} FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            if name == "plain":
                raise
            del runs[name]
    return runs, failed


def report(w: Workload, results: dict[str, list[float]], rounds: int) -> list[str]:
    plain = statistics.median(results["plain"])
    lines = [f"{w.name}: per-step time, median of {rounds} rounds x {len(w.batches)} steps ({w.precision})"]
    for name, times in results.items():
        t = statistics.median(times)
        against = "ember dp x1" if name == "ember dp x2 on GPU 0" and "ember dp x1" in results else "plain"
        ratios = sorted(a / b for a, b in zip(times, results[against]))
        vs = "vs dp x1" if against != "plain" else "vs plain"
        paired = statistics.median(ratios)
        lines.append(
            f"  {name:24s} {t * 1e3:8.3f} ms  {t / plain:6.3f}x plain   paired {vs} {paired:6.3f}x "
            f"[{ratios[0]:.3f}, {ratios[-1]:.3f}]"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--resnet-steps", type=int, default=60)
    parser.add_argument("--mlp-steps", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="3 rounds of fewer steps (a smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py needs a CUDA GPU, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}). Run it on a GPU machine.",
            file=sys.stderr,
        )
        return 2
    if args.quick:
        args.rounds, args.resnet_steps, args.mlp_steps = 3, 30, 150
    torch.backends.cudnn.benchmark = True
    torch.cuda.set_device(0)
    print(
        f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
        f"Lightning: {getattr(lightning_module(), '__version__', 'not installed')}"
    )
    workloads = [
        (
            Workload(
                "ResNet (GPU-bound), 32x32 images, batch 256", resnet, (256, 3, 32, 32), args.resnet_steps, "bf16-mixed"
            ),
            True,
        ),
        (Workload("MLP 32-64-10 (launch-bound), batch 64", mlp, (64, 32), args.mlp_steps, "32-true"), False),
    ]
    with tempfile.TemporaryDirectory() as root:
        for w, with_dp in workloads:
            start = time.perf_counter()
            runs, failed = warm_up(w, with_dp, root)
            results = measure(runs, w, args.rounds, root)
            print("\n".join(report(w, results, args.rounds) + failed))
            print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
