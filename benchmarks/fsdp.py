"""ember's ``fsdp`` strategy against a hand-written FSDP2 loop: step time, and what each rank holds.

Both variants shard the same model the same way on the same ranks (2 gloo ranks on CPU by default, one
compute thread each): ``--blocks`` blocks of ``Linear(d, d) + GELU`` and a linear head, each block an FSDP
unit and the root one more (ember: ``FSDPStrategy(auto_wrap_policy={Block})``; by hand: ``fully_shard`` on
each block, then on the model), AdamW, a per-rank batch of ``--batch`` rows. A step is zero_grad / forward /
MSE / backward / optimizer step.

Step time: the variants run in the same ranks in interleaved rounds (the order flips every round), each
round a fresh model and ``--steps`` steps per variant; a step's time is the time between two batch starts
(ember: ``on_train_batch_start``, so the Trainer's whole loop counts), the round's median, slower rank.
Reported: each variant's median over rounds and the median of the per-round ratios ember / hand.

Memory: the bytes each rank holds of the parameters, gradients and optimizer states after a step, against
one process holding the whole model (``world`` times the shard, less the rounding of uneven rows). With
``--memory``, instead: the peak RSS growth of a short fit (the model built in ``configure_model`` under
``trainer.init_module(empty_init=True)``), one process on the whole batch against the larger fsdp rank, each
in fresh processes after a warm-up fit that imports what a fit needs.

Run: ``python benchmarks/fsdp.py`` and ``python benchmarks/fsdp.py --memory --d 2048`` (``--help``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a clone without installing

import ember  # noqa: E402
from ember.strategies.fsdp import FSDPStrategy  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(x))


class Model(ember.TrainModule):
    def __init__(self, d: int, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(Block(d) for _ in range(blocks)))
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepClock(ember.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    return {
        "parameters": sum(local(p).nbytes for p in params),
        "gradients": sum(local(p.grad).nbytes for p in params if p.grad is not None),
        "optimizer states": sum(local(v).nbytes for v in states),
    }


def ember_round(args: argparse.Namespace, world: int) -> tuple[float, dict[str, int]]:
    model = Model(args.d, args.blocks)
    clock = StepClock()
    strategy = FSDPStrategy(auto_wrap_policy={Block})
    trainer = fit_once(model, args.d, strategy, world, args.batch, args.steps + 1, [clock])
    times = [b - a for a, b in zip(clock.starts, clock.starts[1:])]
    return statistics.median(times), held_bytes(model, trainer.optimizers[0])


def fit_once(
    model: Any, d: int, strategy: Any, world: int, batch: int, steps: int, callbacks: Any = ()
) -> ember.Trainer:
    """A quiet one-epoch fit of ``steps`` steps of ``batch`` random rows of width ``d`` per rank."""
    n = world * batch * steps
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, d, generator=g), torch.randn(n, 8, generator=g))
    trainer = ember.Trainer(
        strategy=strategy,
        devices=world,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(model, DataLoader(data, batch_size=batch))
    return trainer


def hand_round(args: argparse.Namespace, world: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Model(args.d, args.blocks)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.batch, args.d, generator=g), torch.randn(args.batch, 8, generator=g))]
    starts = []
    for _ in range(args.steps + 1):
        starts.append(time.perf_counter())
        x, y = batches[0]
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    times = [b - a for a, b in zip(starts, starts[1:])]
    return statistics.median(times)


class LazyModel(Model):
    """``Model`` built in ``configure_model`` under ``init_module(empty_init=True)``: no rank holds it whole."""

    def __init__(self, d: int, blocks: int) -> None:
        ember.TrainModule.__init__(self)
        self.d, self.n_blocks = d, blocks

    def configure_model(self) -> None:
        if not hasattr(self, "blocks"):
            with self.trainer.init_module(empty_init=True):
                self.blocks = nn.Sequential(*(Block(self.d) for _ in range(self.n_blocks)))
                self.head = nn.Linear(self.d, 8)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def memory_fit(args: argparse.Namespace, world: int, strategy: Any, batch: int) -> dict[str, float]:
    """Peak RSS growth of one fit of ``--memory-steps`` steps, over the RSS just before it (after a warm-up fit
    of a tiny model that imports what the fit needs)."""

    fit_once(LazyModel(16, 1), 16, strategy(), world, batch, 1)
    before = rss_mib()
    fit_once(LazyModel(args.d, args.blocks), args.d, strategy(), world, batch, args.memory_steps)
    return {"peak growth": peak_mib() - before}


def memory_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if world > 1:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        )  # fmt: skip
        dist.init_process_group("gloo", rank=rank, world_size=world)
        got = memory_fit(args, world, lambda: FSDPStrategy(auto_wrap_policy={Block}), args.batch)
        dist.destroy_process_group()
    else:
        got = memory_fit(args, 1, lambda: "single", args.batch * args.world)
    out.put((rank, got))


def launch(target: Any, world: int, args: argparse.Namespace) -> dict[int, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, *rest = out.get()
        results[rank] = rest if len(rest) > 1 else rest[0]
    for p in procs:
        p.join()
    return results


def report_memory(args: argparse.Namespace) -> None:
    params = sum(p.numel() for p in Model(args.d, args.blocks).parameters())
    print(
        f"peak RSS growth of a {args.memory_steps}-step fit, {args.blocks} x Linear({args.d}, {args.d}) + head "
        f"({params / 1e6:.1f} M parameters, {4 * params / 2**20:.0f} MiB fp32), AdamW, built in configure_model:"
    )
    # glibc's default heap keeps freed blocks (fragmentation that depends on the order of frees: fsdp frees a
    # gathered layer at every step); with every block over 128 KiB mapped on its own, the high-water mark
    # follows the live tensors. Both, as benchmarks/ddp.py reports them.
    for label, threshold in (("default malloc", None), ("MALLOC_MMAP_THRESHOLD_=131072", "131072")):
        if threshold is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = threshold  # read by each spawned process at its start
        single = launch(memory_worker, 1, args)[0]["peak growth"]
        sharded = max(r["peak growth"] for r in launch(memory_worker, args.world, args).values())
        print(f"  {label}:")
        print(f"    one process, batch {args.batch * args.world}: {single:8.1f} MiB")
        ratio = sharded / single
        print(f"    fsdp, {args.world} ranks, batch {args.batch} each (larger rank): {sharded:8.1f} MiB ({ratio:.2f})")


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rounds: dict[str, list[float]] = {"ember": [], "hand": []}
    held: dict[str, int] = {}
    for r in range(args.rounds):
        order = ["ember", "hand"] if r % 2 == 0 else ["hand", "ember"]
        for variant in order:
            if variant == "ember":
                t, held = ember_round(args, world)
            else:
                t = hand_round(args, world)
            rounds[variant].append(t)
    out.put((rank, rounds, held))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--memory", action="store_true", help="measure peak memory instead (fresh processes)")
    parser.add_argument("--memory-steps", type=int, default=3)
    args = parser.parse_args()
    if args.memory:
        report_memory(args)
        return
    results = launch(worker, args.world, args)
    # Per round, the slower rank's time.
    rounds = {v: [max(results[r][0][v][i] for r in results) for i in range(args.rounds)] for v in ("ember", "hand")}
    whole = Model(args.d, args.blocks)
    params = sum(p.numel() for p in whole.parameters())
    print(f"fsdp on {args.world} gloo ranks, {args.blocks} x Linear({args.d}, {args.d}) + head, {params / 1e6:.1f} M "
          f"parameters, per-rank batch {args.batch}, {args.rounds} rounds x {args.steps} steps")  # fmt: skip
    for v in ("ember", "hand"):
        print(f"  {v:<6} median step {statistics.median(rounds[v]) * 1e3:8.2f} ms")
    ratio = statistics.median(a / b for a, b in zip(rounds["ember"], rounds["hand"]))
    print(f"  ember / hand-written fully_shard loop, median of per-round ratios: {ratio:.3f}")
    one = 4 * params
    print(f"held per rank (rank 0), against one process holding the whole model ({one / 2**20:.1f} MiB fp32):")
    for what, nbytes in results[0][1].items():
        whole_bytes = one * (2 if what == "optimizer states" else 1)  # AdamW: exp_avg and exp_avg_sq
        print(f"  {what:<17} {nbytes / 2**20:8.2f} MiB of {whole_bytes / 2**20:8.2f} MiB ({nbytes / whole_bytes:.3f})")


if __name__ == "__main__":
    main()
