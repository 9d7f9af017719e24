"""Control decisions under ddp (2 gloo ranks): on the CPU control group, started without waiting,
not every step, and taken at the same step on every rank.

Every ``torch.distributed`` collective a rank calls during a fit is recorded with the global step it
was called at. Gradient all-reduces are float buckets; control decisions are one-element int32 CPU
tensors; a Python number logged with ``sync_dist=True`` is a one-element float32 CPU tensor. Under
gloo the control group is the default group (``group=None``); a run with a separate gloo group (what
NCCL jobs get) shows that every control collective goes to that group.
"""

from __future__ import annotations

import datetime
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
import ember.callbacks.model_checkpoint as model_checkpoint
import ember.checkpoint.contents as contents
import ember.strategies.ddp as ddp_module
from ember.callbacks import Callback, LambdaCallback, ModelCheckpoint
from ember.exceptions import Preempted
from ember.strategies.ddp import DDPStrategy
from tests.helpers.dist import join_as_rank, run_ranks

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]
STEPS = 24  # per rank, one epoch
RECORDED = ("all_reduce", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object", "barrier")


class Net(ember.TrainModule):
    def __init__(self, on_batch: Callable[[Any, int], None] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.on_batch = on_batch

    def training_step(self, batch, batch_idx):
        if self.on_batch is not None:
            self.on_batch(self, batch_idx)
        x, y = batch
        self.log("rank_number", float(self.global_rank), sync_dist=True)  # a Python number, synced every step
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(world: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * world, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=1)


class SavesSeen(DDPStrategy):
    """Records the checkpoint files every rank takes part in saving (rank zero writes them)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.saved: list[str] = []

    def save_checkpoint(self, checkpoint, path, *args, **kwargs) -> None:
        self.saved.append(Path(path).name)
        super().save_checkpoint(checkpoint, path, *args, **kwargs)


def _trainer(root: Path, callbacks: list, **kwargs: Any) -> ember.Trainer:
    return ember.Trainer(
        strategy=SavesSeen(timeout=1234),
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=any(isinstance(cb, ModelCheckpoint) for cb in callbacks),
        default_root_dir=root,
        callbacks=callbacks,
        **kwargs,
    )


class Record:
    """Wraps the ``torch.distributed`` collectives: records (global step, name, group, async_op, tensor)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.step: int | None = None  # None: outside the training batches
        self._originals = {name: getattr(dist, name) for name in RECORDED}

    def __enter__(self) -> Record:
        for name, original in self._originals.items():
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            self.calls.append(
                {
                    "step": self.step,
                    "name": name,
                    "group": kwargs.get("group"),
                    "async": bool(kwargs.get("async_op", False)),
                    "dtype": str(tensor.dtype) if tensor is not None else None,
                    "numel": tensor.numel() if tensor is not None else None,
                    "device": tensor.device.type if tensor is not None else None,
                }
            )
            return original(*args, **kwargs)

        return call


class StepOf(Callback):
    """Tells the recorder which global step the collectives belong to, from the first batch to the
    epoch's end (the epoch's own collectives, before and after, are not per step)."""

    def __init__(self, record: Record) -> None:
        self.record = record

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.record.step = trainer.global_step  # the step's own: training_step, backward

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.record.step = trainer.global_step  # counted already: the boundary after this batch

    def on_train_epoch_end(self, trainer, module):
        self.record.step = None


def _use_a_separate_control_group() -> list[Any]:
    """Gives this rank's strategies what an NCCL job gets: a gloo group of their own for control
    collectives. Returns the list the groups made (and the timeout each was asked for) are put in."""
    made: list[Any] = []

    def open_separate(timeout: Any = None) -> Any:
        made.append((dist.new_group(backend="gloo", timeout=timeout), timeout))
        return made[-1][0]

    ddp_module.open_control_group = open_separate
    return made


def _control_fit(rank: int, world: int, tmp: str, separate_group: bool) -> dict:
    join_as_rank(rank, world)
    made = _use_a_separate_control_group() if separate_group else []
    with Record() as record:
        time_checkpoint = ModelCheckpoint(
            dirpath=Path(tmp) / "ckpt", train_time_interval=3600, save_top_k=0, save_last=False
        )
        trainer = _trainer(Path(tmp), [time_checkpoint, StepOf(record)])
        trainer.fit(Net(), _loader(world))
    control = made[0][0] if made else None
    calls = []
    for c in record.calls:
        if c["step"] is None or c["name"] == "all_reduce" and c["dtype"] == "torch.float32" and c["numel"] != 1:
            continue  # outside the training batches, or a gradient bucket
        if c["step"] == 1 and c["name"] == "broadcast" and c["dtype"] == "torch.int64":
            continue  # the reducer's one-time bucket rebuild, in the second step's forward (parallel/reducer.py)
        on_control = c["group"] is control
        calls.append({**c, "group": "control" if on_control else repr(c["group"])})
    return {
        "calls": calls,
        "rank_number": trainer.callback_metrics["rank_number"],
        "steps": trainer.global_step,
        "separate": bool(made),
        "control_timeout": made[0][1] if made else None,
        "strategy_timeout": trainer.strategy.timeout,
    }


@pytest.fixture(scope="module", params=[False, True], ids=["default-group", "separate-group"])
def control_runs(request, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("control")
    return run_ranks(_control_fit, 2, str(tmp), request.param, timeout=120)


def test_the_stop_decision_is_an_async_cpu_all_reduce_every_8th_boundary_on_the_control_group(control_runs):
    for rank, run in enumerate(control_runs):
        assert run["steps"] == STEPS
        stop_votes = [c for c in run["calls"] if c["name"] == "all_reduce" and c["dtype"] == "torch.int32"]
        assert [c["step"] for c in stop_votes] == [8, 16, 24], (rank, stop_votes)
        assert all(
            c["async"] and c["device"] == "cpu" and c["numel"] == 1 and c["group"] == "control" for c in stop_votes
        ), stop_votes


def test_the_time_checkpoint_decision_is_an_async_cpu_broadcast_and_no_object_broadcast_runs(control_runs):
    for rank, run in enumerate(control_runs):
        names = {c["name"] for c in run["calls"]}
        assert "broadcast_object_list" not in names and "all_gather_object" not in names, (rank, names)
        votes = [c for c in run["calls"] if c["name"] == "broadcast"]
        assert [c["step"] for c in votes] == list(range(1, STEPS + 1)), (rank, votes)  # one per boundary
        assert all(
            c["async"] and c["device"] == "cpu" and c["dtype"] == "torch.int32" and c["group"] == "control"
            for c in votes
        ), votes


def test_a_number_logged_with_sync_dist_is_reduced_on_the_cpu_control_group(control_runs):
    for rank, run in enumerate(control_runs):
        synced = [c for c in run["calls"] if c["name"] == "all_reduce" and c["dtype"] == "torch.float32"]
        assert [c["step"] for c in synced] == list(range(STEPS)), (rank, synced)  # in each training_step
        assert all(c["device"] == "cpu" and c["group"] == "control" and not c["async"] for c in synced), synced
        value = run["rank_number"]
        assert value.device.type == "cpu" and value.item() == 0.5  # the mean of rank 0's 0 and rank 1's 1


def test_the_control_group_waits_as_long_as_the_strategy_says(control_runs):
    # An NCCL job's gloo control group is made with the strategy's timeout (torch's default otherwise).
    for run in control_runs:
        if run["separate"]:
            assert run["control_timeout"] == run["strategy_timeout"] == datetime.timedelta(seconds=1234)


def test_nothing_else_is_communicated_per_step(control_runs):
    for run in control_runs:
        kinds = {(c["name"], c["dtype"]) for c in run["calls"]}
        assert kinds == {
            ("all_reduce", "torch.int32"),  # the stop decision
            ("broadcast", "torch.int32"),  # rank zero's "is a checkpoint due?"
            ("all_reduce", "torch.float32"),  # the number logged with sync_dist
        }, kinds
    assert [run["separate"] for run in control_runs] in ([False, False], [True, True])


# ------------------------------------------------------------------------ the decisions themselves
def _sigterm_on_rank_1(module: ember.TrainModule, batch_idx: int) -> None:
    if batch_idx == 2 and module.global_rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)


def _preempted_fit(rank: int, world: int, tmp: str) -> dict:
    join_as_rank(rank, world)
    trainer = _trainer(Path(tmp), [])
    try:
        trainer.fit(Net(_sigterm_on_rank_1), _loader(world))
    except Preempted as exc:
        return {"code": exc.code, "step": trainer.global_step, "path": exc.checkpoint_path}
    return {"code": None, "step": trainer.global_step}


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    results = run_ranks(_preempted_fit, 2, str(tmp_path), timeout=120)
    # The signal comes in step 3; the agreement started at boundary 8 is read at boundary 9.
    assert [(r["code"], r["step"]) for r in results] == [(143, 9), (143, 9)], results
    assert torch.load(results[0]["path"], weights_only=True)["global_step"] == 9


class _Clock:
    """Rank 0's clock: 10 s later at every read. Rank 1's clock stands still: only rank 0's counts."""

    def __init__(self, moving: bool) -> None:
        self.reads, self.moving = 0, moving

    def monotonic(self) -> float:
        self.reads += 1
        return 10.0 * self.reads if self.moving else 0.0


def _time_checkpoint_fit(rank: int, world: int, tmp: str) -> dict:
    join_as_rank(rank, world)
    model_checkpoint.time = _Clock(moving=rank == 0)  # type: ignore[assignment]  # (this process's callback only)
    cb = ModelCheckpoint(
        dirpath=Path(tmp) / "ckpt", filename="{step}", train_time_interval=15, save_top_k=-1, save_last=False
    )
    trainer = _trainer(Path(tmp), [cb], max_steps=8)
    trainer.fit(Net(), _loader(world))
    return trainer.strategy.saved


def test_the_time_checkpoint_saves_on_rank_zeros_clock_at_the_same_step_on_every_rank(tmp_path):
    saved = run_ranks(_time_checkpoint_fit, 2, str(tmp_path), timeout=120)
    # Rank 0 reads 10 at the start, then per boundary: 20 (not due), 30 (due: said at boundary 2, saved
    # at 3, the clock reset to 40), 50 (not), 60 (due, saved at 5), ... One boundary later than one
    # process (which saves at 2, 4, ...: tests/callbacks/test_model_checkpoint.py).
    assert saved[0] == saved[1] == ["step=3.ckpt", "step=5.ckpt", "step=7.ckpt"], saved
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == saved[0]


# ------------------------------------------------------------------------ saves
def _saving_fit(rank: int, world: int, tmp: str) -> dict:
    join_as_rank(rank, world)
    made = _use_a_separate_control_group()
    with Record() as record:
        original_save = contents.save

        def recorded_save(*args: Any, **kwargs: Any) -> str:
            record.step = "save"  # type: ignore[assignment]
            try:
                return original_save(*args, **kwargs)
            finally:
                record.step = None

        contents.save = recorded_save
        try:
            every_8 = ModelCheckpoint(dirpath=Path(tmp) / "ckpt", every_n_train_steps=8, save_top_k=-1, async_save=True)
            by_hand = LambdaCallback(  # a synchronous save during the fit, with the job's groups
                on_train_epoch_end=lambda trainer, module: trainer.save_checkpoint(Path(tmp) / "by_hand.ckpt")
            )
            trainer = _trainer(Path(tmp), [every_8, by_hand])
            trainer.fit(Net(), _loader(world))
        finally:
            contents.save = original_save
    control = made[0][0]
    saves = [{**c, "group": "control" if c["group"] is control else repr(c["group"])} for c in record.calls]
    return {"calls": [c for c in saves if c["step"] == "save"], "files": trainer.strategy.saved}


def test_a_save_under_ddp_communicates_on_the_cpu_control_group_only(tmp_path):
    # Under NCCL a collective on the default group goes through the device: the path's broadcast, the RNG
    # states' gather and the closing barrier would each make the host wait for the GPU at every save (a
    # background save included). Here they are recorded on a job that has a control group of its own.
    for rank, run in enumerate(run_ranks(_saving_fit, 2, str(tmp_path), timeout=120)):
        assert run["files"] == ["epoch=0-step=8.ckpt", "epoch=0-step=16.ckpt", "epoch=0-step=24.ckpt", "by_hand.ckpt"]
        names = [c["name"] for c in run["calls"]]
        assert names.count("barrier") == 4 and names.count("broadcast_object_list") == 4, (rank, names)
        assert names.count("all_gather") == 4, (rank, names)  # every rank's RNG state, once a save
        elsewhere = [c for c in run["calls"] if c["group"] != "control"]
        assert not elsewhere, (rank, [(c["name"], c["group"]) for c in elsewhere])
    ranks_rng = torch.load(tmp_path / "by_hand.ckpt", weights_only=True)["rng"]
    assert ranks_rng["world_size"] == 2 and len(ranks_rng["per_rank"]) == 2


# ------------------------------------------------------------------------ start_decision itself
def _decisions(rank: int, world: int) -> dict:
    join_as_rank(rank, world)
    strategy = DDPStrategy(accelerator="cpu")
    strategy.setup_environment()
    try:
        started = {
            mode: strategy.start_decision(rank == 1, mode)  # rank 1 says yes, rank 0 no
            for mode in ("all", "any", "rank_zero")
        }
        out = {mode: decision.result() for mode, decision in started.items()}
        out["blocking_any"] = strategy.reduce_boolean_decision(rank == 1, all=False)
        out["blocking_all"] = strategy.reduce_boolean_decision(rank == 1, all=True)
        out["mean_of_cpu_number"] = strategy.reduce(torch.tensor(float(rank)), "mean")
        try:
            strategy.start_decision(True, "majority")  # type: ignore[arg-type]
        except ValueError as exc:
            out["bad_mode"] = str(exc)
        return out
    finally:
        strategy.teardown()


def test_start_decision_combines_the_ranks_answers_as_its_mode_says():
    for out in run_ranks(_decisions, 2, timeout=60):
        assert {k: out[k] for k in ("all", "any", "rank_zero", "blocking_any", "blocking_all")} == {
            "all": False,
            "any": True,
            "rank_zero": False,
            "blocking_any": True,
            "blocking_all": False,
        }
        value = out["mean_of_cpu_number"]
        assert value.device.type == "cpu" and value.item() == 0.5
        assert "start_decision(mode='majority')" in out["bad_mode"] and "'rank_zero'" in out["bad_mode"]
