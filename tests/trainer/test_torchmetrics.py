"""self.log with a torchmetrics Metric (and log_dict with a MetricCollection), under single, dp and ddp.

What Lightning 2.6.6 does, checked there with the same module: a per-step value is the batch value
the Metric's last forward returned (none after ``update`` alone); the epoch value is one ``compute()``
at the epoch's end; every logged Metric is ``reset()`` after it; the Metric synchronises itself across
processes, so the trainer does not reduce its value again.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from tests.helpers.models import RecordingLogger, fast_trainer

torchmetrics = pytest.importorskip("torchmetrics")

VALUES = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]


def loader(batch_size: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(torch.tensor(VALUES).unsqueeze(1)), batch_size=batch_size)


class CountingSum(torchmetrics.SumMetric):
    """A SumMetric that records the compute() and reset() calls made on it from outside its own forward
    (a dp replica shares the list and records its own calls under its own id)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_of_calls: list[tuple[int, str]] = []
        self.in_forward = False

    @property
    def calls(self) -> list[str]:
        return [call for who, call in self.log_of_calls if who == id(self)]

    def forward(self, *args, **kwargs):
        self.in_forward = True
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.in_forward = False

    def compute(self):
        if not self.in_forward:
            self.log_of_calls.append((id(self), "compute"))
        return super().compute()

    def reset(self):
        if not getattr(self, "in_forward", True):
            self.log_of_calls.append((id(self), "reset"))
        super().reset()


class WithMetrics(ember.TrainModule):
    def __init__(self, reduce_fx: str = "mean") -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.total = CountingSum()  # forward: per step the batch sum, per epoch the sum of everything
        self.mean = torchmetrics.MeanMetric()  # update only: no per-step value
        self.reduce_fx = reduce_fx
        self.in_epoch_end: dict[str, float] = {}

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.total(x.sum())
        self.log("total", self.total, on_step=True, on_epoch=True, reduce_fx=self.reduce_fx)
        self.mean.update(x)
        self.log("mean", self.mean, on_step=True, on_epoch=True)
        return self.layer(x).pow(2).mean()

    def on_train_epoch_end(self):
        self.in_epoch_end = {k: float(v) for k, v in self.trainer.callback_metrics.items()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def floats(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def test_a_metric_logs_its_batch_value_per_step_and_one_compute_per_epoch_then_reset(tmp_path):
    logger = RecordingLogger()
    module = WithMetrics()
    # The default configuration otherwise: checkpointing on.
    trainer = ember.Trainer(
        max_epochs=2,
        accelerator="cpu",
        default_root_dir=tmp_path,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
    )
    trainer.fit(module, loader())
    steps = [m["total_step"] for _, m in logger.records if "total_step" in m]
    assert steps == [10.0, 26.0, 10.0, 26.0]  # each batch's own sum, not the running total
    epochs = [m["total_epoch"] for _, m in logger.records if "total_epoch" in m]
    assert epochs == [36.0, 36.0]  # compute() over the epoch; the reset makes epoch 2 start from zero
    assert [m["mean_epoch"] for _, m in logger.records if "mean_epoch" in m] == [4.5, 4.5]
    assert not any("mean_step" in m for _, m in logger.records)  # update() alone gives no batch value
    # One compute and one reset per epoch, from the trainer (forward's own internal calls aside).
    assert module.total.calls == ["compute", "reset"] * 2
    assert module.in_epoch_end["total_epoch"] == 36.0  # visible in the epoch-end hook, as Lightning
    assert floats(trainer.callback_metrics) == {
        "total": 36.0,
        "total_step": 26.0,
        "total_epoch": 36.0,
        "mean": 4.5,
        "mean_epoch": 4.5,
    }
    assert module.total.update_count == 0  # reset after the epoch


def test_log_dict_logs_a_metric_collection_under_its_prefixed_names():
    class WithCollection(ember.TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.metrics = torchmetrics.MetricCollection(
                {"sum": torchmetrics.SumMetric(), "max": torchmetrics.MaxMetric()}, prefix="val_"
            )

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.metrics.update(batch[0])
            self.log_dict(self.metrics)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    module = WithCollection()
    trainer = fast_trainer(num_sanity_val_steps=0)
    trainer.fit(module, loader(), loader())
    assert floats(trainer.callback_metrics) == {"val_sum": 36.0, "val_max": 8.0}
    assert trainer.validate(module, loader()) == [{"val_sum": 36.0, "val_max": 8.0}]


def test_logging_a_metric_collection_with_log_names_log_dict():
    class LogsCollection(WithMetrics):
        def training_step(self, batch, batch_idx):
            self.log("c", torchmetrics.MetricCollection([torchmetrics.SumMetric()]))

    with pytest.raises(TypeError, match=r"self\.log_dict\(collection\)"):
        fast_trainer().fit(LogsCollection(), loader())


def test_under_dp_replica_updates_reach_the_metric_once_and_steps_show_the_whole_batch():
    logger = RecordingLogger()
    module = WithMetrics()
    trainer = fast_trainer(strategy="dp", devices=2, max_epochs=2, logger=logger, log_every_n_steps=1)
    trainer.fit(module, loader())
    # Each replica saw half a batch; the step value is the whole batch's, the epoch value counts each sample once.
    assert [m["total_step"] for _, m in logger.records if "total_step" in m] == [10.0, 26.0, 10.0, 26.0]
    assert [m["total_epoch"] for _, m in logger.records if "total_epoch" in m] == [36.0, 36.0]
    assert [m["mean_epoch"] for _, m in logger.records if "mean_epoch" in m] == [4.5, 4.5]
    assert module.total.calls == ["compute", "reset"] * 2


def _two_ranks(rank: int, world: int) -> dict:
    from tests.helpers.dist import join_as_rank

    join_as_rank(rank, world)
    module = WithMetrics(reduce_fx="sum")
    trainer = ember.Trainer(
        strategy="ddp",
        devices=world,
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, loader(batch_size=2))
    return {"metrics": floats(trainer.callback_metrics), "calls": module.total.calls}


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_under_ddp_the_metric_syncs_itself_and_is_not_reduced_again():
    from tests.helpers.dist import run_ranks

    ranks = run_ranks(_two_ranks, 2, timeout=90)
    for r in ranks:
        # The sum over both ranks' samples (the Metric's own sync); reducing it again with the logged
        # reduce_fx="sum" would double it.
        assert r["metrics"]["total_epoch"] == 36.0
        assert r["metrics"]["mean_epoch"] == 4.5
        assert r["calls"] == ["compute", "reset"]


def test_two_metrics_or_a_metric_and_a_tensor_under_one_name_are_refused():
    class TwoUnderOneName(WithMetrics):
        def training_step(self, batch, batch_idx):
            self.total(batch[0].sum())
            self.log("same", self.total)
            self.mean(batch[0])
            self.log("same", self.mean)

    with pytest.raises(ValueError, match="Log each Metric under a name of its own"):
        fast_trainer().fit(TwoUnderOneName(), loader())
