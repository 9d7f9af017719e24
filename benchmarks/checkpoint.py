"""Checkpoint save time: ember's atomic, fsynced save of a ~100 MB model vs a bare ``torch.save``;
and (``--mode background``) what ``ModelCheckpoint(async_save=True)`` saves of training time.

    python benchmarks/checkpoint.py [--mb 100] [--repeats 11] [--dir DIR]
    python benchmarks/checkpoint.py --mode background [--mb 100] [--rounds 7] [--steps 6] [--step-ms 1000]
                                    [--step cpu|sleep]

``--mode save`` (default). Measured in one run, interleaved; medians and minima reported (minima are
the least noisy). "bare" is ``torch.save(model.state_dict(), path)``
(no fsync: the data may still be in the page cache when it returns). "ember" is
``trainer.save_checkpoint(path)``: the full training state (SGD without momentum holds no
optimizer tensors, so the bytes written are the same) to a temporary file, fsync, rename, fsync of
the directory. "bare+fsync" shows what durability alone costs. Target: ember <= 1.5x bare.

``--mode background``. Paired rounds, each running three fits of the same ~100 MiB module in an
order that alternates between rounds: no checkpoints; ``ModelCheckpoint(every_n_train_steps=1)``;
the same with ``async_save=True``. The stall is the time a save keeps the training thread:
ModelCheckpoint's step-boundary hook (for a synchronous save the whole write, for a background one
the copy of the state) plus what the step after it takes beyond a step of a fit without saves (a
background write holds the GIL in torch's serialiser for part of its time, and needs a core). The
first save of a fit, which allocates the copy buffers, and the last are left out. A step is
``--step-ms`` of CPU work on one thread (``--step cpu``: the other core is left to the writer; the
work is a fixed number of matrix products, so a step that loses CPU time to the writer takes
longer) or a sleep (``--step sleep``: a host waiting for device compute), chosen longer than one
write so a save never waits for the previous one. On a loaded machine a write can outlast a step
anyway: the hook's time is also shown without its wait for the previous write (for a background
save, making the checkpoint and copying it; every byte is copied before the hook returns).
Targets: background stall <= 10% of the synchronous stall (median over rounds of the per-round
median ratio), and fit time with a background save every step <= 1.2x the fit time without saves.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
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
    parser.add_argument("--mode", choices=("save", "background"), default="save")
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--rounds", type=int, default=7, help="background: paired rounds")
    parser.add_argument("--steps", type=int, default=6, help="background: timed steps per fit")
    parser.add_argument("--step-ms", type=float, default=1000.0, help="background: the length of a step")
    parser.add_argument(
        "--step",
        choices=("cpu", "sleep"),
        default="cpu",
        help="background: a step is CPU work on one thread, or a sleep (device compute)",
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.mode == "background":
        background(args)
        return
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
    print(
        f"model: {nbytes / 2**20:.1f} MiB of parameters; checkpoint file {size / 2**20:.1f} MiB; {args.repeats} repeats"
    )
    best = min(results["bare torch.save"])
    for name, times in results.items():
        med, low = statistics.median(times), min(times)
        print(
            f"  {name:24s} median {med * 1000:7.1f} ms ({med / base:4.2f}x bare)   "
            f"min {low * 1000:7.1f} ms ({low / best:4.2f}x bare)   {nbytes / 2**20 / med:6.0f} MiB/s"
        )


# ---------------------------------------------------------------------------------------------- background
class Stepping(Big):
    """``Big`` whose training step does a fixed amount of CPU work (``calibrate`` sizes it), or sleeps
    ``sleep_s`` (the host waiting for device compute)."""

    def __init__(self, mb: int, iterations: int, sleep_s: float = 0.0) -> None:
        super().__init__(mb)
        self.iterations, self.sleep_s = iterations, sleep_s
        self.work = torch.randn(192, 192)  # a plain attribute, not state: not in the checkpoint

    def training_step(self, batch, batch_idx):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        else:
            busy(self.work, self.iterations)
        return super().training_step(batch, batch_idx)


def busy(work: torch.Tensor, iterations: int) -> None:
    # Into preallocated tensors: a step's time then does not depend on how fast the allocator gets
    # fresh pages while the kernel is busy with 100 MiB files (that would slow the steps after a
    # synchronous save as much as those during a background one).
    x, y = work.clone(), torch.empty_like(work)
    for _ in range(iterations):
        torch.matmul(x, work, out=y)
        torch.tanh(y, out=x)


def calibrate(step_ms: float) -> int:
    """Iterations of ``busy`` taking about ``step_ms`` on this machine now (the fastest of a few tries)."""
    work = torch.randn(192, 192)
    per = min(timed(lambda: busy(work, 200)) for _ in range(5)) / 200
    return max(1, round(step_ms / 1000 / per))


class StepClock(ember.callbacks.Callback):
    """Records each training step's time (batch start to batch end) and each step-boundary hook's
    time of ModelCheckpoint (``checkpoint``, None for a fit without one) in a list per fit; and, in
    ``own``, the part of that hook which is not waiting for the previous background write (making the
    checkpoint and copying it; a synchronous save's whole write)."""

    def __init__(self, checkpoint: ember.callbacks.ModelCheckpoint | None) -> None:
        self.steps: list[float] = []
        self.saves: list[float] = []
        self.own: list[float] = []
        self._t0 = 0.0
        self._waited = 0.0
        if checkpoint is not None:
            inner = checkpoint.on_train_step_boundary
            writer = checkpoint.background_writer
            if writer is not None:
                inner_wait = writer.wait

                def timed_wait(*args, **kwargs):
                    t0 = time.perf_counter()
                    try:
                        return inner_wait(*args, **kwargs)
                    finally:
                        self._waited += time.perf_counter() - t0

                writer.wait = timed_wait  # type: ignore[method-assign]

            def timed_boundary(trainer, module) -> None:
                self._waited = 0.0
                t0 = time.perf_counter()
                inner(trainer, module)
                self.saves.append(time.perf_counter() - t0)
                self.own.append(self.saves[-1] - self._waited)

            checkpoint.on_train_step_boundary = timed_boundary  # type: ignore[method-assign]

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.steps.append(time.perf_counter() - self._t0)


def background(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the training thread's work on one core; the other core writes
    iterations = calibrate(args.step_ms) if args.step == "cpu" else 0
    steps = args.steps + 2  # the first save (it allocates the copy buffers) and the last step are not timed
    data = DataLoader(TensorDataset(torch.randn(2 * steps, 2), torch.randn(2 * steps, 1)), batch_size=2)
    module = Stepping(args.mb, iterations, args.step_ms / 1000 if args.step == "sleep" else 0.0)
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters())

    def fit(kind: str, root: str) -> tuple[float, StepClock]:
        directory = tempfile.mkdtemp(dir=root)  # each fit writes into a directory of its own
        cb = (
            None
            if kind == "none"
            else ember.callbacks.ModelCheckpoint(
                dirpath=directory, every_n_train_steps=1, async_save=kind == "background"
            )
        )
        clock = StepClock(cb)
        trainer = ember.Trainer(
            max_steps=steps,
            enable_progress_bar=False,
            logger=False,
            num_sanity_val_steps=0,
            default_root_dir=directory,
            enable_checkpointing=cb is not None,
            callbacks=[clock] + ([cb] if cb is not None else []),
            enable_model_summary=False,
        )
        with contextlib.redirect_stdout(io.StringIO()):  # the fit's summary line
            t0 = time.perf_counter()
            trainer.fit(module, data)
            elapsed = time.perf_counter() - t0
        shutil.rmtree(directory)
        return elapsed, clock

    med = statistics.median
    kinds = ["none", "synchronous", "background"]
    fits: dict[str, list[float]] = {k: [] for k in kinds}
    held: dict[str, list[float]] = {k: [] for k in kinds[1:]}  # the save's own hook
    own: dict[str, list[float]] = {k: [] for k in kinds[1:]}  # the hook less waiting for the previous write
    stall: dict[str, list[float]] = {k: [] for k in kinds[1:]}  # hook + what the next step lost
    stall_ratio, time_ratio = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for kind in kinds:  # warm up: files exist, pages are faulted in
            fit(kind, root)
        for r in range(args.rounds):
            order = kinds if r % 2 == 0 else kinds[::-1]
            got = {kind: fit(kind, root) for kind in order}
            step = med(got["none"][1].steps[1:])  # a step without saves, this round
            for kind in kinds:
                fits[kind].append(got[kind][0])
            for kind in kinds[1:]:
                c = got[kind][1]
                held[kind].append(med(c.saves[1:-1]))
                own[kind].append(med(c.own[1:-1]))
                # A background write runs during the next step: what that step takes beyond a step
                # without saves (waiting for the GIL or a core) is part of the save's stall.
                stall[kind].append(med(c.saves[i] + c.steps[i + 1] for i in range(1, len(c.saves) - 1)) - step)
            stall_ratio.append(stall["background"][-1] / stall["synchronous"][-1])
            time_ratio.append(fits["background"][-1] / fits["none"][-1])
            print(
                f"  round {r}: stall sync {stall['synchronous'][-1] * 1000:6.1f} ms, background "
                f"{stall['background'][-1] * 1000:6.1f} ms (held {held['background'][-1] * 1000:5.1f} ms) "
                f"({stall_ratio[-1]:.3f}x); fit none {fits['none'][-1]:5.2f} s, sync "
                f"{fits['synchronous'][-1]:5.2f} s, background {fits['background'][-1]:5.2f} s "
                f"({time_ratio[-1]:.3f}x)",
                flush=True,
            )
    step_s = med(fits["none"]) / steps
    print(
        f"model: {nbytes / 2**20:.1f} MiB of parameters; {args.rounds} paired rounds of {steps} steps "
        f"({args.steps} saves timed per fit), a step = {step_s * 1000:.0f} ms of "
        f"{'CPU work on one thread' if args.step == 'cpu' else 'sleep'}"
    )
    print(
        f"  stall per save (hook + next step's loss)  synchronous {med(stall['synchronous']) * 1000:7.1f} ms   "
        f"background {med(stall['background']) * 1000:6.1f} ms   ratio (median of rounds) "
        f"{med(stall_ratio):.3f}   target <= 0.10"
    )
    print(
        f"  time a save holds the step boundary      synchronous {med(held['synchronous']) * 1000:7.1f} ms   "
        f"background {med(held['background']) * 1000:6.1f} ms"
    )
    print(
        f"    of which not waiting for the previous write  synchronous {med(own['synchronous']) * 1000:7.1f} ms   "
        f"background {med(own['background']) * 1000:6.1f} ms (making the checkpoint and copying it)"
    )
    print(
        f"  fit of {steps} steps      no saves {med(fits['none']):6.2f} s   save every step: synchronous "
        f"{med(fits['synchronous']):6.2f} s, background {med(fits['background']):6.2f} s   "
        f"background / no saves (median of rounds) {med(time_ratio):.3f}   target <= 1.2"
    )
    write = med(held["synchronous"])
    print(
        f"  the write ({write * 1000:.0f} ms, a synchronous save) is "
        f"{'shorter' if write < step_s else 'LONGER'} than a step ({step_s * 1000:.0f} ms)"
    )


if __name__ == "__main__":
    main()
