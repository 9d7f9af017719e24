"""self.log semantics: defaults by hook, _step/_epoch keys, weighted epoch means, reduce_fx, the three
metric dicts, bad input; then, as Lightning has them: per-step values in evaluation, reduce_fx names and
functions, add_dataloader_idx, logger=False, tensors in callback_metrics / logged_metrics, epoch values
inside the epoch-end hooks, and the same under ddp.

Every expected value in the second part (from "Lightning parity" on) was checked against Lightning
2.6.6: the same module (values 1..8 in batches of 4, so the batch means are 2.5 and 6.5 and their epoch
mean 4.5) run on Lightning, and its logger calls, ``callback_metrics`` and ``logged_metrics`` written down.
"""

from __future__ import annotations

import builtins

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

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


# ---------------------------------------------------------------------- Lightning parity
VALUES = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]


class LogsPerLoader(ember.TrainModule):
    """Calls ``log_fn(self, where, batch, batch_idx, dataloader_idx)`` from the step or hook named ``where``."""

    def __init__(self, log_fn) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.log_fn = log_fn
        self.seen: dict[str, dict[str, float]] = {}

    def training_step(self, batch, batch_idx):
        self.log_fn(self, "training_step", batch, batch_idx, 0)
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log_fn(self, "validation_step", batch, batch_idx, dataloader_idx)

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self.log_fn(self, "test_step", batch, batch_idx, dataloader_idx)

    def on_train_epoch_end(self):
        self.log_fn(self, "on_train_epoch_end", None, None, 0)

    def on_validation_epoch_end(self):
        self.log_fn(self, "on_validation_epoch_end", None, None, 0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def floats(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def trainer_with(logger=None, **kwargs) -> ember.Trainer:
    kwargs.setdefault("num_sanity_val_steps", 0)
    return fast_trainer(logger=logger or False, log_every_n_steps=1, **kwargs)


# ---------------------------------------------------------------------- per-step values in evaluation
def log_step_values(m, at, batch, batch_idx, dl):
    if at == "training_step":
        m.log("t", batch[0].mean(), on_epoch=True)
    if at == "validation_step":
        m.log("v", batch[0].mean(), on_step=True)
        m.log("w", batch[0].mean(), on_step=True, on_epoch=False)


def test_on_step_in_validation_step_writes_step_values_at_the_validation_batch_count():
    logger = RecordingLogger()
    trainer = trainer_with(logger, max_epochs=2)
    trainer.fit(LogsPerLoader(log_step_values), value_loader(VALUES), value_loader(VALUES))
    # Lightning 2.6.6: validation step values carry no "epoch" and are written at the number of validation
    # batches run so far in this fit (0, 1, then 2, 3); epoch values at the epoch's last step index.
    assert logger.records == [
        (0, {"t_step": 2.5, "epoch": 0}),
        (1, {"t_step": 6.5, "epoch": 0}),
        (0, {"v_step": 2.5, "w": 2.5}),
        (1, {"v_step": 6.5, "w": 6.5}),
        (1, {"v_epoch": 4.5, "epoch": 0}),
        (1, {"t_epoch": 4.5, "epoch": 0}),
        (2, {"t_step": 2.5, "epoch": 1}),
        (3, {"t_step": 6.5, "epoch": 1}),
        (2, {"v_step": 2.5, "w": 2.5}),
        (3, {"v_step": 6.5, "w": 6.5}),
        (3, {"v_epoch": 4.5, "epoch": 1}),
        (3, {"t_epoch": 4.5, "epoch": 1}),
    ]
    # Evaluation step values reach the loggers and logged_metrics, never callback_metrics.
    assert floats(trainer.callback_metrics) == {"t": 4.5, "t_step": 6.5, "v": 4.5, "v_epoch": 4.5, "t_epoch": 4.5}
    assert floats(trainer.logged_metrics) == {"t_step": 6.5, "v_step": 6.5, "w": 6.5, "v_epoch": 4.5, "t_epoch": 4.5}


@pytest.mark.parametrize("entry", ["validate", "test"])
def test_on_step_in_validate_and_test_counts_from_zero_in_each_run(entry):
    logger = RecordingLogger()
    trainer = trainer_with(logger)
    hook = "validation_step" if entry == "validate" else "test_step"
    module = LogsPerLoader(lambda m, at, b, i, dl: m.log("x", b[0].mean(), on_step=True) if at == hook else None)
    for _ in range(2):  # Lightning 2.6.6: a second validate / test starts again at step 0
        results = getattr(trainer, entry)(module, value_loader(VALUES))
        assert results == [{"x_epoch": 4.5}]
    assert logger.records == [(0, {"x_step": 2.5}), (1, {"x_step": 6.5}), (0, {"x_epoch": 4.5, "epoch": 0})] * 2
    assert floats(trainer.callback_metrics) == {"x": 4.5, "x_epoch": 4.5}
    assert floats(trainer.logged_metrics) == {"x_step": 6.5, "x_epoch": 4.5}


def test_several_validation_loaders_count_their_own_batches_and_the_sanity_check_writes_nothing():
    logger = RecordingLogger()
    trainer = trainer_with(logger, max_epochs=2, num_sanity_val_steps=2)
    values = VALUES + [9.0, 10.0, 11.0, 12.0]  # 3 batches: means 2.5, 6.5, 10.5
    module = LogsPerLoader(
        lambda m, at, b, i, dl: m.log("v", b[0].mean(), on_step=True) if at == "validation_step" else None
    )
    trainer.fit(module, value_loader(VALUES), [value_loader(values), value_loader(values)])
    val = [(s, m) for s, m in logger.records if any(k.startswith("v") for k in m)]
    per_run = [
        [(first + j, {f"v_step/dataloader_idx_{dl}": mean}) for j, mean in enumerate([2.5, 6.5, 10.5])]
        for first in (0, 3)
        for dl in (0, 1)
    ]
    epoch_end = [
        (step, {"v_epoch/dataloader_idx_0": 6.5, "v_epoch/dataloader_idx_1": 6.5, "epoch": epoch})
        for step, epoch in ((1, 0), (3, 1))
    ]
    assert val == per_run[0] + per_run[1] + [epoch_end[0]] + per_run[2] + per_run[3] + [epoch_end[1]]


def test_prog_bar_step_values_in_validation_reach_the_progress_bar():
    trainer = trainer_with()
    module = LogsPerLoader(
        lambda m, at, b, i, dl: (
            m.log("v", b[0].mean(), on_step=True, prog_bar=True) if at == "validation_step" else None
        )
    )
    trainer.fit(module, value_loader(VALUES), value_loader(VALUES))
    assert floats(trainer.progress_bar_metrics) == {"v_step": 6.5, "v_epoch": 4.5}  # as Lightning 2.6.6


@pytest.mark.parametrize("hook", ["on_train_epoch_end", "on_validation_epoch_end"])
@pytest.mark.parametrize("options", [{"on_step": True}, {"on_epoch": False}])
def test_epoch_hooks_refuse_per_step_values(hook, options):
    # Lightning 2.6.6 raises "You can't self.log(on_step=True) inside on_train_epoch_end, must be one of (False,)".
    module = LogsPerLoader(lambda m, at, b, i, dl: m.log("e", 1.0, **options) if at == hook else None)
    with pytest.raises(ValueError, match=rf"in {hook}: .*only on_step=False, on_epoch=True is allowed there"):
        trainer_with().fit(module, value_loader(VALUES), value_loader(VALUES))


# ---------------------------------------------------------------------- reduce_fx, add_dataloader_idx, logger
@pytest.mark.parametrize(
    "fx,expected",
    [
        ("mean", 4.5),
        ("avg", 4.5),
        ("AVG", 4.5),
        ("Mean", 4.5),
        ("sum", 14.5),
        ("max", 7.5),
        ("MAX", 7.5),
        ("min", 2.0),
        (torch.mean, 4.5),
        (torch.sum, 14.5),
        (builtins.sum, 14.5),
        (torch.max, 7.5),
        (builtins.max, 7.5),
        (torch.min, 2.0),
        (builtins.min, 2.0),
    ],
)
def test_reduce_fx_names_and_functions(fx, expected):
    # Batches of 3: means 2, 5, 7.5 with sizes 3, 3, 2 (the mean is weighted by batch size). Lightning 2.6.6 values.
    module = LogsPerLoader(
        lambda m, at, b, i, dl: (
            m.log("a", b[0].mean(), on_step=False, on_epoch=True, reduce_fx=fx) if at == "training_step" else None
        )
    )
    trainer = trainer_with()
    trainer.fit(module, value_loader(VALUES, 3))
    assert trainer.callback_metrics["a"] == torch.tensor(expected)


@pytest.mark.parametrize("fx", ["std", lambda x: x.max(), torch.std])
def test_other_reductions_are_refused_with_what_is_accepted(fx):
    module = LogsPerLoader(lambda m, at, b, i, dl: m.log("a", 1.0, reduce_fx=fx) if at == "training_step" else None)
    with pytest.raises(
        ValueError,
        match=r"reduce_fx must be one of \('mean', 'sum', 'min', 'max'\) \(any case, or "
        r"'avg' for 'mean'\) or one of torch.mean",
    ):
        trainer_with().fit(module, value_loader(VALUES))


def test_add_dataloader_idx_false_keeps_the_name_and_logger_false_keeps_values_off_the_loggers():
    logger = RecordingLogger()

    def log(m, at, b, i, dl):
        if at == "validation_step":
            m.log(f"v{dl}", b[0].mean(), add_dataloader_idx=False, on_step=True)
            m.log("q", b[0].mean(), logger=False, on_step=True)
        if at == "training_step":
            m.log("nl", b[0].mean(), logger=False, on_epoch=True, prog_bar=True)
            m.log("ma", b[0].mean(), metric_attribute="unused")

    trainer = trainer_with(logger)
    trainer.fit(LogsPerLoader(log), value_loader(VALUES), [value_loader(VALUES), value_loader(VALUES)])
    # Lightning 2.6.6's calls, callback_metrics and logged_metrics for this module.
    assert logger.records == [
        (0, {"ma": 2.5, "epoch": 0}),
        (1, {"ma": 6.5, "epoch": 0}),
        (0, {"v0_step": 2.5}),
        (1, {"v0_step": 6.5}),
        (0, {"v1_step": 2.5}),
        (1, {"v1_step": 6.5}),
        (1, {"v0_epoch": 4.5, "v1_epoch": 4.5, "epoch": 0}),
    ]
    assert floats(trainer.callback_metrics) == {
        "nl": 4.5,
        "nl_step": 6.5,
        "nl_epoch": 4.5,
        "ma": 6.5,
        "v0": 4.5,
        "v0_epoch": 4.5,
        "v1": 4.5,
        "v1_epoch": 4.5,
        "q/dataloader_idx_0": 4.5,
        "q_epoch/dataloader_idx_0": 4.5,
        "q/dataloader_idx_1": 4.5,
        "q_epoch/dataloader_idx_1": 4.5,
    }
    assert floats(trainer.logged_metrics) == {
        "ma": 6.5,
        "v0_step": 6.5,
        "v0_epoch": 4.5,
        "v1_step": 6.5,
        "v1_epoch": 4.5,
    }


def test_add_dataloader_idx_false_with_one_name_from_two_loaders_is_refused():
    # Lightning 2.6.6 refuses it too ("You called self.log(v, ...) twice in validation_step with different arguments").
    module = LogsPerLoader(
        lambda m, at, b, i, dl: m.log("v", b[0].mean(), add_dataloader_idx=False) if at == "validation_step" else None
    )
    with pytest.raises(
        ValueError,
        match=r"self.log\('v', add_dataloader_idx=False\) was called while evaluating two "
        r"dataloaders \(dataloader_idx_0 and dataloader_idx_1\)",
    ):
        trainer_with().validate(module, [value_loader(VALUES), value_loader(VALUES)])


def test_sync_dist_group_is_refused():
    module = LogsPerLoader(
        lambda m, at, b, i, dl: m.log("a", 1.0, sync_dist_group=object()) if at == "training_step" else None
    )
    with pytest.raises(ValueError, match="ember reduces across all processes; leave sync_dist_group=None"):
        trainer_with().fit(module, value_loader(VALUES))


def test_enable_graph_keeps_the_graph_of_the_step_value():
    kept = {}

    def log(m, at, b, i, dl):
        if at == "training_step":
            m.log("g", m.layer(b[0]).mean(), enable_graph=True)
            kept["g"] = m.trainer.callback_metrics["g"]
            m.log("d", m.layer(b[0]).mean())
            kept["d"] = m.trainer.callback_metrics["d"]

    trainer_with().fit(LogsPerLoader(log), value_loader(VALUES))
    assert kept["g"].requires_grad and not kept["d"].requires_grad


# ---------------------------------------------------------------------- tensors, no "epoch"
def test_callback_and_logged_metrics_hold_tensors_and_logged_metrics_no_epoch():
    logger = RecordingLogger()

    def log(m, at, b, i, dl):
        if at == "training_step":
            m.log("f", 3.0)
            m.log("n", 2, on_epoch=True)

    trainer = trainer_with(logger)
    trainer.fit(LogsPerLoader(log), value_loader(VALUES))
    # Lightning 2.6.6: numbers become float32 tensors in both dicts; the loggers alone get "epoch".
    for metrics in (trainer.callback_metrics, trainer.logged_metrics):
        assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.shape == () for v in metrics.values())
    assert floats(trainer.callback_metrics) == {"f": 3.0, "n": 2.0, "n_step": 2.0, "n_epoch": 2.0}
    assert floats(trainer.logged_metrics) == {"f": 3.0, "n_step": 2.0, "n_epoch": 2.0}
    assert logger.records[-1] == (1, {"n_epoch": 2.0, "epoch": 0})


def test_numpy_numbers_are_logged_like_python_numbers():
    np = pytest.importorskip("numpy")
    module = LogsPerLoader(
        lambda m, at, b, i, dl: m.log_dict({"i": np.int64(2), "f": np.float32(0.5)}) if at == "training_step" else None
    )
    trainer = trainer_with()
    trainer.fit(module, value_loader(VALUES))
    assert trainer.callback_metrics == {"i": torch.tensor(2.0), "f": torch.tensor(0.5)}


def test_validate_fills_logged_metrics_with_tensors():
    module = LogsPerLoader(lambda m, at, b, i, dl: m.log("v", b[0].mean()) if at == "validation_step" else None)
    trainer = trainer_with(RecordingLogger())
    trainer.validate(module, value_loader(VALUES))
    assert trainer.logged_metrics == {"v": torch.tensor(4.5)}


# ---------------------------------------------------------------------- epoch values inside epoch-end hooks
class Watch(Callback):
    def __init__(self) -> None:
        self.seen: dict[str, dict[str, float]] = {}

    def on_train_epoch_end(self, trainer, module):
        self.seen["train"] = floats(trainer.callback_metrics)


def test_epoch_values_are_visible_inside_the_epoch_end_hooks():
    def log(m, at, b, i, dl):
        if at == "training_step":
            m.log("t", b[0].mean(), on_epoch=True)
            m.log("s", b[0].mean(), on_epoch=True, on_step=False, reduce_fx="sum")
        if at == "validation_step":
            m.log(f"v{dl}", b[0].mean(), add_dataloader_idx=False)
        if at == "on_validation_epoch_end":
            m.log("ve", 3.0)
            m.seen["validation, after logging"] = floats(m.trainer.callback_metrics)
        if at == "on_train_epoch_end":
            m.seen["train, before logging"] = floats(m.trainer.callback_metrics)
            m.log("te", 5.0)
            m.seen["train, after logging"] = floats(m.trainer.callback_metrics)

    watch = Watch()
    module = LogsPerLoader(log)
    trainer_with(callbacks=[watch]).fit(module, value_loader(VALUES), [value_loader(VALUES), value_loader(VALUES)])
    # What Lightning 2.6.6 shows at those points for this module.
    after_validation = {"t": 6.5, "t_step": 6.5, "v0": 4.5, "v1": 4.5, "ve": 3.0}
    in_train_epoch_end = {**after_validation, "t": 4.5, "t_epoch": 4.5, "s": 9.0}
    assert module.seen["validation, after logging"] == after_validation
    assert watch.seen["train"] == in_train_epoch_end  # callbacks run first, and see the same
    assert module.seen["train, before logging"] == in_train_epoch_end
    assert module.seen["train, after logging"] == {**in_train_epoch_end, "te": 5.0}


# ---------------------------------------------------------------------- the same under ddp (2 gloo ranks)
def two_ranks_log(rank: int, world: int) -> dict:
    from tests.helpers.dist import join_as_rank

    join_as_rank(rank, world)

    def log(m, at, b, i, dl):
        if at == "training_step":
            m.log("t", b[0].mean(), on_epoch=True)
        if at == "validation_step":
            m.log("v", b[0].mean(), on_step=True)
        if at == "on_train_epoch_end":
            m.seen["in hook"] = floats(m.trainer.callback_metrics)

    logger = RecordingLogger()
    module = LogsPerLoader(log)
    trainer = ember.Trainer(
        strategy="ddp",
        devices=world,
        max_epochs=1,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, value_loader(VALUES, 2), value_loader(VALUES, 2))
    return {
        "records": logger.records,
        "in hook": module.seen["in hook"],
        "after": floats(trainer.callback_metrics),
        "logged": floats(trainer.logged_metrics),
    }


@pytest.mark.processes
def test_under_ddp_rank_zero_writes_its_step_values_and_epoch_values_are_reduced_across_ranks():
    from tests.helpers.dist import run_ranks

    ranks = run_ranks(two_ranks_log, 2, timeout=60)
    # Each rank gets every other sample: rank 0 batches [1, 3], [5, 7] (means 2, 6), rank 1 [2, 4], [6, 8].
    # As in Lightning, only rank zero writes, and step values are that rank's own; ember reduces epoch values
    # across ranks (docs/from-lightning.md, differences), 4.5 here.
    assert ranks[1]["records"] == []
    assert [r for r in ranks[0]["records"] if "v_step" in r[1] or "v_epoch" in r[1]] == [
        (0, {"v_step": 2.0}),
        (1, {"v_step": 6.0}),
        (1, {"v_epoch": 4.5, "epoch": 0}),
    ]
    # Inside on_train_epoch_end the epoch value is this rank's own so far (as Lightning's without sync_dist),
    # no collective runs there; once the epoch has ended it is the same on every rank.
    assert [r["in hook"]["t_epoch"] for r in ranks] == [4.0, 5.0]
    for r in ranks:
        assert r["after"]["t_epoch"] == 4.5 and r["after"]["v"] == 4.5
    # Every rank keeps logged_metrics (as Lightning, whose loggers alone are rank-zero-only): its own last step values.
    assert [(r["logged"]["v_step"], r["logged"]["t_epoch"]) for r in ranks] == [(6.0, 4.5), (7.0, 4.5)]


class _LossAndEpoch(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("vl", self.layer(batch[0]).pow(2).mean())

    def on_train_epoch_end(self):
        self.log("ep", float(self.current_epoch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("logger", [False, True])
def test_logged_metrics_are_kept_with_or_without_loggers(tmp_path, logger):
    """Lightning 2.6.6, the same module, logger=False and True alike: after fit logged_metrics has
    ['ep', 'loss', 'vl']; after a validate, only ['vl'] (each entry point starts empty)."""
    loader = DataLoader(TensorDataset(torch.arange(8.0).unsqueeze(1)), batch_size=4)
    trainer = ember.Trainer(
        max_epochs=2,
        logger=logger,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        default_root_dir=str(tmp_path),
        accelerator="cpu",
    )
    module = _LossAndEpoch()
    trainer.fit(module, loader, loader)
    assert sorted(trainer.logged_metrics) == ["ep", "loss", "vl"]
    trainer.validate(module, loader)
    assert sorted(trainer.logged_metrics) == ["vl"]


def test_logged_and_progress_bar_metrics_show_epoch_values_inside_the_epoch_end_hooks():
    """Lightning 2.6.6 (this module, logger off): inside on_validation_epoch_end and on_train_epoch_end the
    epoch values are already in logged_metrics (tensors) and progress_bar_metrics (floats)."""

    def typed(metrics):
        return {k: (float(v), type(v).__name__) for k, v in metrics.items()}

    def log(m, at, b, i, dl):
        if at == "training_step":
            m.log("t", b[0].mean(), on_step=True, on_epoch=True, prog_bar=True)
            m.log("q", b[0].mean(), on_epoch=True)
        elif at == "validation_step":
            m.log("v", b[0].mean(), prog_bar=True)
        else:
            m.seen[at] = (typed(m.trainer.logged_metrics), typed(m.trainer.progress_bar_metrics))

    module = LogsPerLoader(log)
    trainer = trainer_with()
    trainer.fit(module, value_loader(VALUES), value_loader(VALUES))
    steps = {"t_step": (6.5, "Tensor"), "q_step": (6.5, "Tensor"), "v": (4.5, "Tensor")}
    assert module.seen["on_validation_epoch_end"] == (steps, {"t_step": (6.5, "float"), "v": (4.5, "float")})
    in_train_end = (
        {**steps, "t_epoch": (4.5, "Tensor"), "q_epoch": (4.5, "Tensor")},
        {"t_step": (6.5, "float"), "v": (4.5, "float"), "t_epoch": (4.5, "float")},
    )
    assert module.seen["on_train_epoch_end"] == in_train_end
    assert (typed(trainer.logged_metrics), typed(trainer.progress_bar_metrics)) == in_train_end


def test_progress_bar_metrics_keep_the_same_float_while_a_value_is_unchanged():
    trainer = trainer_with()
    trainer.fit(
        LogsPerLoader(
            lambda m, at, b, i, dl: m.log("v", b[0].mean(), prog_bar=True) if at == "validation_step" else None
        ),
        value_loader(VALUES),
        value_loader(VALUES),
    )
    first, second = trainer.progress_bar_metrics, trainer.progress_bar_metrics
    assert first == {"v": 4.5} and type(first["v"]) is float and first["v"] is second["v"]
