"""The Logger API as Lightning's: log_hyperparams with no metrics (a dict, a Namespace, or nothing), log_metrics
without a step, and a subclass's name / version properties deciding log_dir and where checkpoints go.

Checked against Lightning 2.6.6 (its CSVLogger, and a Logger subclass with save_dir / name / version) unless a
test says where ember differs.
"""

from __future__ import annotations

import csv
import os
from argparse import Namespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ember.loggers import CSVLogger, Logger, TensorBoardLogger
from tests.helpers.models import BoringModel, fast_trainer


def loader() -> DataLoader:
    torch.manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 1)), batch_size=2)


def csv_rows(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


# ---------------------------------------------------------------------- name / version / log_dir
class Custom(Logger):
    """A logger of the user's own, writing nothing itself, with Lightning's three directory properties."""

    def __init__(self, root: str) -> None:
        self.root = root

    @property
    def name(self) -> str:
        return "custom"

    @property
    def version(self) -> int:
        return 3

    @property
    def save_dir(self) -> str:
        return self.root


def test_a_logger_subclass_name_and_version_decide_where_checkpoints_go(tmp_path):
    root = str(tmp_path / "root")
    logger = Custom(root)
    assert logger.log_dir == os.path.join(root, "custom", "version_3")
    trainer = fast_trainer(logger=logger, enable_checkpointing=True, default_root_dir=str(tmp_path))
    trainer.fit(BoringModel(), loader())
    # Lightning 2.6.6: <save_dir>/<name>/version_<version>/checkpoints/epoch=0-step=2.ckpt, and trainer.log_dir is
    # the save_dir for a logger that is not TensorBoard's or CSV's.
    assert trainer.checkpoint_callback.best_model_path == os.path.join(
        root, "custom", "version_3", "checkpoints", "epoch=0-step=2.ckpt"
    )
    assert trainer.log_dir == root


class NoDir(Logger):
    @property
    def name(self) -> str:
        return "nodir"

    @property
    def version(self) -> int:
        return 3


def test_a_logger_without_save_dir_puts_checkpoints_under_the_default_root_dir(tmp_path):
    """Lightning 2.6.6: trainer.log_dir is None; checkpoints go to <default_root_dir>/nodir/version_3/checkpoints."""
    trainer = fast_trainer(logger=NoDir(), enable_checkpointing=True, default_root_dir=str(tmp_path))
    trainer.fit(BoringModel(), loader())
    assert trainer.log_dir is None
    assert trainer.checkpoint_callback.best_model_path == os.path.join(
        str(tmp_path), "nodir", "version_3", "checkpoints", "epoch=0-step=2.ckpt"
    )


def test_a_logger_without_save_dir_has_no_log_dir():
    assert Logger().log_dir is None


class NamedCSV(CSVLogger):
    @property
    def name(self) -> str:
        return "custom"

    @property
    def version(self) -> str:
        return "v7"


def test_a_csv_logger_subclass_name_and_version_decide_its_directory(tmp_path):
    logger = NamedCSV(save_dir=str(tmp_path))
    assert logger.root_dir == os.path.join(str(tmp_path), "custom")
    assert logger.log_dir == os.path.join(str(tmp_path), "custom", "v7")
    trainer = fast_trainer(logger=logger, enable_checkpointing=True, log_every_n_steps=1)
    trainer.fit(BoringModel(), loader())
    # Lightning 2.6.6: trainer.log_dir is custom/v7, holding checkpoints/ and metrics.csv
    assert trainer.log_dir == logger.log_dir
    assert sorted(os.listdir(logger.log_dir)) == ["checkpoints", "metrics.csv"]
    assert trainer.checkpoint_callback.best_model_path == os.path.join(
        logger.log_dir, "checkpoints", "epoch=0-step=2.ckpt"
    )


# ---------------------------------------------------------------------- log_hyperparams
def test_csv_log_hyperparams_takes_nothing_a_dict_or_a_namespace(tmp_path):
    logger = CSVLogger(save_dir=str(tmp_path), name="x")
    logger.log_hyperparams()  # no params, no metrics: nothing to record, and no error
    logger.log_hyperparams(Namespace(lr=0.1, layers=3))
    logger.log_hyperparams({"optimizer": "adam"})
    logger.save()
    # Lightning 2.6.6 writes the same three values (in sorted order: "layers: 3\nlr: 0.1\noptimizer: adam\n").
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as fh:
        assert fh.read() == "lr: 0.1\nlayers: 3\noptimizer: adam\n"
    assert os.listdir(logger.log_dir) == ["hparams.yaml"]  # no metrics were given, so no metrics.csv


def test_log_hyperparams_refuses_other_types(tmp_path):
    with pytest.raises(TypeError, match="log_hyperparams expects a dict, an argparse.Namespace or None, got list"):
        CSVLogger(save_dir=str(tmp_path)).log_hyperparams([("lr", 0.1)])


def test_the_base_logger_accepts_every_form():
    lg = Logger()
    lg.log_hyperparams()
    lg.log_hyperparams(Namespace(a=1), {"m": 1.0})
    lg.log_metrics({"a": 1.0})


# ---------------------------------------------------------------------- log_metrics without a step
def test_csv_log_metrics_without_a_step_numbers_its_rows(tmp_path):
    logger = CSVLogger(save_dir=str(tmp_path), flush_logs_every_n_steps=2)
    for i in range(5):
        logger.log_metrics({"a": float(i)})
    logger.log_metrics({"t": torch.tensor(2.5)}, step=7)  # tensors are written as numbers, as Lightning
    logger.save()
    rows = csv_rows(logger.metrics_file)
    # ember numbers step-less rows 0, 1, 2...; Lightning 2.6.6 numbers them by its rows not yet flushed
    # (0, 1, 0, 1, 0 with flush_logs_every_n_steps=2), which repeats steps.
    assert [(r["step"], r["a"], r["t"]) for r in rows] == [
        ("0", "0.0", ""),
        ("1", "1.0", ""),
        ("2", "2.0", ""),
        ("3", "3.0", ""),
        ("4", "4.0", ""),
        ("7", "", "2.5"),
    ]


def test_tensorboard_log_metrics_without_a_step_writes_at_step_zero(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(save_dir=str(tmp_path))
    logger.log_metrics({"a": 1.0})  # SummaryWriter.add_scalar(tag, value) without a step writes step 0
    logger.log_metrics({"b": torch.tensor(2.0)}, step=3)
    logger.log_hyperparams(Namespace(lr=0.1))
    logger.finalize("success")
    ea = EventAccumulator(logger.log_dir)
    ea.Reload()
    assert {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]} == {
        "a": [(0, 1.0)],
        "b": [(3, 2.0)],
    }
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as fh:
        assert fh.read() == "lr: 0.1\n"


def test_log_hyperparams_metrics_go_in_at_the_given_step(tmp_path):
    # Lightning 2.6.6's TensorBoardLogger.log_hyperparams(params, metrics, step) logs the metrics at step.
    logger = CSVLogger(save_dir=str(tmp_path))
    logger.log_hyperparams({"lr": 0.1}, {"hp_metric": 0.5}, step=4)
    logger.log_hyperparams({"lr": 0.1}, {"other": 1.0})
    logger.save()
    assert [(r["step"], r["hp_metric"], r["other"]) for r in csv_rows(logger.metrics_file)] == [
        ("4", "0.5", ""),
        ("0", "", "1.0"),
    ]
