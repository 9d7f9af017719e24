"""No host-device synchronisation in the steady state of a 2-GPU ddp fit (NCCL), control decisions included.

The single-device version is ``test_cuda_sync.py``. Here two ranks, one GPU each, train with NCCL
while every control decision is on: preemption (an agreement every 8th step boundary), a
``ModelCheckpoint(train_time_interval=...)`` (rank zero's clock, every boundary), a per-step
``Timer`` budget (``reduce_boolean_decision`` every step) and a Python number logged with
``sync_dist=True`` every step. These run on the CPU control group (a gloo group ember makes beside
NCCL), so none of them makes the host wait for the GPU: under ``torch.cuda.set_sync_debug_mode("warn")``
a rank counts no synchronisation between two batch starts once the first steps (bucket rebuild)
are past. The control collectives are recorded too: one-element CPU tensors on a gloo group, never
on the NCCL group.

``dp`` on two GPUs: numbers the replicas log are combined on the host, tensors on the device, and
the combination never synchronises (``set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import math
import os
import socket
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ember.callbacks import Callback, ModelCheckpoint, Timer
from ember.strategies.ddp import DDPStrategy
from tests.cuda.cuda_helpers import MLP, loader, needs_two_gpus, trainer
from tests.helpers.dist import run_ranks

SYNC_WARNING = "called a synchronizing CUDA operation"
STEPS = 32  # per rank, one epoch


class Logging(MLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("lr_number", 0.05, sync_dist=True)  # a Python number, synced every step
        return loss


class CountSyncs(Callback):
    """Snapshots the synchronisation warnings at every batch start: differences are per-step counts."""

    def __init__(self, caught: list) -> None:
        self.caught = caught
        self.marks: list[int] = []
        self.backend = ""

    def on_train_start(self, trainer, module):
        self.backend = str(dist.get_backend())  # the job's group: NCCL

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.marks.append(sum(SYNC_WARNING in str(w.message) for w in self.caught))


def _nccl_group(rank: int, world: int) -> None:
    """Replaces the harness's gloo group by ember's own NCCL one (the environment torchrun would give)."""
    port = [None]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port[0]),
        NCCL_SOCKET_IFNAME=os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
    )


def _two_gpu_fit(rank: int, world: int, tmp: str) -> dict:
    _nccl_group(rank, world)
    control: list[tuple[str, str, str]] = []  # (collective, group backend, tensor device) of int32 CPU tensors
    originals = {name: getattr(dist, name) for name in ("all_reduce", "broadcast")}

    def recording(name: str) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.numel() == 1 and tensor.dtype in (torch.int32, torch.float32) and tensor.device.type == "cpu":
                control.append((name, str(dist.get_backend(kwargs.get("group"))), tensor.device.type))
            return originals[name](tensor, *args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, recording(name))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            counter = CountSyncs(caught)
            t = trainer(
                strategy=DDPStrategy(devices=[torch.device("cuda", i) for i in range(world)]),
                max_epochs=1,
                default_root_dir=tmp,
                enable_checkpointing=True,
                callbacks=[
                    counter,
                    Timer(duration={"days": 1}, interval="step"),
                    ModelCheckpoint(
                        dirpath=Path(tmp) / "ckpt", train_time_interval=3600, save_top_k=0, save_last=False
                    ),
                ],
            )
            torch.cuda.set_sync_debug_mode("warn")
            try:
                t.fit(Logging(), loader(n=STEPS * world * 16, batch_size=16))
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    marks = counter.marks
    return {
        "steps": t.global_step,
        "per_step": [b - a for a, b in zip(marks, marks[1:])],
        "control": sorted(set(control)),
        "backend": counter.backend,
        "synced_number": float(t.callback_metrics["lr_number"]),
        "synced_device": t.callback_metrics["lr_number"].device.type,
    }


@pytest.mark.processes
@pytest.mark.timeout(240)
@needs_two_gpus
def test_two_gpu_ddp_steps_with_control_decisions_do_not_synchronise(tmp_path):
    results = run_ranks(_two_gpu_fit, 2, str(tmp_path), timeout=200)
    for rank, r in enumerate(results):
        assert r["steps"] == STEPS and r["backend"] == "nccl"
        # From the third batch on (the second step's forward rebuilds the gradient buckets once).
        syncing = [(i + 1, n) for i, n in enumerate(r["per_step"]) if i >= 2 and n]
        assert not syncing, f"rank {rank}: (batch, synchronisations) of steps that waited for the GPU: {syncing}"
        # Control decisions and the synced number: CPU tensors on the gloo control group, not on NCCL.
        assert r["control"] and {backend for _, backend, _ in r["control"]} == {"gloo"}, r["control"]
        assert {name for name, _, _ in r["control"]} == {"all_reduce", "broadcast"}, r["control"]
        assert r["synced_number"] == pytest.approx(0.05) and r["synced_device"] == "cpu"


# ------------------------------------------------------------------------------------------ dp
@needs_two_gpus
@pytest.mark.timeout(60)
def test_dp_combines_numbers_and_tensors_from_two_gpus_without_synchronising():
    from ember.strategies.dp import _extreme, _weighted_sum

    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    on_1 = torch.tensor(5.0, device=cuda1)
    on_0 = torch.tensor(2.0, device=cuda0)
    torch.cuda.synchronize(cuda0)
    torch.cuda.synchronize(cuda1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        numbers_max = _extreme([1.0, 3.0], "max", cuda0)
        mixed_max = _extreme([1.0, on_1, 7.0], "max", cuda0)
        mixed_min = _extreme([on_0, 1.5, on_1], "min", cuda0)
        nan_max = _extreme([on_0, math.nan], "max", cuda0)
        mixed_sum = _weighted_sum([1.0, on_1, on_0], [1.0, 1.0, 1.0], cuda0)
        numbers_sum = _weighted_sum([1.0, 2.0], [0.5, 0.5], cuda0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert numbers_max == 3.0 and numbers_sum == 1.5  # numbers alone stay numbers
    for value in (mixed_max, mixed_min, nan_max, mixed_sum):
        assert value.device == cuda0
    assert (mixed_max.item(), mixed_min.item(), mixed_sum.item()) == (7.0, 1.5, 8.0)
    assert math.isnan(nan_max.item())
