"""self.log semantics: defaults by hook, _step/_epoch keys, weighted epoch means, reduce_fx, the three metric dicts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ember
from ember.callbacks import Callback
from tests.helpers.models import BoringModel, RecordingLogger, fast_trainer, regression_loader, value_loader


class Logs(ember.TrainModule):
    """Calls ``log_fn(self, where, batch, batch_idx)`` from the step or hook named ``where``."""

    def __init__(self, log_fn) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.log_fn = log_fn

    def training_step(self, batch, batch_idx):
        self.log_fn(self, "training_step", batch, batch_idx)
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log_fn(self, "validation_step", batch, batch_idx)

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self.log_fn(self, "test_step", batch, batch_idx)

    def on_train_epoch_end(self):
        self.log_fn(self, "on_train_epoch_end", None, None)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log_fn(self, "on_train_batch_end", batch, batch_idx)

    def on_after_backward(self):
        self.log_fn(self, "on_after_backward", None, None)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def only(where: str, fn):
    def log_fn(module, at, batch, batch_idx):
        if at == where:
            fn(module, batch, batch_idx)

    return log_fn


def run(log_fn, values=(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0), batch_size=4, val=False, logger=None, **kwargs):
    kwargs.setdefault("num_sanity_val_steps", 0)
    trainer = fast_trainer(logger=logger or False, log_every_n_steps=1, **kwargs)
    loader = value_loader(list(values), batch_size)
    trainer.fit(Logs(log_fn), loader, value_loader(list(values), batch_size) if val else None)
    return trainer


def batch_mean(batch) -> torch.Tensor:
    return batch[0].mean()


# ---------------------------------------------------------------------- defaults and keys
def test_training_step_defaults_to_on_step_only():
    logger = RecordingLogger()
    trainer = run(only("training_step", lambda m, b, i: m.log("a", batch_mean(b))), logger=logger)
    assert trainer.callback_metrics["a"] == pytest.approx(6.5)  # the last step's value
    assert "a_step" not in trainer.callback_metrics and "a_epoch" not in trainer.callback_metrics
    assert [m["a"] for _, m in logger.records if "a" in m] == pytest.approx([2.5, 6.5])
    assert logger.steps_with("a") == [0, 1]  # as Lightning: a step's metrics are written at the step's index


@pytest.mark.parametrize("where", ["on_train_batch_end", "on_after_backward"])
def test_batch_hooks_default_to_on_step(where):
    trainer = run(only(where, lambda m, b, i: m.log("h", float(m.global_step))))
    assert "h" in trainer.callback_metrics and "h_epoch" not in trainer.callback_metrics


def test_on_train_epoch_end_defaults_to_on_epoch():
    logger = RecordingLogger()
    trainer = run(only("on_train_epoch_end", lambda m, b, i: m.log("e", 3.0)), logger=logger, max_epochs=2)
    assert trainer.callback_metrics["e"] == pytest.approx(3.0)
    # Written once per epoch, at (as Lightning) the index of the epoch's last step: 2 steps an epoch, so 1 and 3.
    assert [s for s, m in logger.records if "e" in m] == [1, 3]


def test_on_step_and_on_epoch_give_step_and_epoch_keys():
    logger = RecordingLogger()
    trainer = run(
        only("training_step", lambda m, b, i: m.log("a", batch_mean(b), on_step=True, on_epoch=True, prog_bar=True)),
        logger=logger,
    )
    cm = trainer.callback_metrics
    assert cm["a_step"] == pytest.approx(6.5)
    assert cm["a_epoch"] == pytest.approx(4.5)
    assert cm["a"] == pytest.approx(4.5)  # the bare name holds the latest: the epoch value once the epoch ended
    assert set(trainer.progress_bar_metrics) == {"a_step", "a_epoch"}
    # As Lightning (checked against Lightning 2.6.6): tensors, and no "epoch" (only the loggers get it).
    assert trainer.logged_metrics == {"a_step": torch.tensor(6.5), "a_epoch": torch.tensor(4.5)}
    assert all(isinstance(v, torch.Tensor) for v in trainer.logged_metrics.values())
    assert [s for s, m in logger.records if "a_epoch" in m] == [1]  # as Lightning: the epoch's last step index


def test_on_epoch_only_in_training():
    trainer = run(only("training_step", lambda m, b, i: m.log("a", batch_mean(b), on_step=False, on_epoch=True)))
    assert trainer.callback_metrics["a"] == pytest.approx(4.5)
    assert "a_step" not in trainer.callback_metrics and "a_epoch" not in trainer.callback_metrics


def test_validation_step_defaults_to_on_epoch():
    trainer = run(only("validation_step", lambda m, b, i: m.log("v", batch_mean(b))), val=True)
    assert trainer.callback_metrics == {"v": torch.tensor(4.5)}


# ---------------------------------------------------------------------- epoch reduction
def test_epoch_mean_is_weighted_by_batch_size_with_an_uneven_last_batch():
    values = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 10.0, 10.0]  # batches of 4, 4 and 2
    trainer = run(only("training_step", lambda m, b, i: m.log("a", batch_mean(b), on_epoch=True)), values=values)
    # The true mean over samples (2.8), not the mean of the batch means (4.0).
    assert trainer.callback_metrics["a_epoch"] == pytest.approx(sum(values) / len(values))
    trainer = fast_trainer()
    module = Logs(only("test_step", lambda m, b, i: m.log("t", batch_mean(b))))
    results = trainer.test(module, value_loader(values, 4))
    assert results == [{"t": pytest.approx(2.8)}]


def test_explicit_batch_size_overrides_inference():
    # Weights 1, 1, 3: (1 + 2 + 3*3) / 5
    def log(m, b, i):
        m.log("a", float(i + 1), on_epoch=True, batch_size=3 if i == 2 else 1)

    trainer = run(only("training_step", log), values=[0.0] * 12)
    assert trainer.callback_metrics["a_epoch"] == pytest.approx(12 / 5)


@pytest.mark.parametrize("fx,expected", [("sum", 6.0), ("min", 1.0), ("max", 3.0), ("mean", 2.0)])
def test_reduce_fx(fx, expected):
    def log(m, b, i):
        m.log("a", torch.tensor(float(i + 1)), on_step=False, on_epoch=True, reduce_fx=fx)

    trainer = run(only("training_step", log), values=[0.0] * 12)
    assert trainer.callback_metrics["a"] == pytest.approx(expected)
    trainer = fast_trainer()
    trainer.validate(Logs(only("validation_step", log)), value_loader([0.0] * 12, 4))
    assert trainer.callback_metrics["a"] == pytest.approx(expected)


def test_reduce_fx_with_python_numbers():
    def log(m, b, i):
        m.log("mx", float(i), on_epoch=True, reduce_fx="max")
        m.log("mn", i, on_epoch=True, reduce_fx="min")

    trainer = run(only("training_step", log), values=[0.0] * 12)
    assert trainer.callback_metrics["mx_epoch"] == pytest.approx(2.0)
    assert trainer.callback_metrics["mn_epoch"] == pytest.approx(0.0)


def test_epoch_values_restart_every_epoch():
    def log(m, b, i):
        m.log("a", float(m.current_epoch), on_step=False, on_epoch=True)

    logger = RecordingLogger()
    run(only("training_step", log), logger=logger, max_epochs=3)
    assert [m["a"] for _, m in logger.records if "a" in m] == [0.0, 1.0, 2.0]


def test_mid_epoch_validation_does_not_disturb_the_training_epoch_mean():
    def log(m, at, b, i):
        if at == "training_step":
            m.log("a", batch_mean(b), on_step=False, on_epoch=True)
        elif at == "validation_step":
            m.log("a_val", torch.tensor(100.0))

    trainer = run(log, val=True, val_check_interval=0.5, batch_size=2)
    assert trainer.callback_metrics["a"] == pytest.approx(4.5)
    assert trainer.callback_metrics["a_val"] == pytest.approx(100.0)


def test_history_keeps_one_row_per_epoch():
    trainer = run(only("training_step", lambda m, b, i: m.log("a", batch_mean(b), on_epoch=True)), max_epochs=2)
    assert [row["epoch"] for row in trainer.history] == [0, 1]
    assert trainer.history[0]["a_epoch"] == pytest.approx(4.5) and trainer.history[1]["step"] == 4


# ---------------------------------------------------------------------- what goes where
def test_prog_bar_and_logger_flags():
    logger = RecordingLogger()

    def log(m, b, i):
        m.log("shown", 1.0, prog_bar=True)
        m.log("hidden", 2.0)
        m.log("unlogged", 3.0, logger=False)

    trainer = run(only("training_step", log), logger=logger)
    assert set(trainer.progress_bar_metrics) == {"shown"}
    assert {"shown", "hidden", "unlogged"} <= set(trainer.callback_metrics)
    assert "unlogged" not in trainer.logged_metrics and "hidden" in trainer.logged_metrics
    assert all("unlogged" not in m for _, m in logger.records)


def test_log_dict():
    trainer = run(only("training_step", lambda m, b, i: m.log_dict({"x": 1.0, "y": torch.tensor(2.0)}, prog_bar=True)))
    assert trainer.callback_metrics["x"] == 1.0 and trainer.callback_metrics["y"] == 2.0
    assert set(trainer.progress_bar_metrics) == {"x", "y"}


def test_logged_values_are_detached_and_floats():
    def log(m, b, i):
        loss = m.layer(b[0]).mean()
        m.log("loss", loss, on_epoch=True)
        m.log("count", torch.tensor(3))

    trainer = run(only("training_step", log))
    assert not trainer.callback_metrics["loss_step"].requires_grad
    assert not trainer.callback_metrics["loss_epoch"].requires_grad
    assert trainer.callback_metrics["count"].dtype == torch.float32


def test_multiple_validation_loaders_get_a_suffix():
    trainer = fast_trainer(num_sanity_val_steps=0)
    module = Logs(only("validation_step", lambda m, b, i: m.log("v", batch_mean(b))))
    trainer.fit(module, value_loader([1.0] * 4, 2), [value_loader([1.0] * 4, 2), value_loader([5.0] * 4, 2)])
    assert trainer.callback_metrics["v/dataloader_idx_0"] == pytest.approx(1.0)
    assert trainer.callback_metrics["v/dataloader_idx_1"] == pytest.approx(5.0)


class LogsAtValidationEpochEnd(Logs):
    def on_validation_epoch_end(self):
        self.log("overall", 7.0)


def test_several_loaders_results_hold_their_own_keys_and_those_logged_outside_any_loader():
    module = LogsAtValidationEpochEnd(only("validation_step", lambda m, b, i: m.log("v", batch_mean(b))))
    results = fast_trainer().validate(module, [value_loader([1.0] * 4, 2), value_loader([5.0] * 4, 2)])
    assert results == [{"v/dataloader_idx_0": 1.0, "overall": 7.0}, {"v/dataloader_idx_1": 5.0, "overall": 7.0}]


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "value,err,match",
    [
        (torch.ones(3), ValueError, r"self.log\('bad', ...\) got a tensor of shape \(3,\); only scalars can be logged"),
        ("high", TypeError, r"self.log\('bad', ...\) expects a number or a scalar tensor, got str"),
        (True, TypeError, r"expects a number or a scalar tensor, got bool"),
    ],
)
def test_log_rejects_non_scalars(value, err, match):
    with pytest.raises(err, match=match):
        run(only("training_step", lambda m, b, i: m.log("bad", value)))


def test_log_accepts_a_one_element_tensor():
    trainer = run(only("training_step", lambda m, b, i: m.log("one", torch.tensor([[2.0]]))))
    assert trainer.callback_metrics["one"].shape == ()


def test_log_rejects_unknown_reduce_fx():
    message = r"reduce_fx='median'\): reduce_fx must be one of \('mean', 'sum', 'min', 'max'\)"
    with pytest.raises(ValueError, match=message):
        run(only("training_step", lambda m, b, i: m.log("a", 1.0, reduce_fx="median")))


def test_log_rejects_neither_step_nor_epoch():
    with pytest.raises(ValueError, match=r"on_step=False, on_epoch=False\) would record nothing"):
        run(only("training_step", lambda m, b, i: m.log("a", 1.0, on_step=False, on_epoch=False)))


def test_log_rejects_empty_name():
    with pytest.raises(ValueError, match="self.log needs a non-empty string name"):
        run(only("training_step", lambda m, b, i: m.log("", 1.0)))


@settings(max_examples=25, deadline=None)
@given(values=st.lists(st.floats(-100, 100, width=32), min_size=1, max_size=13), batch_size=st.integers(1, 5))
def test_epoch_reductions_property(values, batch_size):
    """For any data and batch size: the weighted mean is the per-sample mean; sum/min/max reduce batch values."""

    def log(m, b, i):
        x = b[0]
        m.log("mean", x.mean(), on_step=False, on_epoch=True)
        m.log("sum", x.sum(), on_step=False, on_epoch=True, reduce_fx="sum")
        m.log("min", x.min(), on_step=False, on_epoch=True, reduce_fx="min")
        m.log("max", x.max(), on_step=False, on_epoch=True, reduce_fx="max")

    trainer = run(only("training_step", log), values=values, batch_size=batch_size)
    cm, t = trainer.callback_metrics, torch.tensor(values)
    assert float(cm["mean"]) == pytest.approx(float(t.mean()), abs=1e-3)
    assert float(cm["sum"]) == pytest.approx(float(t.sum()), abs=1e-3)
    assert float(cm["min"]) == float(t.min()) and float(cm["max"]) == float(t.max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_values_are_reduced_in_float32(dtype):
    # 300 batches of a bf16/fp16 value: accumulating in half precision drifts far from the true mean and sum.
    value = torch.tensor(1.0078125, dtype=dtype)

    def log(m, b, i):
        m.log("mean", value, on_step=False, on_epoch=True, batch_size=64)
        m.log("sum", value, on_step=False, on_epoch=True, reduce_fx="sum")

    trainer = run(only("training_step", log), values=[0.0] * 300, batch_size=1)
    assert trainer.callback_metrics["mean"].dtype == torch.float32
    assert float(trainer.callback_metrics["mean"]) == pytest.approx(1.0078125, rel=1e-6)
    assert float(trainer.callback_metrics["sum"]) == pytest.approx(300 * 1.0078125, rel=1e-6)


def test_to_floats_converts_every_kind_of_value_exactly_and_keeps_the_order():
    from ember.utils import to_floats

    bf16 = torch.tensor(1.0078125, dtype=torch.bfloat16)  # exactly representable in bfloat16
    metrics = {
        "z": 3,
        "f64": torch.tensor(0.1, dtype=torch.float64),
        "bf16": bf16,
        "i": torch.tensor(7),
        "one": torch.tensor([2.5]),
        "flag": torch.tensor(True),
        "py": 0.25,
        "grad": torch.tensor(4.0, requires_grad=True) * 1,
    }
    out = to_floats(metrics)
    assert list(out) == list(metrics)
    assert out == {"z": 3.0, "f64": 0.1, "bf16": 1.0078125, "i": 7.0, "one": 2.5, "flag": 1.0, "py": 0.25, "grad": 4.0}
    assert all(type(v) is float for v in out.values())


class LogsAtTrainStart(Logs):
    def on_train_start(self):
        self.log("at_start", 3.0)


@pytest.mark.parametrize("sanity", [0, 2])
def test_values_logged_in_on_train_start_belong_to_the_first_epoch(sanity):
    logger = RecordingLogger()
    trainer = fast_trainer(logger=logger, log_every_n_steps=1, max_epochs=2, num_sanity_val_steps=sanity)
    module = LogsAtTrainStart(only("training_step", lambda m, b, i: m.log("a", batch_mean(b), on_epoch=True)))
    trainer.fit(module, value_loader([1.0, 2.0, 3.0, 4.0], 2), value_loader([1.0, 2.0], 2) if sanity else None)
    assert trainer.history[0]["at_start"] == 3.0
    assert trainer.history[0]["a_epoch"] == trainer.history[1]["a_epoch"] == 2.5
    # Written with the first epoch's values, at (as Lightning) the index of its last step: 2 steps, so 1.
    assert logger.steps_with("at_start") == [1]
    assert trainer.callback_metrics["at_start"] == 3.0


def test_a_callback_logs_with_self_log_through_the_module():
    """As Lightning: a callback's self.log / self.log_dict log as the module's would, from that hook."""

    class Logs(Callback):
        def on_train_epoch_start(self, trainer, module):
            self.log("epoch_start", 2.0)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.log_dict({"batch_end": 3.0})

    trainer = fast_trainer(limit_train_batches=1, callbacks=[Logs()])
    trainer.fit(BoringModel(), regression_loader())
    assert {k: float(v) for k, v in trainer.callback_metrics.items() if k != "train_loss"} == {
        "epoch_start": 2.0,
        "batch_end": 3.0,
    }
