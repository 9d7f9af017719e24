"""Lightning's public members of EarlyStopping, ModelCheckpoint and OnExceptionCheckpoint in ember:
``mode_dict``/``order_dict``/``monitor_op`` and ``log_rank_zero_only``; ``check_monitor_top_k``,
``file_exists``, ``to_yaml`` and ``format_checkpoint_name(prefix=...)``; ``ckpt_path``.

Expected values were checked against Lightning 2.6.6 calling the same members, except where a comment
says ember differs.
"""

from __future__ import annotations

import logging
import math
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, EarlyStopping, ModelCheckpoint, OnExceptionCheckpoint


class Recorder:
    """A strategy stand-in that records each ``reduce_boolean_decision`` and answers ``answer`` (or the decision)."""

    def __init__(self, answer: bool | None = None) -> None:
        self.calls: list[tuple[bool, bool]] = []
        self.answer = answer

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        self.calls.append((decision, all))
        return decision if self.answer is None else self.answer


def fake_trainer(rank: int = 0, world_size: int = 1, **kw: Any) -> Any:
    """What the callbacks read of a trainer, for one rank of a ``world_size``-process run."""
    return SimpleNamespace(
        global_rank=rank,
        world_size=world_size,
        is_global_zero=rank == 0,
        strategy=Recorder(),
        fast_dev_run=False,
        state="fitting",
        sanity_checking=False,
        current_epoch=0,
        global_step=4,
        should_stop=False,
        **kw,
    )


# ---------------------------------------------------------------------- EarlyStopping
def test_early_stopping_mode_dict_order_dict_and_monitor_op():
    assert EarlyStopping.mode_dict == {"min": torch.lt, "max": torch.gt}
    assert EarlyStopping.order_dict == {"min": "<", "max": ">"}
    assert EarlyStopping(monitor="x").monitor_op is torch.lt
    assert EarlyStopping(monitor="x", mode="max").monitor_op is torch.gt
    with pytest.raises(ValueError, match=r"mode='avg'.*'min' or 'max'"):
        EarlyStopping(monitor="x", mode="avg")


def test_early_stopping_threshold_messages_use_order_dict():
    es = EarlyStopping(monitor="m", stopping_threshold=2.0)
    trainer = fake_trainer(callback_metrics={"m": torch.tensor(1.5)})
    es.on_validation_end(trainer, None)
    assert trainer.should_stop and "(1.5 < 2.0)" in es.stopping_reason
    es = EarlyStopping(monitor="m", mode="max", divergence_threshold=0.1)
    trainer = fake_trainer(callback_metrics={"m": torch.tensor(0.05)})
    es.on_validation_end(trainer, None)
    assert trainer.should_stop and "(0.1 > 0.05)" in es.stopping_reason


class _Later(EarlyStopping):
    """A subclass with a mode of its own, as Lightning allows: "later" is better when greater."""

    mode_dict = {**EarlyStopping.mode_dict, "later": torch.gt}
    order_dict = {**EarlyStopping.order_dict, "later": ">"}


def test_a_subclass_may_add_a_mode():
    es = _Later(monitor="m", mode="later", patience=1)
    assert es.monitor_op is torch.gt and es.best_score == -math.inf
    for value in (1.0, 2.0, 2.0):
        es.on_validation_end(fake_trainer(callback_metrics={"m": torch.tensor(value)}), None)
    assert es.best_score == 2.0 and es.stopping_reason and "did not improve" in es.stopping_reason


def _messages(caplog, log_rank_zero_only: bool, rank: int, world_size: int) -> list[str]:
    es = EarlyStopping(monitor="m", patience=0, log_rank_zero_only=log_rank_zero_only)
    es.best_score = 1.0
    trainer = fake_trainer(rank, world_size, callback_metrics={"m": torch.tensor(2.0)})
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="ember.callbacks.early_stopping"):
        es.on_validation_end(trainer, None)
    assert trainer.should_stop and es.stopping_reason  # the decision and its reason do not depend on logging
    return [r.getMessage() for r in caplog.records]


def test_log_rank_zero_only(caplog):
    reason = "EarlyStopping: 'm' did not improve on 1 for 1 checks (patience 0) at epoch 0, global step 4; stopping."
    # One process: no prefix, whatever the setting.
    assert _messages(caplog, False, 0, 1) == _messages(caplog, True, 0, 1) == [reason]
    # Several (as Lightning): by default every rank logs, prefixed with its rank...
    assert _messages(caplog, False, 0, 2) == [f"[rank: 0] {reason}"]
    assert _messages(caplog, False, 1, 2) == [f"[rank: 1] {reason}"]
    # ... and with log_rank_zero_only=True only global rank zero does.
    assert _messages(caplog, True, 0, 2) == [f"[rank: 0] {reason}"]
    assert _messages(caplog, True, 1, 2) == []
    assert EarlyStopping(monitor="m").log_rank_zero_only is False


# ---------------------------------------------------------------------- ModelCheckpoint
def test_format_checkpoint_name_prefix(tmp_path):
    mc = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}")
    name = lambda **kw: os.path.basename(mc.format_checkpoint_name({"epoch": 3, "step": 7}, **kw))  # noqa: E731
    assert name(prefix="pre") == "pre-epoch=3.ckpt"
    assert name(prefix="pre", ver=2) == "pre-epoch=3-v2.ckpt"  # the version goes after the prefixed name
    assert name(prefix="pre", filename="x-{step}") == "pre-x-step=7.ckpt"
    assert name(prefix="") == "-epoch=3.ckpt"  # as Lightning: any prefix but None is joined
    assert name() == "epoch=3.ckpt"
    mc.CHECKPOINT_JOIN_CHAR = "_"
    assert name(prefix="pre") == "pre_epoch=3.ckpt"
    assert ModelCheckpoint().format_checkpoint_name({"epoch": 1, "step": 2}, prefix="p") == "p-epoch=1-step=2.ckpt"


def test_check_monitor_top_k_before_the_top_k_is_full():
    trainer = fake_trainer()
    mc = ModelCheckpoint(monitor="m", save_top_k=2)
    assert mc.check_monitor_top_k(trainer) is False  # no value
    assert mc.check_monitor_top_k(trainer, torch.tensor(5.0)) is True
    mc.best_k_models = {"a.ckpt": torch.tensor(1.0)}
    assert mc.check_monitor_top_k(trainer, torch.tensor(5.0)) is True  # one place left
    assert ModelCheckpoint(monitor="m", save_top_k=-1).check_monitor_top_k(trainer, 1e9) is True
    # Lightning raises a KeyError here; nothing enters a top 0.
    assert ModelCheckpoint(monitor="m", save_top_k=0).check_monitor_top_k(trainer, torch.tensor(0.0)) is False
    assert trainer.strategy.calls == []  # asked only when the k-th best decides


@pytest.mark.parametrize(
    "mode, current, expected",
    [
        ("min", 0.5, True),
        ("min", 2.0, False),  # equal to the k-th best: no
        ("min", 3.0, False),
        ("min", math.nan, False),
        ("max", 3.0, True),
        ("max", 2.0, False),
        ("max", 0.5, False),
        ("max", math.nan, False),
    ],
)
def test_check_monitor_top_k_against_the_kth_best(mode, current, expected):
    trainer = fake_trainer()
    mc = ModelCheckpoint(monitor="m", save_top_k=2, mode=mode)
    mc.best_k_models = {"a.ckpt": torch.tensor(1.0), "b.ckpt": torch.tensor(3.0), "c.ckpt": torch.tensor(2.0)}
    mc.kth_best_model_path = "c.ckpt"
    assert mc.check_monitor_top_k(trainer, torch.tensor(current)) is expected
    assert mc.check_monitor_top_k(trainer, current) is expected  # a plain number too
    assert trainer.strategy.calls == [(expected, True)] * 2  # every process must agree


def test_check_monitor_top_k_is_what_every_process_agrees():
    trainer = fake_trainer(1, 2)
    trainer.strategy.answer = False  # another process says no
    mc = ModelCheckpoint(monitor="m", save_top_k=1)
    mc.best_k_models, mc.kth_best_model_path = {"a.ckpt": torch.tensor(1.0)}, "a.ckpt"
    assert mc.check_monitor_top_k(trainer, torch.tensor(0.0)) is False


class Scored(ember.TrainModule):
    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.scores = scores

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.scores[self.current_epoch])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(tmp_path, callbacks: list[Callback], scores: list[float]) -> ember.Trainer:
    ds = TensorDataset(torch.randn(4, 2), torch.randn(4, 1))
    trainer = ember.Trainer(
        max_epochs=len(scores),
        enable_progress_bar=False,
        logger=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(Scored(scores), DataLoader(ds, batch_size=2), DataLoader(ds, batch_size=4))
    return trainer


def test_check_monitor_top_k_and_to_yaml_after_a_fit(tmp_path):
    mc = ModelCheckpoint(dirpath=tmp_path, monitor="val/loss", save_top_k=2, filename="{epoch}")
    trainer = fit(tmp_path, [mc], [0.5, 0.25, 0.75])
    assert sorted(os.path.basename(p) for p in mc.best_k_models) == ["epoch=0.ckpt", "epoch=1.ckpt"]
    assert mc.check_monitor_top_k(trainer, torch.tensor(0.4)) is True  # beats the k-th best, 0.5
    assert mc.check_monitor_top_k(trainer, torch.tensor(0.5)) is False
    mc.to_yaml()
    with open(tmp_path / "best_k_models.yaml") as fh:
        written = yaml.safe_load(fh)
    assert written == {str(tmp_path / "epoch=0.ckpt"): 0.5, str(tmp_path / "epoch=1.ckpt"): 0.25}
    assert all(mc.file_exists(path, trainer) for path in written)
    assert not mc.file_exists(tmp_path / "epoch=2.ckpt", trainer)  # rotated out (never kept)


def test_to_yaml_writes_best_k_models(tmp_path):
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="m")
    mc.best_k_models = {
        "/runs/a b.ckpt": torch.tensor(1.5),
        "yes": torch.tensor(3),
        "c.ckpt": torch.tensor(math.inf),
    }
    target = tmp_path / "scores.yaml"
    mc.to_yaml(target)
    with open(target) as fh:
        assert yaml.safe_load(fh) == {"/runs/a b.ckpt": 1.5, "yes": 3, "c.ckpt": math.inf}
    mc.best_k_models = {}
    mc.to_yaml(target)
    with open(target) as fh:
        assert yaml.safe_load(fh) == {}
    with pytest.raises(ValueError, match=r"dirpath is set when fit starts.*to_yaml\(filepath=\.\.\.\)"):
        ModelCheckpoint(monitor="m").to_yaml()


def test_file_exists_looks_on_rank_zero_only(tmp_path):
    mc = ModelCheckpoint(dirpath=tmp_path)
    there = tmp_path / "there.ckpt"
    there.write_bytes(b"")
    zero = fake_trainer()
    assert mc.file_exists(there, zero) is True and mc.file_exists(str(tmp_path / "not.ckpt"), zero) is False
    assert zero.strategy.calls == [(True, False), (False, False)]  # shared with an "any" vote
    other = fake_trainer(1, 2)
    assert mc.file_exists(there, other) is False  # this rank does not look; its vote adds nothing
    other.strategy.answer = True  # rank zero saw it
    assert mc.file_exists(tmp_path / "not.ckpt", other) is True


# ---------------------------------------------------------------------- OnExceptionCheckpoint
class Interrupt(Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 1:
            raise KeyboardInterrupt


def test_on_exception_checkpoint_ckpt_path(tmp_path, monkeypatch):
    cb = OnExceptionCheckpoint(tmp_path / "ex", filename="crash")
    assert cb.ckpt_path == os.path.join(str(tmp_path), "ex", "crash.ckpt")
    monkeypatch.chdir(tmp_path)
    assert OnExceptionCheckpoint("rel").ckpt_path == os.path.join(str(tmp_path), "rel", "on_exception.ckpt")
    with pytest.raises(KeyboardInterrupt):
        fit(tmp_path, [Interrupt(), cb], [1.0, 1.0])
    assert os.path.isfile(cb.ckpt_path)  # the file it names is the one written
    with pytest.raises(ValueError, match="cannot be empty"):
        OnExceptionCheckpoint(tmp_path, filename="")
