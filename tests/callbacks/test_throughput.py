"""ThroughputMonitor: rates, and data wait told apart from compute."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.callbacks import ThroughputMonitor
from ember.loggers import Logger


class Recorder(Logger):
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics, step):
        self.calls.append((step, dict(metrics)))


class SlowLoader:
    """Batches of ``bs`` samples that take ``data_s`` to produce."""

    def __init__(self, n: int, bs: int, data_s: float) -> None:
        self.n, self.bs, self.data_s = n, bs, data_s

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            time.sleep(self.data_s)
            yield torch.randn(self.bs, 2), torch.randn(self.bs, 1)


class SlowStep(ember.TrainModule):
    def __init__(self, compute_s: float) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.compute_s = compute_s

    def training_step(self, batch, batch_idx):
        time.sleep(self.compute_s)
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(cb, data_s, compute_s, n=8, bs=4, logger=None, **kw):
    rec = Recorder() if logger is None else logger
    trainer = ember.Trainer(
        max_epochs=1,
        log_every_n_steps=4,
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=rec,
        callbacks=[cb],
        **kw,
    )
    trainer.fit(SlowStep(compute_s), SlowLoader(n, bs, data_s))
    return rec


def test_rates_and_data_wait_are_logged_at_the_logging_cadence():
    cb = ThroughputMonitor()
    rec = fit(cb, data_s=0.02, compute_s=0.005)
    logged = [(s, m) for s, m in rec.calls if "throughput/samples_per_sec" in m]
    # beside the loop's step metrics: every 4th step, written (as Lightning) at the step's index, 3 and 7
    assert [s for s, _ in logged] == [3, 7]
    for _, m in logged:
        assert m["throughput/samples_per_sec"] == pytest.approx(4 * m["throughput/batches_per_sec"])
        # sleeps only last longer than asked on a busy machine, so the lower bounds of time are firm
        assert 5 <= m["throughput/batches_per_sec"] <= 40  # at least 25 ms per batch
        assert 0.5 <= m["throughput/data_wait_frac"] < 1.0  # 20 ms of data wait to 5 ms of compute
        assert 19 <= m["throughput/data_ms_per_batch"] <= 200
        assert 4.5 <= m["throughput/compute_ms_per_batch"] <= 100


def test_compute_bound_and_custom_batch_size():
    cb = ThroughputMonitor(batch_size_fn=lambda batch: 10, prefix="tp/")
    rec = fit(cb, data_s=0.0, compute_s=0.01)
    m = cb.last_metrics
    assert set(m) == {
        "tp/samples_per_sec",
        "tp/batches_per_sec",
        "tp/data_wait_frac",
        "tp/data_ms_per_batch",
        "tp/compute_ms_per_batch",
    }
    assert m["tp/samples_per_sec"] == pytest.approx(10 * m["tp/batches_per_sec"])
    assert m["tp/data_wait_frac"] < 0.5
    assert rec.calls[-1][1]["tp/compute_ms_per_batch"] >= 9


def test_short_epochs_still_report_and_no_logger_is_fine():
    cb = ThroughputMonitor()
    rec = fit(cb, data_s=0.0, compute_s=0.0, n=3)  # fewer batches than log_every_n_steps
    # the epoch's tail, written at the epoch's end: (as Lightning) the index of its last step, 2
    assert [s for s, m in rec.calls if "throughput/batches_per_sec" in m] == [2]
    cb = ThroughputMonitor()
    fit(cb, data_s=0.0, compute_s=0.0, n=5, logger=False)
    assert cb.last_metrics["throughput/batches_per_sec"] > 0


class FetchesItsBatch(ember.TrainModule):
    """A ``training_step(self, dataloader_iter)`` fetching one batch per step, or refusing the batch at ``refuse``."""

    def __init__(self, refuse: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.refuse = refuse

    def training_step(self, dataloader_iter):
        (x, y), _, _ = next(dataloader_iter)
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class UsualStep(FetchesItsBatch):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == self.refuse else None


@pytest.mark.parametrize(
    "cls,refuse", [(FetchesItsBatch, None), (UsualStep, None), (UsualStep, 5)], ids=["iter", "usual", "refused"]
)
def test_samples_are_counted_from_the_batch_each_step_ran(cls, refuse):
    # 20 samples in batches of 3 (the last of 2). A dataloader_iter step's batch hooks get, at its start, the
    # previous step's batch (None at first): counting there saw None, then each batch one step late and
    # never the last. As Lightning's ThroughputMonitor, the batch is counted when the step ends.
    sizes: list[int] = []

    def size(batch):
        sizes.append(batch[0].shape[0])  # (a batch_size_fn that expects a batch, as users write them)
        return sizes[-1]

    cb = ThroughputMonitor(batch_size_fn=size)
    data = torch.utils.data.TensorDataset(torch.randn(20, 2), torch.randn(20, 1))
    trainer = ember.Trainer(
        max_epochs=1,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[cb],
    )
    trainer.fit(cls(refuse), torch.utils.data.DataLoader(data, batch_size=3))
    expected = [3] * 5 if refuse == 5 else [3] * 6 + [2]  # a refused batch never ran, nor did the rest
    assert sizes == expected
    m = cb.last_metrics
    assert m["throughput/samples_per_sec"] == pytest.approx(
        sum(expected) / len(expected) * m["throughput/batches_per_sec"]
    )


def test_length_fn_counts_items_per_batch_as_lightnings_items_per_sec():
    # Each batch of 4 samples holds 4 * 7 items (tokens, say): items/s is 7x samples/s over the same time.
    lengths: list[int] = []

    def length(batch):
        lengths.append(batch[0].shape[0] * 7)
        return lengths[-1]

    cb = ThroughputMonitor(length_fn=length)
    rec = fit(cb, data_s=0.0, compute_s=0.002, n=6)
    assert lengths == [28] * 6
    logged = [m for _, m in rec.calls if "throughput/items_per_sec" in m]
    assert len(logged) == 2  # at step 3 (every 4th) and the epoch's tail
    for m in logged:
        assert m["throughput/items_per_sec"] == pytest.approx(7 * m["throughput/samples_per_sec"])
    # Positionally as Lightning's ThroughputMonitor(batch_size_fn, length_fn); without it no item is counted.
    cb = ThroughputMonitor(lambda batch: 2, lambda batch: 5)
    fit(cb, data_s=0.0, compute_s=0.0, n=2, logger=False)
    assert cb.last_metrics["throughput/items_per_sec"] == pytest.approx(
        2.5 * cb.last_metrics["throughput/samples_per_sec"]
    )
    cb = ThroughputMonitor()
    fit(cb, data_s=0.0, compute_s=0.0, n=2, logger=False)
    assert "throughput/items_per_sec" not in cb.last_metrics
    with pytest.raises(TypeError, match="length_fn"):
        ThroughputMonitor(length_fn=3)
