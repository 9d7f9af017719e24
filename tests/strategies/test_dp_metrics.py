"""strategy="dp" with torchmetrics: every replica's Metric has a state of its own, merged into the module's.

The fits compare ``dp`` on several CPU replicas with one device on the same data, logged step by step.
The metrics' inputs are elementwise functions of the batch (not the model's outputs, which chunked
matmuls change in the last bits), so list ("cat") and integer ("sum") states compare exactly; one
metric on the model's outputs compares with a tight tolerance.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.strategies.dp_metrics import batch_value, give_own_state, merge_into, states_of
from tests.helpers.models import RecordingLogger, fast_trainer

torchmetrics = pytest.importorskip("torchmetrics")
from torchmetrics.utilities import dim_zero_cat  # noqa: E402


class OrderedScore(torchmetrics.Metric):
    """A user's Metric: a tensor state with a reduction of its own and a list state ("cat"). Its value weighs
    each sample by its rank among the values, so it changes if a sample is lost or counted twice. (Not by its
    position: with two calls per step, replicas keep one replica's items together, as ranks under ddp do.)"""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("positives", torch.tensor(0), dist_reduce_fx=lambda t: t.sum(0))
        self.add_state("values", [], dist_reduce_fx="cat")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.positives += (target == 1).sum()
        self.values.append(preds)

    def compute(self) -> torch.Tensor:
        values = dim_zero_cat(self.values).sort().values
        weights = torch.arange(1, len(values) + 1, dtype=values.dtype, device=values.device)
        return (values * weights).sum() / (self.positives + 1)


class Scored(ember.TrainModule):
    """Logs Metric objects with list, tensor and custom states, by update and by forward, in training and
    validation; records what the update-only CatMetric held at each epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.auroc = torchmetrics.classification.BinaryAUROC()  # list states, update() only
        self.accuracy = torchmetrics.classification.BinaryAccuracy()  # integer tensor states, forward
        self.score = OrderedScore()  # forward and update() in the same step
        self.mse = torchmetrics.MeanSquaredError()  # float states, on the model's outputs
        self.seen = torchmetrics.CatMetric()  # not logged: compute() at the epoch's end
        self.val_auroc = torchmetrics.classification.BinaryAUROC()
        self.val_score = OrderedScore()
        self.seen_per_epoch: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        preds = x[:, 0].sigmoid()
        self.auroc.update(preds, y)
        self.log("auroc", self.auroc, on_step=False, on_epoch=True)
        self.accuracy(preds, y)
        self.log("acc", self.accuracy, on_step=True, on_epoch=True)
        self.score(preds, y)  # the step value: this forward's batch alone
        self.score.update(preds * 0.5, y)  # counted in the epoch's value, not in the step's
        self.log("score", self.score, on_step=True, on_epoch=True)
        out = self.layer(x).squeeze(1)
        self.mse(out.detach(), y.float())
        self.log("mse", self.mse, on_step=True, on_epoch=True)
        self.seen.update(y.float() + preds)
        return F.binary_cross_entropy_with_logits(out, y.float())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        preds = x[:, 1].sigmoid()
        self.val_auroc.update(preds, y)
        self.log("val_auroc", self.val_auroc)
        self.val_score(preds, y)
        self.log("val_score", self.val_score, on_step=True, on_epoch=True)

    def on_train_epoch_end(self) -> None:
        self.seen_per_epoch.append(self.seen.compute())
        self.seen.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), (torch.rand(n, generator=g) > 0.5).long())


def fit(devices: int) -> tuple[Scored, ember.Trainer, RecordingLogger]:
    module, logger = Scored(), RecordingLogger()
    trainer = fast_trainer(
        strategy="dp" if devices > 1 else "single",
        devices=devices,
        max_epochs=2,
        logger=logger,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
    )
    # 45 = 5 x 8 + 5 and 19 = 3 x 6 + 1: uneven chunks, and a last batch of one sample (run on the module).
    trainer.fit(module, DataLoader(data(45, 0), batch_size=8), DataLoader(data(19, 1), batch_size=6))
    return module, trainer, logger


def assert_same_logs(got: list[tuple[int, dict]], expected: list[tuple[int, dict]]) -> None:
    assert [(step, sorted(m)) for step, m in got] == [(step, sorted(m)) for step, m in expected]
    for (step, m), (_, ref) in zip(got, expected):
        for key, value in m.items():
            if key.startswith("mse"):  # sums of squared float errors, in another order
                assert math.isclose(value, ref[key], rel_tol=1e-5), (step, key, value, ref[key])
            else:
                assert value == ref[key], (step, key, value, ref[key])


@pytest.mark.parametrize("devices", [2, 3])
def test_metrics_on_replicas_equal_one_device_step_by_step(devices):
    single, single_trainer, single_log = fit(1)
    dp, dp_trainer, dp_log = fit(devices)
    assert_same_logs(dp_log.records, single_log.records)
    assert any("score_step" in m for _, m in dp_log.records)  # step values were compared too
    assert any("val_score_step" in m for _, m in dp_log.records)
    expected = {k: float(v) for k, v in single_trainer.callback_metrics.items()}
    got = {k: float(v) for k, v in dp_trainer.callback_metrics.items()}
    assert got.keys() == expected.keys()
    for key, value in got.items():
        assert value == (pytest.approx(expected[key], rel=1e-5) if key.startswith("mse") else expected[key]), key
    # Every sample once, in the batch's order, each epoch (on one shared list, replicas lose or repeat some).
    assert [len(t) for t in dp.seen_per_epoch] == [45, 45]
    assert all(torch.equal(a, b) for a, b in zip(dp.seen_per_epoch, single.seen_per_epoch))


def test_a_replica_metric_owns_its_state_and_leaves_the_original_alone():
    original = OrderedScore()
    original.update(torch.tensor([0.25]), torch.tensor([1]))
    values, positives, defaults = original.values, original.positives, dict(original._defaults)
    replica = original.__class__.__new__(original.__class__)
    replica.__dict__.update(original.__dict__)  # what the replicator makes: a shallow copy
    give_own_state(replica, torch.device("meta"), {})
    assert replica.values == [] and replica.values is not values and replica.update_count == 0
    assert replica.positives.device.type == "meta" and replica.device.type == "meta"
    assert all(d.device.type == "meta" for d in replica._defaults.values() if isinstance(d, torch.Tensor))
    replica.reset()  # as forward does: must not clear the original's list
    assert original.values == [values[0]] and original.positives is positives and int(positives) == 1
    assert original._defaults == defaults and original.device.type == "cpu"


def test_forward_on_a_replica_keeps_its_batch_apart_and_its_update_bound_to_itself():
    original = OrderedScore()
    replica = original.__class__.__new__(original.__class__)
    replica.__dict__.update(original.__dict__)
    forwards: dict[int, Any] = {}
    give_own_state(replica, torch.device("cpu"), forwards)
    replica.update(torch.tensor([0.5]), torch.tensor([0]))
    value = replica(torch.tensor([0.75, 1.0]), torch.tensor([1, 1]))
    replica.update(torch.tensor([2.0]), torch.tensor([1]))
    assert original.update_count == 0 and original.values == []
    assert replica.update_count == 3
    assert torch.equal(dim_zero_cat(replica.values), torch.tensor([0.5, 0.75, 1.0, 2.0]))
    batch = forwards[id(replica)]  # what the forward's batch alone left
    assert batch.updates == 1 and torch.equal(dim_zero_cat(batch.values["values"]), torch.tensor([0.75, 1.0]))
    expected = float(torch.tensor(0.75 + 2.0) / 3)  # (0.75 * 1 + 1 * 2) / (2 positives + 1)
    assert float(value) == float(batch_value(OrderedScore(), [batch])) == expected


def test_merge_appends_the_replicas_in_order_and_applies_each_reduction():
    class Kinds(torchmetrics.Metric):
        full_state_update = False

        def __init__(self) -> None:
            super().__init__()
            self.add_state("items", [], dist_reduce_fx="cat")
            self.add_state("total", torch.tensor(0), dist_reduce_fx="sum")
            self.add_state("top", torch.tensor(-1.0), dist_reduce_fx="max")
            self.add_state("rows", torch.zeros(0), dist_reduce_fx="cat")
            self.add_state("scale", torch.tensor(2.0), dist_reduce_fx="mean")
            self.add_state("product", torch.tensor(1.0), dist_reduce_fx=lambda t: t.prod(0))

        def update(self, x: torch.Tensor) -> None:
            self.items.append(x)
            self.total += len(x)
            self.top = torch.maximum(self.top, x.max())
            self.rows = torch.cat([self.rows, x])
            self.product *= x.prod()

        def compute(self) -> torch.Tensor:
            return self.total

    target, parts = Kinds(), [Kinds(), Kinds()]
    target.update(torch.tensor([1.0]))
    parts[0].update(torch.tensor([2.0, 3.0]))
    parts[1].update(torch.tensor([4.0]))
    target.compute()  # cached: the merge must drop it
    merge_into(target, [states_of(p) for p in parts])
    assert torch.equal(dim_zero_cat(target.items), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(target.rows, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert int(target.total) == 4 and float(target.top) == 4.0 and float(target.product) == 24.0
    assert float(target.scale) == 2.0  # a constant stays itself
    assert target.update_count == 2 and int(target.compute()) == 4


def test_metrics_that_cannot_merge_are_refused_with_what_to_do():
    class NeedsFullState(OrderedScore):
        full_state_update = True

    class Unreduced(OrderedScore):
        def __init__(self) -> None:
            super().__init__()
            self.add_state("last", torch.tensor(0.0), dist_reduce_fx=None)

    for metric, match in (
        (NeedsFullState(), "full_state_update is True.*set full_state_update = False"),
        (Unreduced(), "tensor state 'last' has dist_reduce_fx=None.*Give it a reduction"),
    ):
        part = type(metric)()
        part.update(torch.tensor([1.0]), torch.tensor([1]))
        with pytest.raises(RuntimeError, match=match):
            merge_into(metric, [states_of(part)])


class WithCollection(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        # Precision, recall and F1 share their states (one compute group).
        self.metrics = torchmetrics.MetricCollection(
            [
                torchmetrics.classification.BinaryPrecision(),
                torchmetrics.classification.BinaryRecall(),
                torchmetrics.classification.BinaryF1Score(),
            ]
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.metrics.update(x[:, 0].sigmoid(), y)
        self.log_dict(self.metrics, on_step=False, on_epoch=True)
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_metric_collection_with_compute_groups_equals_one_device_and_keeps_its_groups():
    results = []
    for devices in (1, 3):
        module = WithCollection()
        groups = {k: list(v) for k, v in module.metrics._groups.items()}
        trainer = fast_trainer(strategy="dp" if devices > 1 else "single", devices=devices, max_epochs=3)
        trainer.fit(module, DataLoader(data(90, 2), batch_size=9))
        results.append({k: float(v) for k, v in trainer.callback_metrics.items()})
    assert results[1] == results[0]
    assert sorted(results[0]) == ["BinaryF1Score", "BinaryPrecision", "BinaryRecall"]
    # The replicas merged compute groups in dicts of their own: on the original's one dict, their threads
    # would pop and extend at once (a KeyError in one of them now and then).
    assert module.metrics._groups == groups
