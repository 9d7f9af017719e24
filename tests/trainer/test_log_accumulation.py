"""Epoch values and step values of ``self.log``, checked against values computed here, independently.

The module logs many values per step, from several hooks, of every kind ``self.log`` takes (float32,
float64, half and integer tensors, Python floats, explicit batch sizes, sum / max / min, ``sync_dist``,
``prog_bar``) over batches of unequal sizes, and records each value it logged with the batch size that
weighs it. The test then computes every epoch value (batch-size-weighted means in float64, sums, maxima,
minima) and every step value from those records and compares them with what the Trainer publishes
(``trainer.history``, ``callback_metrics`` with its dtypes, ``progress_bar_metrics``) and with what reached
the logger, step by step. Validation runs on two loaders of their own sizes. Under ``ddp`` (two gloo
ranks), the epoch values are the weighted means over both ranks' records, and a ``sync_dist`` step value
the mean of the ranks' values.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint
from tests.helpers.models import RecordingLogger, fast_trainer

D = 3
N_TRAIN, TRAIN_BATCH = 10, 4  # batches of 4, 4 and 2
FLOAT32_TENSORS = 12  # t0 .. t11, every third one in the progress bar
EPOCHS = 2


def loader(n: int, batch_size: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


class Records:
    """What was logged, as ``(epoch, name) -> [(value as a Python float, weight)]`` and per-step dicts."""

    def __init__(self) -> None:
        self.epoch: dict[tuple[Any, str], list[tuple[float, int]]] = defaultdict(list)
        self.steps: list[dict[str, float]] = []  # training: one dict per batch, step keys -> value

    def add(self, where: Any, name: str, value: float, weight: int, step_key: str | None = None) -> None:
        self.epoch[where, name].append((value, weight))
        if step_key is not None:
            self.steps[-1][step_key] = value


def weighted_mean(rows: list[tuple[float, int]]) -> float:
    return math.fsum(v * w for v, w in rows) / sum(w for _, w in rows)


def f32(x: float) -> float:
    """``x`` rounded to float32, as ``self.log`` keeps a Python number."""
    return torch.tensor(x, dtype=torch.float32).item()


class ManyLogs(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(D, 1)
        self.rec = Records()

    def training_step(self, batch, batch_idx):
        x, y = batch
        e, n = self.current_epoch, len(x)
        self.rec.steps.append({})
        base = x.mean()
        scaled = (base * torch.arange(1.0, FLOAT32_TENSORS + 1)).unbind()  # views of one tensor, as unbind gives
        for k, v in enumerate(scaled):
            self.log(f"t{k}", v, on_step=True, on_epoch=True, prog_bar=k % 3 == 0)
            self.rec.add(e, f"t{k}", v.item(), n, f"t{k}_step")
        number = batch_idx + 0.1 * (e + 1)  # a Python float, kept as float32
        self.log("number", number, on_step=True, on_epoch=True)
        self.rec.add(e, "number", f32(number), n, "number_step")
        d64 = base.double() * 3 + 1e-9 * batch_idx  # float64 stays float64
        self.log("d64", d64, on_step=False, on_epoch=True)
        self.rec.add(e, "d64", d64.item(), n)
        half = base.half()  # accumulated in float32
        self.log("half", half, on_step=False, on_epoch=True)
        self.rec.add(e, "half", half.item(), n)
        count = torch.tensor(batch_idx + 1)  # an integer tensor: float32
        self.log("count", count, on_step=True, on_epoch=True)
        self.rec.add(e, "count", float(batch_idx + 1), n, "count_step")
        weight = 7 + 3 * batch_idx  # an explicit batch size weighs the mean
        self.log("weighted", base, on_step=False, on_epoch=True, batch_size=weight)
        self.rec.add(e, "weighted", base.item(), weight)
        promoted = base if batch_idx == 0 else base.double()  # float32 first, float64 later: the total promotes
        self.log("promoted", promoted, on_step=False, on_epoch=True)
        self.rec.add(e, "promoted", promoted.item(), n)
        for fx in ("sum", "max", "min"):
            self.log(f"{fx}_of", base, on_step=False, on_epoch=True, reduce_fx=fx)
            self.rec.add(e, f"{fx}_of", base.item(), n)
        self.log("synced", base * 2, on_step=True, on_epoch=True, sync_dist=True, prog_bar=True)
        self.rec.add(e, "synced", (base * 2).item(), n, "synced_step")
        loss = (self.layer(x) - y).pow(2).mean()
        return loss

    def on_before_backward(self, loss):
        self.log("bb", loss.detach(), on_step=True, on_epoch=True)
        self.rec.add(self.current_epoch, "bb", loss.item(), TRAIN_BATCH_SIZES[len(self.rec.steps) - 1], "bb_step")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        value = batch[0][:, 0].mean()
        self.log("batch_end", value, on_step=True, on_epoch=True)
        self.rec.add(self.current_epoch, "batch_end", value.item(), len(batch[0]), "batch_end_step")

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, _ = batch
        value = x.mean() + dataloader_idx
        self.log("v", value, on_step=True, on_epoch=True)
        self.rec.add(("val", dataloader_idx), "v", value.item(), len(x))
        self.log("vnum", float(batch_idx), on_epoch=True)  # on_epoch only, as validation's default
        self.rec.add(("val", dataloader_idx), "vnum", float(batch_idx), len(x))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


TRAIN_BATCH_SIZES = [4, 4, 2] * EPOCHS


class CallbackLogs(Callback):
    """Logs from a callback's hook through the module."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        value = batch[1].mean()
        module.log("from_callback", value, on_step=True, on_epoch=True)
        module.rec.add(module.current_epoch, "from_callback", value.item(), len(batch[0]), "from_callback_step")


def _expected_epoch(rows: list[tuple[float, int]], name: str) -> float:
    values = [v for v, _ in rows]
    if name.startswith("sum_"):
        return math.fsum(values)
    if name.startswith("max_"):
        return max(values)
    if name.startswith("min_"):
        return min(values)
    return weighted_mean(rows)


def _epoch_key(name: str, on_step: bool) -> str:
    return f"{name}_epoch" if on_step else name


ON_STEP = {f"t{k}" for k in range(FLOAT32_TENSORS)} | {"number", "count", "synced", "bb", "batch_end", "from_callback"}


def test_epoch_and_step_values_equal_those_computed_from_what_was_logged(tmp_path):
    module, logger = ManyLogs(), RecordingLogger()
    trainer = fast_trainer(
        max_epochs=EPOCHS,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[CallbackLogs()],
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, loader(N_TRAIN, TRAIN_BATCH, 0), [loader(5, 2, 1), loader(7, 3, 2)])
    rec = module.rec

    # Every epoch value of every training epoch (trainer.history, as floats).
    assert len(trainer.history) == EPOCHS
    names = sorted({name for where, name in rec.epoch if not isinstance(where, tuple)})
    assert len(names) == FLOAT32_TENSORS + 13
    for epoch, row in enumerate(trainer.history):
        for name in names:
            expected = _expected_epoch(rec.epoch[epoch, name], name)
            got = row[_epoch_key(name, name in ON_STEP)]
            assert got == pytest.approx(expected, rel=1e-6, abs=1e-7), (epoch, name)
    # The last epoch's values as tensors in callback_metrics, with their dtypes: float64 stays float64, and a
    # total that met a float64 value became float64; everything else is float32.
    cm = trainer.callback_metrics
    last = EPOCHS - 1
    for name in names:
        value = cm[_epoch_key(name, name in ON_STEP)]
        assert value.dtype == (torch.float64 if name in ("d64", "promoted") else torch.float32), name
        expected = _expected_epoch(rec.epoch[last, name], name)
        assert value.item() == pytest.approx(expected, rel=1e-12 if name == "d64" else 1e-6, abs=1e-7), name

    # The progress bar: the prog_bar keys' last step value and epoch value.
    bar = trainer.progress_bar_metrics
    bar_names = [f"t{k}" for k in range(0, FLOAT32_TENSORS, 3)] + ["synced"]
    assert sorted(bar) == sorted([f"{n}_step" for n in bar_names] + [f"{n}_epoch" for n in bar_names])
    for name in bar_names:
        assert bar[f"{name}_step"] == pytest.approx(rec.steps[-1][f"{name}_step"], rel=1e-6)
        assert bar[f"{name}_epoch"] == pytest.approx(weighted_mean(rec.epoch[last, name]), rel=1e-6)

    # Every training step's values reached the logger at that step (log_every_n_steps=1), all of them, exactly.
    step_records = [(s, m) for s, m in logger.records if "t0_step" in m]
    assert [s for s, _ in step_records] == list(range(len(TRAIN_BATCH_SIZES)))
    for (_, written), logged in zip(step_records, rec.steps):
        assert {k: v for k, v in written.items() if k.endswith("_step")} == pytest.approx(logged, rel=1e-6)
    # The epoch values reached it too, once per epoch.
    epoch_records = [m for _, m in logger.records if "t0_epoch" in m]
    assert [m["t0_epoch"] for m in epoch_records] == pytest.approx(
        [weighted_mean(rec.epoch[e, "t0"]) for e in range(EPOCHS)], rel=1e-6
    )

    # Validation, two loaders (5 samples in batches of 2, 7 in batches of 3): per-loader keys, weighted means
    # of the last validation run; its step values went to the logger under their loader's key.
    for idx in (0, 1):
        rows = rec.epoch[("val", idx), "v"]
        run = rows[-3:]  # the last run: ceil(5 / 2) = 3 and ceil(7 / 3) = 3 batches
        assert cm[f"v_epoch/dataloader_idx_{idx}"].item() == pytest.approx(weighted_mean(run), rel=1e-6)
        nums = rec.epoch[("val", idx), "vnum"][-3:]
        assert cm[f"vnum/dataloader_idx_{idx}"].item() == pytest.approx(weighted_mean(nums), rel=1e-6)
        written = [m[f"v_step/dataloader_idx_{idx}"] for _, m in logger.records if f"v_step/dataloader_idx_{idx}" in m]
        assert written == pytest.approx([v for v, _ in rows], rel=1e-6)
        assert [w for _, w in run] == ([2, 2, 1] if idx == 0 else [3, 3, 1])


class SumReadMidEpoch(ember.TrainModule):
    """Logs a sum every step; reads it in on_train_epoch_end, then adds to it there."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(D, 1)
        self.read: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.log("s", float(batch_idx + 1), on_step=False, on_epoch=True, reduce_fx="sum")
        return self.layer(batch[0]).pow(2).mean()

    def on_train_epoch_end(self):
        self.read.append(self.trainer.callback_metrics["s"])
        self.log("s", 10.0, on_step=False, on_epoch=True, reduce_fx="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_sum_read_before_more_values_are_added_keeps_its_value():
    module = SumReadMidEpoch()
    trainer = fast_trainer(max_epochs=1)
    trainer.fit(module, loader(N_TRAIN, TRAIN_BATCH, 0))
    # 1 + 2 + 3 over the three batches; then 10 more in the hook: the tensor read before stays 6.
    assert [t.item() for t in module.read] == [6.0]
    assert trainer.callback_metrics["s"].item() == 16.0


@pytest.mark.parametrize("async_save", [False, True])
def test_mid_epoch_checkpoints_hold_each_steps_running_totals(tmp_path, async_save):
    # (in place additions into a running total must not reach a checkpoint taken before them)
    module = SumReadMidEpoch()
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, save_last=False, async_save=async_save
    )
    trainer = fast_trainer(max_epochs=1, enable_checkpointing=True, callbacks=[ckpt])
    trainer.fit(module, loader(N_TRAIN, TRAIN_BATCH, 0))
    totals = {}
    for step in (1, 2):  # the files written mid-epoch (the last step's is written at the epoch's end)
        ckpt = torch.load(tmp_path / f"epoch=0-step={step}.ckpt", weights_only=True)
        (entry,) = [e for e in ckpt["epoch_metrics"] if e["name"] == "s"]
        totals[step] = entry["total"].item()
    assert totals == {1: 1.0, 2: 3.0}


# ---------------------------------------------------------------------- ddp: 2 gloo ranks
def two_ranks(rank: int, world: int) -> dict:
    from tests.helpers.dist import join_as_rank

    join_as_rank(rank, world)

    class RankLogs(ember.TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(D, 1)
            self.rows: list[tuple[str, float, int]] = []

        def training_step(self, batch, batch_idx):
            x, _ = batch
            base = x.mean() + 10 * rank
            for k, v in enumerate((base * torch.arange(1.0, 6.0)).unbind()):
                self.log(f"m{k}", v, on_step=True, on_epoch=True)
                self.rows.append((f"m{k}", v.item(), len(x)))
            # An explicit batch size that differs between the ranks weighs the cross-rank mean.
            self.log("synced", base, on_step=True, on_epoch=True, sync_dist=True, batch_size=rank + 1)
            self.rows.append(("synced", base.item(), rank + 1))
            self.log("number", float(rank + batch_idx), on_step=False, on_epoch=True)
            self.rows.append(("number", float(rank + batch_idx), len(x)))
            return self.layer(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    logger = RecordingLogger()
    module = RankLogs()
    trainer = ember.Trainer(
        strategy="ddp",
        devices=world,
        accelerator="cpu",
        max_epochs=1,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, loader(N_TRAIN, 2, 0))
    return {
        "rows": module.rows,
        "records": logger.records,
        "cm": {k: v.item() for k, v in trainer.callback_metrics.items()},
    }


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_under_ddp_epoch_values_are_weighted_over_both_ranks_and_synced_step_values_averaged():
    from tests.helpers.dist import run_ranks

    ranks = run_ranks(two_ranks, 2, timeout=100)
    by_name: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for r in ranks:
        for name, value, weight in r["rows"]:
            by_name[name].append((value, weight))
    assert len(by_name) == 7
    for r in ranks:  # every rank publishes the same epoch values
        for name, rows in by_name.items():
            key = "number" if name == "number" else f"{name}_epoch"
            assert r["cm"][key] == pytest.approx(weighted_mean(rows), rel=1e-6), name
    # Rank zero alone writes; its step values are its own, except the synced one: the mean over the ranks.
    assert ranks[1]["records"] == []
    steps = [m for _, m in ranks[0]["records"] if "m0_step" in m]
    own = [dict((n, v) for n, v, _ in ranks[0]["rows"][i * 7 : i * 7 + 6]) for i in range(len(steps))]
    other = [dict((n, v) for n, v, _ in ranks[1]["rows"][i * 7 : i * 7 + 6]) for i in range(len(steps))]
    assert len(steps) == 3  # 5 samples per rank in batches of 2
    for written, mine, theirs in zip(steps, own, other):
        for k in range(5):
            assert written[f"m{k}_step"] == pytest.approx(mine[f"m{k}"], rel=1e-6)
        assert written["synced_step"] == pytest.approx((mine["synced"] + theirs["synced"]) / 2, rel=1e-6)
