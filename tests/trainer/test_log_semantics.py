"""self.log as Lightning has it: per-step values in evaluation, reduce_fx names and functions, add_dataloader_idx,
logger=False, tensors in callback_metrics / logged_metrics, and epoch values inside the epoch-end hooks.

Every expected value here was checked against Lightning 2.6.6: the same module (values 1..8 in batches of 4, so
the batch means are 2.5 and 6.5 and their epoch mean 4.5) run on Lightning, and its logger calls,
``callback_metrics`` and ``logged_metrics`` written down.
"""

from __future__ import annotations

import builtins

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback
from tests.helpers.models import RecordingLogger, fast_trainer, value_loader

VALUES = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]


class Logs(ember.TrainModule):
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


# ---------------------------------------------------------------------- item 1: per-step values in evaluation
def log_step_values(m, at, batch, batch_idx, dl):
    if at == "training_step":
        m.log("t", batch[0].mean(), on_epoch=True)
    if at == "validation_step":
        m.log("v", batch[0].mean(), on_step=True)
        m.log("w", batch[0].mean(), on_step=True, on_epoch=False)


def test_on_step_in_validation_step_writes_step_values_at_the_validation_batch_count():
    logger = RecordingLogger()
    trainer = trainer_with(logger, max_epochs=2)
    trainer.fit(Logs(log_step_values), value_loader(VALUES), value_loader(VALUES))
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
    module = Logs(lambda m, at, b, i, dl: m.log("x", b[0].mean(), on_step=True) if at == hook else None)
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
    module = Logs(lambda m, at, b, i, dl: m.log("v", b[0].mean(), on_step=True) if at == "validation_step" else None)
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
    module = Logs(
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
    module = Logs(lambda m, at, b, i, dl: m.log("e", 1.0, **options) if at == hook else None)
    with pytest.raises(ValueError, match=rf"in {hook}: .*only on_step=False, on_epoch=True is allowed there"):
        trainer_with().fit(module, value_loader(VALUES), value_loader(VALUES))


# ---------------------------------------------------------------------- item 2: reduce_fx, add_dataloader_idx, logger
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
    module = Logs(
        lambda m, at, b, i, dl: (
            m.log("a", b[0].mean(), on_step=False, on_epoch=True, reduce_fx=fx) if at == "training_step" else None
        )
    )
    trainer = trainer_with()
    trainer.fit(module, value_loader(VALUES, 3))
    assert trainer.callback_metrics["a"] == torch.tensor(expected)


@pytest.mark.parametrize("fx", ["std", lambda x: x.max(), torch.std])
def test_other_reductions_are_refused_with_what_is_accepted(fx):
    module = Logs(lambda m, at, b, i, dl: m.log("a", 1.0, reduce_fx=fx) if at == "training_step" else None)
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
    trainer.fit(Logs(log), value_loader(VALUES), [value_loader(VALUES), value_loader(VALUES)])
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
    module = Logs(
        lambda m, at, b, i, dl: m.log("v", b[0].mean(), add_dataloader_idx=False) if at == "validation_step" else None
    )
    with pytest.raises(
        ValueError,
        match=r"self.log\('v', add_dataloader_idx=False\) was called while evaluating two "
        r"dataloaders \(dataloader_idx_0 and dataloader_idx_1\)",
    ):
        trainer_with().validate(module, [value_loader(VALUES), value_loader(VALUES)])


def test_sync_dist_group_is_refused():
    module = Logs(lambda m, at, b, i, dl: m.log("a", 1.0, sync_dist_group=object()) if at == "training_step" else None)
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

    trainer_with().fit(Logs(log), value_loader(VALUES))
    assert kept["g"].requires_grad and not kept["d"].requires_grad


# ---------------------------------------------------------------------- item 3: tensors, no "epoch"
def test_callback_and_logged_metrics_hold_tensors_and_logged_metrics_no_epoch():
    logger = RecordingLogger()

    def log(m, at, b, i, dl):
        if at == "training_step":
            m.log("f", 3.0)
            m.log("n", 2, on_epoch=True)

    trainer = trainer_with(logger)
    trainer.fit(Logs(log), value_loader(VALUES))
    # Lightning 2.6.6: numbers become float32 tensors in both dicts; the loggers alone get "epoch".
    for metrics in (trainer.callback_metrics, trainer.logged_metrics):
        assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.shape == () for v in metrics.values())
    assert floats(trainer.callback_metrics) == {"f": 3.0, "n": 2.0, "n_step": 2.0, "n_epoch": 2.0}
    assert floats(trainer.logged_metrics) == {"f": 3.0, "n_step": 2.0, "n_epoch": 2.0}
    assert logger.records[-1] == (1, {"n_epoch": 2.0, "epoch": 0})


def test_numpy_numbers_are_logged_like_python_numbers():
    np = pytest.importorskip("numpy")
    module = Logs(
        lambda m, at, b, i, dl: m.log_dict({"i": np.int64(2), "f": np.float32(0.5)}) if at == "training_step" else None
    )
    trainer = trainer_with()
    trainer.fit(module, value_loader(VALUES))
    assert trainer.callback_metrics == {"i": torch.tensor(2.0), "f": torch.tensor(0.5)}


def test_validate_fills_logged_metrics_with_tensors():
    module = Logs(lambda m, at, b, i, dl: m.log("v", b[0].mean()) if at == "validation_step" else None)
    trainer = trainer_with(RecordingLogger())
    trainer.validate(module, value_loader(VALUES))
    assert trainer.logged_metrics == {"v": torch.tensor(4.5)}


# ---------------------------------------------------------------------- item 4: epoch values inside epoch-end hooks
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
    module = Logs(log)
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
    import os

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
    )

    def log(m, at, b, i, dl):
        if at == "training_step":
            m.log("t", b[0].mean(), on_epoch=True)
        if at == "validation_step":
            m.log("v", b[0].mean(), on_step=True)
        if at == "on_train_epoch_end":
            m.seen["in hook"] = floats(m.trainer.callback_metrics)

    logger = RecordingLogger()
    module = Logs(log)
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
    # across ranks (README), 4.5 here.
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

    module = Logs(log)
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
        Logs(lambda m, at, b, i, dl: m.log("v", b[0].mean(), prog_bar=True) if at == "validation_step" else None),
        value_loader(VALUES),
        value_loader(VALUES),
    )
    first, second = trainer.progress_bar_metrics, trainer.progress_bar_metrics
    assert first == {"v": 4.5} and type(first["v"]) is float and first["v"] is second["v"]
