"""CSVLogger round trips through the standard library's csv reader; the hparams.yaml emitter."""

from __future__ import annotations

import csv
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.loggers import CSVLogger


class Tiny(ember.TrainModule):
    """Logs ``train/loss`` every step and, from global step 5 on, a key that did not exist before."""

    def __init__(self, lr: float = 0.05, fail_at: int = -1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 1)
        self.losses: dict[int, float] = {}
        self.late: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        if self.global_step == self.hparams.fail_at:
            raise RuntimeError("boom")
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        step = self.global_step  # as Lightning: this batch's metrics are written at its step's index, 0, 1, ...
        self.losses[step] = loss.item()
        self.log("train/loss", loss)
        if step >= 5:
            self.late[step] = float(step) / 10
            self.log("late", float(step) / 10)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def fit(tmp_path, logger, module=None, **kw):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    args = dict(
        max_epochs=2,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        logger=logger,
    )
    args.update(kw)
    trainer = ember.Trainer(**args)
    module = module or Tiny()
    trainer.fit(module, DataLoader(ds, batch_size=4), DataLoader(ds, batch_size=8))
    return trainer, module


def read_rows(path):
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return reader.fieldnames, list(reader)


@pytest.mark.parametrize("flush_every", [1, 3, 100])
def test_round_trip_with_a_key_appearing_mid_run(tmp_path, flush_every):
    logger = CSVLogger(save_dir=tmp_path, flush_logs_every_n_steps=flush_every)
    trainer, module = fit(tmp_path, logger)
    path = os.path.join(str(tmp_path), "ember_logs", "version_0", "metrics.csv")
    assert logger.metrics_file == path and trainer.log_dir == logger.log_dir
    header, rows = read_rows(path)
    assert header == ["step", "train/loss", "epoch", "late", "val/loss"]  # in order of appearance
    # one row per logged step, 16 steps written (as Lightning) at their indices 0..15; the epoch-end validation
    # value shares the row of the step it ran after (the epoch's last step, 7 and 15)
    assert [int(r["step"]) for r in rows] == list(range(16))
    for r in rows:
        step = int(r["step"])
        assert float(r["train/loss"]) == module.losses[step]  # floats survive exactly
        assert float(r["epoch"]) == (0.0 if step <= 7 else 1.0)
        # a number logged with self.log is kept as a float32 tensor (as Lightning), so 0.6 is written as float32's 0.6
        assert r["late"] == (repr(torch.tensor(module.late[step]).item()) if step >= 5 else "")
        if step in (7, 15):
            assert float(r["val/loss"]) == trainer.history[step // 8]["val/loss"]
        else:
            assert r["val/loss"] == ""
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as fh:
        assert fh.read() == "lr: 0.05\nfail_at: -1\n"


def test_rows_are_written_when_fit_fails(tmp_path):
    logger = CSVLogger(save_dir=tmp_path, flush_logs_every_n_steps=100)
    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path, logger, Tiny(fail_at=3))
    _, rows = read_rows(logger.metrics_file)
    assert [int(r["step"]) for r in rows] == [0, 1, 2]  # the 3 steps before the failing batch, at their indices


def test_a_second_fit_appends_to_the_same_file_and_widens_it(tmp_path):
    logger = CSVLogger(save_dir=tmp_path, version="fixed", flush_logs_every_n_steps=2)
    logger.log_metrics({"a": 1.0}, 1)
    logger.log_metrics({"a": 2.0}, 2)
    logger.log_metrics({"a": 3.0}, 3)  # flushes the first two
    logger.finalize("success")
    again = CSVLogger(save_dir=tmp_path, version="fixed")  # a new process writing to the same directory
    again.log_metrics({"b": 9.0}, 4)
    again.finalize("success")
    header, rows = read_rows(again.metrics_file)
    assert header == ["step", "a", "b"]
    assert [(r["step"], r["a"], r["b"]) for r in rows] == [
        ("1", "1.0", ""),
        ("2", "2.0", ""),
        ("3", "3.0", ""),
        ("4", "", "9.0"),
    ]


def test_same_step_merges_only_without_conflict(tmp_path):
    logger = CSVLogger(save_dir=tmp_path, prefix="p")
    logger.log_metrics({"x": 1.0, "epoch": 0.0}, 5)
    logger.log_metrics({"y": 2.0, "epoch": 0.0}, 5)
    logger.log_metrics({"x": 3.0}, 5)  # the same key again at the same step: a new row
    logger.finalize("success")
    header, rows = read_rows(logger.metrics_file)
    assert header == ["step", "p-x", "p-epoch", "p-y"]  # the prefix joined with "-", as Lightning
    assert [(r["p-x"], r["p-y"]) for r in rows] == [("1.0", "2.0"), ("3.0", "")]


def test_flush_setting_is_checked():
    with pytest.raises(ValueError, match="flush_logs_every_n_steps"):
        CSVLogger(flush_logs_every_n_steps=0)


def test_a_rewind_drops_the_rows_from_its_step_on(tmp_path):
    first = CSVLogger(save_dir=tmp_path, version=0, flush_logs_every_n_steps=1)
    for step in range(6):
        first.log_metrics({"a": float(step)}, step)
        if step == 2:
            first.log_metrics({"b": 20.0}, step)  # as an epoch's end, written after its last step's values
    first.finalize("success")
    again = CSVLogger(save_dir=tmp_path, version=0)  # a new process continuing the run
    again.rewind(3)  # what a fit resumed from a checkpoint after 3 steps does (on_load_checkpoint)
    # The resumed fit may write the last kept row's step again (an epoch end the checkpoint came before): its
    # value replaces the one the stopped run wrote there, rather than starting a second row of that step.
    again.log_metrics({"b": 21.0}, 2)
    again.log_metrics({"a": 30.0}, 3)
    again.log_metrics({"a": 40.0}, 4)
    again.finalize("success")
    header, rows = read_rows(again.metrics_file)
    assert header == ["step", "a", "b"]
    assert [(r["step"], r["a"], r["b"]) for r in rows] == [
        ("0", "0.0", ""),
        ("1", "1.0", ""),
        ("2", "2.0", "21.0"),
        ("3", "30.0", ""),
        ("4", "40.0", ""),
    ]
    again.rewind(4)  # a second resume, in the same process
    again.log_metrics({"a": 41.0, "c": 1.0}, 4)  # (a new column: the whole file is rewritten)
    again.finalize("success")
    header, rows = read_rows(again.metrics_file)
    assert header == ["step", "a", "b", "c"]
    assert [(r["step"], r["a"], r["c"]) for r in rows][3:] == [("3", "30.0", ""), ("4", "41.0", "1.0")]


def test_a_process_killed_while_rows_are_dropped_leaves_the_file_whole(tmp_path, monkeypatch):
    logger = CSVLogger(save_dir=tmp_path, version=0, flush_logs_every_n_steps=1)
    for step in range(4):
        logger.log_metrics({"a": float(step)}, step)
    with open(logger.metrics_file, "rb") as fh:
        before = fh.read()

    class Killed(BaseException):
        pass

    def killed(*args):  # the moment before the rewritten file would take the old one's name
        raise Killed

    again = CSVLogger(save_dir=tmp_path, version=0)
    again.rewind(2)
    with monkeypatch.context() as m:
        m.setattr(os, "replace", killed)
        with pytest.raises(Killed):
            again.log_metrics({"a": 20.0}, 2)
    with open(logger.metrics_file, "rb") as fh:
        assert fh.read() == before  # every row still there
    resumed = CSVLogger(save_dir=tmp_path, version=0)  # the next attempt
    resumed.rewind(2)
    resumed.log_metrics({"a": 20.0}, 2)
    resumed.finalize("success")
    assert [(r["step"], r["a"]) for r in read_rows(resumed.metrics_file)[1]] == [
        ("0", "0.0"),
        ("1", "1.0"),
        ("2", "20.0"),
    ]
