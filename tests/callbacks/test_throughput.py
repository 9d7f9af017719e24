"""ThroughputMonitor under Lightning's names, steps and windows, and the Throughput it is built on.

Times come from a fake clock (the callback's ``time.perf_counter``) that only the test's steps and loaders move,
so the times and rates are exact."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
import ember.callbacks.throughput as monitor_module
from ember.callbacks import ThroughputMonitor
from ember.loggers import Logger
from ember.utilities.throughput import Throughput, get_available_flops
from tests.helpers.dist import join_as_rank, run_ranks

# Net has a validation_step for the fits that validate; the others need not be told.
pytestmark = pytest.mark.filterwarnings("ignore:.*defines validation_step:UserWarning")


class Recorder(Logger):
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics, step):
        self.calls.append((step, dict(metrics)))

    def writes(self, stage: str) -> list[tuple[int, dict[str, float]]]:
        return [(s, m) for s, m in self.calls if any(k.startswith(stage + "/") for k in m)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(monitor_module, "time", SimpleNamespace(perf_counter=c))
    return c


class Net(ember.TrainModule):
    """Each step moves the clock by ``step_s`` (evaluation steps by ``eval_s``)."""

    def __init__(self, clock: Clock | None = None, step_s: float = 2.0, eval_s: float = 1.0, flops: Any = None):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.clock, self.step_s, self.eval_s = clock, step_s, eval_s
        if flops is not None:
            self.flops_per_batch = flops

    def _tick(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.advance(seconds)

    def training_step(self, batch, batch_idx):
        self._tick(self.step_s)
        return self.net(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self._tick(self.eval_s)

    def test_step(self, batch, batch_idx):
        self._tick(self.eval_s)

    def predict_step(self, batch, batch_idx):
        self._tick(self.eval_s)
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class TimedLoader:
    """``n`` batches of 3 samples, each taking ``data_s`` (on the fake clock) to come."""

    def __init__(self, n: int, clock: Clock | None = None, data_s: float = 0.0) -> None:
        self.loader = loader(n)
        self.clock, self.data_s = clock, data_s

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            if self.clock is not None:
                self.clock.advance(self.data_s)
            yield batch


def loader(n: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(3 * n, 4)), batch_size=3)


def make_trainer(cb: ThroughputMonitor, rec: Recorder | None = None, **kw: Any) -> ember.Trainer:
    kw = {"max_epochs": 1, "log_every_n_steps": 1, "num_sanity_val_steps": 0, **kw}
    return ember.Trainer(
        accelerator="cpu", logger=rec if rec is not None else False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[cb], **kw,
    )  # fmt: skip


def keys(metrics: dict[str, float], stage: str) -> set[str]:
    return {k[len(stage) + 1 :] for k in metrics if k.startswith(stage + "/")}


TOTALS = {"time", "batches", "samples"}
RATES = {"device/batches_per_sec", "device/samples_per_sec", "device/flops_per_sec"}


def test_a_fit_logs_lightnings_keys_at_lightnings_steps():
    cb, rec = ThroughputMonitor(lambda b: b[0].shape[0], window_size=2), Recorder()
    trainer = make_trainer(cb, rec, max_epochs=2, num_sanity_val_steps=2)
    trainer.fit(Net(flops=10), loader(4), loader(2))
    train = rec.writes("train")
    # At each step's index, after each batch (log_every_n_steps=1), with the epoch; rates once the window is full.
    assert [s for s, _ in train] == list(range(8))
    assert [(m["train/batches"], m["train/samples"], m["epoch"]) for _, m in train] == [
        (b, 3 * b, (b - 1) // 4) for b in range(1, 9)
    ]
    assert keys(train[0][1], "train") == TOTALS
    assert all(keys(m, "train") == TOTALS | RATES | {"data_wait_frac"} for _, m in train[1:])
    # Validation: counted per run, at the epoch's validation batches as steps; never the sanity check.
    val = rec.writes("validate")
    assert [(s, m["validate/batches"]) for s, m in val] == [(1, 1), (2, 2), (1, 1), (2, 2)]
    assert [keys(m, "validate") for _, m in val[:2]] == [TOTALS, TOTALS | RATES]
    assert not any("epoch" in m for _, m in val)


def test_rates_over_the_window_are_exact_on_a_fake_clock(clock):
    # Each batch: 1 s to come, 2 s to step, so it ends at 3 s, 6 s, ...; a window of 3 spans the last 2 batches.
    cb, rec = ThroughputMonitor(window_size=3, separator="|"), Recorder()
    with pytest.warns(UserWarning, match="flops_per_batch"):
        make_trainer(cb, rec).fit(Net(clock), TimedLoader(6, clock, data_s=1.0))
    train = [m for _, m in rec.calls if "train|time" in m]
    assert [m["train|time"] for m in train] == [3.0, 6.0, 9.0, 12.0, 15.0, 18.0]
    assert ["train|device|batches_per_sec" in m for m in train] == [False, False, True, True, True, True]
    for m in train[2:]:
        assert m["train|device|batches_per_sec"] == pytest.approx(1 / 3)
        assert m["train|device|samples_per_sec"] == pytest.approx(1.0)
        assert m["train|data_wait_frac"] == pytest.approx(1 / 3)  # ember's addition: 1 s of each 3 s
        assert "train|device|flops_per_sec" not in m and "train|batches_per_sec" not in m  # no flops; one process


def test_validation_time_is_left_out_of_training(clock):
    cb, rec = ThroughputMonitor(window_size=2), Recorder()
    make_trainer(cb, rec, max_epochs=2).fit(
        Net(clock, eval_s=50.0, flops=1), TimedLoader(2, clock, data_s=1.0), loader(2)
    )
    train = [m for _, m in rec.writes("train")]
    assert [m["train/time"] for m in train] == [3.0, 6.0, 9.0, 12.0]  # the 100 s of validation are not in it
    assert train[2]["train/data_wait_frac"] == pytest.approx(1 / 3)  # nor in the wait of the batch after it
    assert train[2]["train/device/batches_per_sec"] == pytest.approx(1 / 3)
    val = [m for _, m in rec.writes("validate")]
    assert [m["validate/time"] for m in val] == [50.0, 100.0] * 2
    assert val[1]["validate/device/batches_per_sec"] == pytest.approx(1 / 50)


@pytest.mark.parametrize(
    "accumulate,batches,log_every,expected",
    [(2, 5, 1, [(0, 2), (1, 4), (2, 5)]), (2, 8, 2, [(1, 4), (3, 8)]), (1, 6, 4, [(3, 4)])],
)
def test_training_writes_when_a_window_ends_at_the_logging_cadence(accumulate, batches, log_every, expected):
    # As Lightning: after the batch that steps the optimizer (a short last window included), on the steps the
    # Trainer writes its own metrics; every batch is counted.
    cb, rec = ThroughputMonitor(window_size=2), Recorder()
    trainer = make_trainer(cb, rec, accumulate_grad_batches=accumulate, log_every_n_steps=log_every)
    trainer.fit(Net(flops=1), loader(batches))
    assert [(s, m["train/batches"]) for s, m in rec.writes("train")] == expected


def test_evaluation_stages_on_their_own(clock):
    cb, rec = ThroughputMonitor(window_size=2), Recorder()
    trainer, module = make_trainer(cb, rec), Net(clock, flops=5)
    trainer.validate(module, loader(3))
    trainer.validate(module, loader(2))  # the same callback carries the counts on, in a fresh window
    val = rec.writes("validate")
    assert [(s, m["validate/batches"], m["validate/samples"]) for s, m in val] == [(b, b, 3 * b) for b in range(1, 6)]
    assert ["validate/device/batches_per_sec" in m for _, m in val] == [False, True, True, False, True]
    assert [m["validate/time"] for _, m in val] == [1.0, 2.0, 3.0, 1.0, 2.0]
    trainer.predict(module, loader(2))
    assert [(s, keys(m, "predict")) for s, m in rec.writes("predict")] == [(1, TOTALS), (2, TOTALS | RATES)]

    # log_every_n_steps counts the batches of each run.
    cb, rec = ThroughputMonitor(window_size=2), Recorder()
    trainer = make_trainer(cb, rec, log_every_n_steps=2)
    trainer.test(module, loader(4))
    trainer.test(module, loader(3))
    assert [(s, m["test/batches"]) for s, m in rec.writes("test")] == [(2, 2), (4, 4), (6, 6)]
    assert not rec.writes("train") and not rec.writes("validate")


def test_a_fits_validation_steps_and_a_later_validate_count_apart():
    cb, rec = ThroughputMonitor(window_size=2), Recorder()
    trainer, module = make_trainer(cb, rec, max_epochs=1), Net(flops=1)
    trainer.fit(module, loader(2), loader(3))
    trainer.validate(module, loader(2))
    # As Lightning: the standalone run numbers its steps on its own, and carries the fit's last counts on.
    assert [(s, m["validate/batches"]) for s, m in rec.writes("validate")] == [(1, 1), (2, 2), (3, 3), (1, 4), (2, 5)]


def test_flops_per_batch_and_the_devices_peak_give_flops_and_mfu(clock, monkeypatch):
    asked = []

    def peak(device, dtype):
        asked.append((device.type, dtype))
        return 1000

    monkeypatch.setattr(monitor_module, "get_available_flops", peak)
    cb, rec = ThroughputMonitor(window_size=2), Recorder()
    make_trainer(cb, rec).fit(Net(clock, step_s=2.0, flops=600), loader(3))
    assert asked == [("cpu", torch.float32)] and cb.available_flops == 1000
    train = [m for _, m in rec.writes("train")]
    assert "train/device/mfu" not in train[0]
    for m in train[1:]:
        assert m["train/device/flops_per_sec"] == pytest.approx(300.0)  # 600 FLOPs per 2 s
        assert m["train/device/mfu"] == pytest.approx(0.3)


def test_missing_flops_per_batch_is_said_once():
    cb = ThroughputMonitor(window_size=2)
    trainer, module = make_trainer(cb, Recorder(), max_epochs=2), Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader(3), loader(2))
        trainer.test(module, loader(2))
    said = [w for w in caught if "flops_per_batch" in str(w.message)]
    assert len(said) == 1 and "Net" in str(said[0].message)


def test_without_loggers_or_with_log_every_zero_nothing_is_written():
    make_trainer(ThroughputMonitor(), None).fit(Net(flops=1), loader(3), loader(2))  # no logger: no error
    rec = Recorder()
    trainer = make_trainer(ThroughputMonitor(window_size=2), rec, log_every_n_steps=0)
    trainer.fit(Net(flops=1), loader(3), loader(2))
    trainer.test(Net(flops=1), loader(2))
    assert not rec.writes("train") and not rec.writes("validate") and not rec.writes("test")


class FetchesItsBatch(Net):
    def training_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)
        return self.net(batch[0]).pow(2).mean()


class RefusesBatch(Net):
    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 2 else None


@pytest.mark.parametrize("cls,expected", [(FetchesItsBatch, [3, 3, 3, 2]), (RefusesBatch, [3, 3])])
def test_each_batch_that_ran_is_counted_once_from_its_own_batch(cls, expected):
    # 11 samples in batches of 3: a dataloader_iter step counts the batch it fetched; a refused batch never ran.
    sizes: list[int] = []

    def size(batch):
        sizes.append(batch[0].shape[0])
        return sizes[-1]

    cb, rec = ThroughputMonitor(size, window_size=2), Recorder()
    make_trainer(cb, rec).fit(cls(flops=1), DataLoader(TensorDataset(torch.randn(11, 4)), batch_size=3))
    assert sizes == expected
    assert rec.writes("train")[-1][1]["train/samples"] == sum(expected)


def test_length_fn_counts_items():
    cb, rec = ThroughputMonitor(lambda b: 3, lambda b: 21, window_size=2), Recorder()  # 7 items a sample
    make_trainer(cb, rec).fit(Net(flops=1), loader(3))
    train = [m for _, m in rec.writes("train")]
    assert [m["train/lengths"] for m in train] == [21, 42, 63]
    for m in train[1:]:
        assert m["train/device/items_per_sec"] == pytest.approx(7 * m["train/device/samples_per_sec"])


def test_bad_arguments_say_what_is_wrong():
    for bad in (1, 0, 2.5, True, "3"):
        with pytest.raises(ValueError, match=r"ThroughputMonitor\(window_size=...\).*at least 2"):
            ThroughputMonitor(window_size=bad)
    with pytest.raises(TypeError, match="separator"):
        ThroughputMonitor(separator=1)
    with pytest.raises(TypeError, match="batch_size_fn"):
        ThroughputMonitor(batch_size_fn=3)
    with pytest.raises(TypeError, match="length_fn"):
        ThroughputMonitor(length_fn=3)
    with pytest.raises(TypeError):
        ThroughputMonitor(prefix="throughput/")  # ember's old argument: the names are Lightning's now


# Throughput itself.


def test_throughput_totals_rates_and_global_rates():
    tp = Throughput(available_flops=50.0, world_size=2, window_size=3, separator="|")
    tp.update(time=1.0, batches=1, samples=4, lengths=40, flops=10)
    assert tp.compute() == {"time": 1.0, "batches": 1, "samples": 4, "lengths": 40}
    tp.update(time=2.0, batches=2, samples=8, lengths=80, flops=10)
    tp.update(time=5.0, batches=3, samples=12, lengths=120, flops=20)
    # The window spans updates 1..3: 4 s, 2 batches, 8 samples, 80 items, 30 FLOPs after the first update.
    assert tp.compute() == pytest.approx(
        {
            "time": 5.0, "batches": 3, "samples": 12, "lengths": 120,
            "device|batches_per_sec": 0.5, "batches_per_sec": 1.0,
            "device|samples_per_sec": 2.0, "samples_per_sec": 4.0,
            "device|items_per_sec": 20.0, "items_per_sec": 40.0,
            "device|flops_per_sec": 7.5, "flops_per_sec": 15.0, "device|mfu": 0.15,
        }
    )  # fmt: skip
    tp.update(time=6.0, batches=4, samples=16, lengths=160)  # no flops this time: the flops window is not full
    assert tp.compute()["device|batches_per_sec"] == pytest.approx(0.5)  # updates 2..4
    tp.reset()
    with pytest.raises(RuntimeError, match="update"):
        tp.compute()
    tp.update(time=0.5, batches=1, samples=1)  # after reset, the totals may start anywhere
    assert tp.compute() == {"time": 0.5, "batches": 1, "samples": 1}


def test_throughput_refuses_totals_that_do_not_grow():
    tp = Throughput(window_size=2)
    tp.update(time=1.0, batches=1, samples=2)
    for bad in ({"time": 1.0, "batches": 2, "samples": 4}, {"time": 2.0, "batches": 1, "samples": 4}):
        with pytest.raises(ValueError, match="must grow"):
            tp.update(**bad)
    assert tp.compute()["batches"] == 1  # a refused update changes nothing
    with pytest.raises(ValueError, match="samples .* at least batches"):
        tp.update(time=2.0, batches=3, samples=2)
    with pytest.raises(ValueError, match="lengths .* at least samples"):
        Throughput().update(time=1.0, batches=1, samples=2, lengths=1)
    with pytest.raises(RuntimeError, match="every update or at none"):
        tp.update(time=2.0, batches=2, samples=4, lengths=8)
    for kwargs in ({"window_size": 1}, {"world_size": 0}, {"separator": None}):
        with pytest.raises((ValueError, TypeError)):
            Throughput(**kwargs)


def test_available_flops_none_on_cpu_and_by_name_and_dtype_on_a_gpu(monkeypatch):
    assert get_available_flops(torch.device("cpu"), torch.float32) is None
    name = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    assert get_available_flops(cuda, torch.bfloat16) == 989e12
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert get_available_flops(cuda, torch.float32) == 67e12
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert get_available_flops(cuda, torch.float32) == 495e12  # TF32
    name = "Tesla T4"
    with pytest.warns(UserWarning, match="T4"):
        assert get_available_flops(cuda, torch.bfloat16) is None
    name = "Some Future GPU"
    with pytest.warns(UserWarning, match="Some Future GPU"):
        assert get_available_flops(cuda, torch.float16) is None


# Two processes: rank zero alone measures and writes, with the global rates.


def _ddp_rank(rank: int, world: int, tmp: str) -> list[tuple[int, dict[str, float]]]:
    join_as_rank(rank, world)
    warnings.simplefilter("ignore")
    rec = Recorder()
    trainer = ember.Trainer(
        max_epochs=1, strategy="ddp", devices=world, accelerator="cpu", logger=rec, log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp,
        callbacks=[ThroughputMonitor(window_size=2)],
    )  # fmt: skip
    trainer.fit(Net(flops=100), loader(6))
    return rec.writes("train")


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_ddp_rank_zero_writes_the_global_rates(tmp_path: Any) -> None:
    r0, r1 = run_ranks(_ddp_rank, 2, str(tmp_path), timeout=100)
    assert r1 == []
    assert [s for s, _ in r0] == [0, 1, 2]  # 6 batches of 3, shared by 2 ranks
    for _, m in r0[1:]:
        assert m["train/batches_per_sec"] == pytest.approx(2 * m["train/device/batches_per_sec"])
        assert m["train/samples_per_sec"] == pytest.approx(2 * m["train/device/samples_per_sec"])
        assert m["train/flops_per_sec"] == pytest.approx(2 * m["train/device/flops_per_sec"])
