"""The line a successful fit prints at its end, on rank zero: where the logs and checkpoints went."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ModelCheckpoint
from ember.loggers import CSVLogger
from ember.trainer.fit_summary import fit_summary
from tests.helpers.models import OtherRank


class Tiny(ember.TrainModule):
    def __init__(self, fail_at_epoch: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.fail_at_epoch = fail_at_epoch

    def training_step(self, batch, batch_idx):
        if self.current_epoch == self.fail_at_epoch:
            raise RuntimeError("training failed")
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data():
    return DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)


def fit(module=None, **kwargs):
    kwargs = {
        "max_epochs": 2,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "log_every_n_steps": 1,
        **kwargs,
    }
    trainer = ember.Trainer(**kwargs)
    trainer.fit(module or Tiny(), data(), data())
    return trainer


def summary_lines(capsys):
    return [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ember: ")]


def test_default_configuration_names_the_run_directory_and_its_checkpoints(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fit(logger=True)  # defaults: a TensorBoard (or CSV) logger and a ModelCheckpoint
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out  # one line, nothing else on stdout
    line = out.strip()
    ckpts = "ember_logs/version_0/checkpoints".replace("/", os.sep)
    assert line == (
        f"ember: logs in {os.path.join('ember_logs', 'version_0')}; "
        f"checkpoint {os.path.join(ckpts, 'epoch=1-step=8.ckpt')}; "
        f"last checkpoint {os.path.join(ckpts, 'last.ckpt')}"
    )
    # every path it names is there, relative to the working directory
    for path in ("ember_logs/version_0", f"{ckpts}/epoch=1-step=8.ckpt", f"{ckpts}/last.ckpt"):
        assert os.path.exists(tmp_path / path), path


def test_without_a_logger_only_the_checkpoints_are_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    checkpoint = ModelCheckpoint(monitor="val/loss", save_top_k=1)
    fit(logger=False, callbacks=[checkpoint])
    [line] = summary_lines(capsys)
    assert "logs in" not in line
    best = os.path.relpath(checkpoint.best_model_path)
    assert line == f"ember: best val/loss checkpoint {best}; last checkpoint {os.path.join('checkpoints', 'last.ckpt')}"
    assert best.startswith("checkpoints" + os.sep) and os.path.isfile(best)


def test_nothing_configured_prints_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fit(logger=False, enable_checkpointing=False)
    assert capsys.readouterr().out == ""


def test_paths_outside_the_working_directory_are_absolute(tmp_path, monkeypatch, capsys):
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    root = tmp_path / "runs"
    fit(default_root_dir=str(root), logger=CSVLogger(), enable_checkpointing=False)
    assert summary_lines(capsys) == [f"ember: logs in {root / 'ember_logs' / 'version_0'}"]


def test_several_checkpoint_callbacks_each_name_their_files_once(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    by_loss = ModelCheckpoint(dirpath="a", monitor="val/loss", save_last=False)
    latest = ModelCheckpoint(dirpath="b", save_last=False)
    fit(logger=False, callbacks=[by_loss, latest])
    assert summary_lines(capsys) == [
        f"ember: best val/loss checkpoint {os.path.relpath(by_loss.best_model_path)}; "
        f"checkpoint {os.path.relpath(latest.best_model_path)}"
    ]


def test_a_failed_fit_prints_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="training failed"):
        fit(Tiny(fail_at_epoch=1), logger=True)
    assert os.path.isfile(tmp_path / "ember_logs" / "version_0" / "checkpoints" / "last.ckpt")  # epoch 0 saved
    assert summary_lines(capsys) == []


def test_other_ranks_print_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    checkpoint = ModelCheckpoint(dirpath="ckpts")
    trainer = fit(strategy=OtherRank(), logger=CSVLogger(), callbacks=[checkpoint])
    assert capsys.readouterr().out == ""
    assert fit_summary(trainer) is not None  # there was something to say, but not on this rank
