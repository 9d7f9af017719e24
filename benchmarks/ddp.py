"""ember DDP vs torch.nn.parallel.DistributedDataParallel: step time and peak memory per rank.

Models (``--model``), each mapping a (batch, 256) input to 10 classes, SGD, gloo on CPU, one compute
thread per rank; each step is zero_grad / forward / cross-entropy / backward / step:

- ``mlp``: 256 -> 4 x 1024 -> 10 (10 parameter tensors, 3.4 M parameters), per-rank batch 256.
- ``transformer``: an 8-layer ``nn.TransformerEncoder`` (d=256, 8 heads, ff=1024) reading the batch
  as one sequence of tokens, then a linear head (98 tensors, 6.3 M parameters), per-rank batch 128.
- ``many-small``: 256 -> 128, 150 x (Linear 128-128 + LayerNorm), -> 10 (604 tensors, 2.5 M
  parameters), per-rank batch 64: where per-parameter overhead shows.

Step time: all variants live in the same ranks and run in interleaved blocks (the order flips
every round), so machine noise hits them alike; reported: the median block time per variant
(slower rank), one process on the per-rank batch without communication as the floor, and the
ember/torch ratio as the median of per-round ratios (robust to load from other processes). Peak
memory: each variant runs alone in a fresh pair of ranks (ru_maxrss is a high-water mark),
``--memory-repeats`` times in alternating order; reported as the mean over repeats of the larger
rank's peak RSS, and of its growth over the RSS after building the model and data, just before
wrapping (imports the wrapper needs count). It is measured twice: with glibc's default malloc,
whose heap keeps freed blocks and so adds fragmentation that depends on the order of frees, and
with ``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB (every block that large is mapped on its own and
returned on free), where the high-water mark follows the live tensors.

Run: ``python benchmarks/ddp.py --model many-small`` (``--help`` for options).

``--control`` measures instead what the Trainer's control decisions cost per step under ``ddp`` (the
same 2 gloo ranks, one thread each): ``Trainer.fit`` of a small model (256 -> 10, per-rank batch 64,
so that a step is short and what surrounds it shows) in interleaved blocks, the order flipping every
round, one fit of ``--block`` steps per variant per round; step time is the time between two batch
starts (step, callbacks, step boundary), the mean per fit (a cost paid every 8th step counts), slower
rank. Variants: ``bare`` (no
preemption handler, no time checkpoint), ``preemption`` (the agreement on stopping, every 8th step
boundary), ``time_ckpt`` (``ModelCheckpoint(train_time_interval=1 day)``, which asks rank zero's clock
at every boundary), ``sync_dist`` (a Python number logged with ``sync_dist=True`` every step). Each
adds one thing to ``bare``. Reported: the medians and the per-round ratios to ``bare``. Run it on two
trees (before / after a change) to compare.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a clone without installing

VARIANTS = ("torch", "ember", "torch+bf16", "ember+bf16")


BATCH = {"mlp": 256, "transformer": 128, "many-small": 64}  # per-rank batch per model


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(256, 8, dim_feedforward=1024)
        encoder = nn.TransformerEncoder(layer, 8, enable_nested_tensor=False)
        return nn.Sequential(encoder, nn.Linear(256, 10))
    if name == "many-small":
        layers: list[nn.Module] = [nn.Linear(256, 128)]
        for _ in range(150):
            layers += [nn.Linear(128, 128), nn.LayerNorm(128)]
        return nn.Sequential(*layers, nn.Linear(128, 10))
    layers, width = [nn.Linear(256, 1024), nn.ReLU()], 1024
    for _ in range(3):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def wrap(variant: str, model: nn.Module) -> nn.Module:
    if variant == "single":
        return model
    if variant.startswith("torch"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        if variant.endswith("bf16"):
            # torch refuses its bf16 hook by name unless NCCL >= 2.10 is present, although
            # gloo reduces bf16 fine; calling it through a differently named function is the
            # same computation.
            def bf16_on_gloo(state, bucket):
                return default_hooks.bf16_compress_hook(state, bucket)

            ddp.register_comm_hook(None, bf16_on_gloo)
        return ddp
    from ember.parallel.distributed import DistributedDataParallel

    return DistributedDataParallel(model, comm_hook="bf16" if variant.endswith("bf16") else None)


class Runner:
    def __init__(self, variant: str, model_name: str, batch: int, rank: int) -> None:
        g = torch.Generator().manual_seed(rank)
        self.x = torch.randn(batch, 256, generator=g)
        self.y = torch.randint(0, 10, (batch,), generator=g)
        model = make_model(model_name)
        self.rss_before_wrap = rss_mib()
        self.model = wrap(variant, model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self) -> float:
        start = time.perf_counter()
        self.opt.zero_grad()
        F.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()
        return time.perf_counter() - start


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def time_worker(rank: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Per variant: the median step time (ms) of each round's block."""
    runners = {v: Runner(v, args.model, args.batch, rank) for v in ("single", *VARIANTS)}
    blocks: dict[str, list[float]] = {v: [] for v in runners}
    for runner in runners.values():
        for _ in range(args.warmup):
            runner.step()
    for r in range(args.rounds):
        for v, runner in runners.items() if r % 2 == 0 else reversed(runners.items()):
            if v == "single":
                dist.barrier()  # keep the ranks in step, as DDP does for the others
            blocks[v].append(statistics.median(runner.step() for _ in range(args.block)) * 1e3)
    return blocks


def control_worker(rank: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Per variant: the mean step time (ms) of each round's fit (see --control in the module doc)."""
    import ember
    from ember.callbacks import Callback, ModelCheckpoint

    warnings.simplefilter("ignore")  # the per-fit notes (CPU ranks, no validation) are not the subject
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(args.world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(args.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # the group exists already: ember joins it
    )
    g = torch.Generator().manual_seed(rank)
    steps = args.block + 2
    x = torch.randn(64 * steps * args.world_size, 256, generator=g)
    data = DataLoader(TensorDataset(x, torch.randint(0, 10, (len(x),), generator=g)), batch_size=64)

    class Small(ember.TrainModule):
        def __init__(self, sync_number: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = nn.Linear(256, 10)
            self.sync_number = sync_number

        def training_step(self, batch, batch_idx):
            inputs, target = batch
            loss = F.cross_entropy(self.layer(inputs), target)
            if self.sync_number:
                self.log("number", 0.5, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.starts.append(time.perf_counter())

    def fit(variant: str, root: str) -> float:
        timer = StepTimes()
        callbacks: list = [timer]
        if variant == "time_ckpt":
            callbacks.append(ModelCheckpoint(dirpath=root, train_time_interval=86400, save_top_k=0, save_last=False))
        trainer = ember.Trainer(
            strategy="ddp",
            devices=args.world_size,
            accelerator="cpu",
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=variant == "time_ckpt",
            enable_model_summary=False,
            default_root_dir=root,
            callbacks=callbacks,
        )
        if variant != "preemption":
            trainer.preemption_signals = ()  # no handler: no agreement on stopping
        trainer.fit(Small(sync_number=variant == "sync_dist"), data)
        starts = timer.starts[1:]  # the first step builds state
        return (starts[-1] - starts[0]) / (len(starts) - 1) * 1e3

    variants = ("bare", "preemption", "time_ckpt", "sync_dist")
    blocks: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as root:
        for v in variants:
            fit(v, root)  # warm-up
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:
                blocks[v].append(fit(v, root))
    return blocks


def memory_worker(rank: int, args: argparse.Namespace, variant: str) -> dict[str, float]:
    runner = Runner(variant, args.model, args.batch, rank)
    for _ in range(args.memory_steps):
        runner.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak": peak, "growth": peak - runner.rss_before_wrap}


def _entry(
    rank: int,
    world: int,
    port: int,
    fn_name: str,
    args: argparse.Namespace,
    extra: tuple,
    results: multiprocessing.Queue,
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        results.put((rank, getattr(sys.modules[__name__], fn_name)(rank, args, *extra)))
    except BaseException as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.destroy_process_group()


MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def launch(
    fn_name: str, args: argparse.Namespace, *extra: object, env: dict[str, str] | None = None
) -> list[dict[str, float]]:
    ctx = multiprocessing.get_context("spawn")
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})  # read by the ranks' C library when they start
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(r, args.world_size, store.port, fn_name, args, extra, results))
        for r in range(args.world_size)
    ]
    try:
        for p in procs:
            p.start()
    finally:
        for k, old in saved.items():
            if old is None:
                del os.environ[k]
            else:
                os.environ[k] = old
    try:
        out = dict(results.get(timeout=1800) for _ in procs)
        failed = {r: v for r, v in out.items() if isinstance(v, str)}
        if failed:
            raise SystemExit(f"benchmark rank failed: {failed}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(args.world_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", choices=sorted(BATCH), default="mlp")
    parser.add_argument("--batch", type=int, default=None, help="per-rank batch (default: the model's, see above)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--memory-steps", type=int, default=30)
    parser.add_argument("--memory-repeats", type=int, default=2)
    parser.add_argument(
        "--control", action="store_true", help="measure the Trainer's control decisions instead (module doc)"
    )
    args = parser.parse_args()
    if args.batch is None:
        args.batch = BATCH[args.model]
    if args.control:
        report_control(args)
        return

    tensors = sum(1 for p in make_model(args.model).parameters())
    print(
        f"model {args.model} ({tensors} parameter tensors), "
        f"torch {torch.__version__}, {args.world_size} ranks over gloo, 1 thread each, "
        f"per-rank batch {args.batch}, {args.rounds * args.block} timed steps per variant"
    )
    timing = launch("time_worker", args)
    memory: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for repeat in range(args.memory_repeats):
        for v in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
            result: dict[str, float] = {}
            for suffix, env in (("", None), (" mmap", MMAP_ENV)):
                ranks = launch("memory_worker", args, v, env=env)
                result.update({k + suffix: max(r[k] for r in ranks) for k in ("peak", "growth")})
            memory[v].append(result)

    # The slower rank sets the pace of each round.
    rounds = {v: [max(r[v][i] for r in timing) for i in range(args.rounds)] for v in timing[0]}

    def ms(v: str) -> float:
        return statistics.median(rounds[v])

    def paired(a: str, b: str) -> float:
        # Each round runs a and b back to back: their ratio cancels load that comes and goes.
        return statistics.median(x / y for x, y in zip(rounds[a], rounds[b]))

    def mib(v: str, key: str) -> float:
        return statistics.mean(m[key] for m in memory[v])

    print(f"\nno communication (one process, per-rank batch): {ms('single'):.1f} ms/step")
    print(f"{'':<22}{'default malloc':>30}{'large blocks mmapped':>30}")
    print(f"{'variant':<12}{'step ms':>10}" + f"{'peak RSS MiB':>15}{'RSS growth MiB':>15}" * 2)
    for v in VARIANTS:
        print(
            f"{v:<12}{ms(v):>10.1f}"
            + "".join(f"{mib(v, 'peak' + s):>15.1f}{mib(v, 'growth' + s):>15.1f}" for s in ("", " mmap"))
        )
    for hook in ("", "+bf16"):
        t = paired("ember" + hook, "torch" + hook)
        m, mm = (mib("ember" + hook, "peak" + s) / mib("torch" + hook, "peak" + s) for s in ("", " mmap"))
        print(f"ember/torch{hook or ' fp32'}: step time {t:.3f}, peak memory {m:.3f} (large blocks mmapped: {mm:.3f})")


def report_control(args: argparse.Namespace) -> None:
    print(
        f"Trainer control decisions under ddp: torch {torch.__version__}, {args.world_size} ranks over gloo, "
        f"1 thread each, 256 -> 10 on a per-rank batch of 64, {args.rounds} rounds of one {args.block}-step "
        "fit per variant"
    )
    timing = launch("control_worker", args)
    rounds = {v: [max(r[v][i] for r in timing) for i in range(args.rounds)] for v in timing[0]}
    for v, per_round in rounds.items():
        ratio = statistics.median(x / y for x, y in zip(per_round, rounds["bare"]))
        print(f"{v:<10} {statistics.median(per_round):8.3f} ms/step   per-round ratio to bare {ratio:.3f}")


if __name__ == "__main__":
    main()
