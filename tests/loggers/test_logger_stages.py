"""Loggers outside fit: validate and test hand their metrics and the hyper-parameters to every logger, and
flush them when they end, with the rows and steps of Lightning 2.6.6 (the same runs there gave the numbers
in the comments); predict writes nothing."""

from __future__ import annotations

import csv
import os

import pytest

import ember
from ember.callbacks import ModelCheckpoint
from ember.loggers import CSVLogger, TensorBoardLogger
from tests.helpers.models import BoringModel, regression_loader

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


class Logged(BoringModel):
    """A BoringModel whose hyper-parameters go to the loggers."""

    def __init__(self, d: int = 4, lr: float = 0.1) -> None:
        super().__init__(d, lr)
        self.save_hyperparameters()


def csv_rows(path: str) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def scalars(log_dir: str, tag: str) -> list[tuple[int, float]]:
    ea = EventAccumulator(log_dir)
    ea.Reload()
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def hparams_text(log_dir: str) -> str:
    with open(os.path.join(log_dir, "hparams.yaml"), encoding="utf-8") as fh:
        return fh.read()


def fit(root, logger, **kwargs) -> tuple[ember.Trainer, Logged]:
    """Two epochs of 8 steps, validated at each epoch's end, with checkpointing on."""
    trainer = ember.Trainer(
        max_epochs=2,
        log_every_n_steps=1,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        logger=logger,
        **kwargs,
    )
    module = Logged()
    trainer.fit(module, regression_loader(n=32, batch_size=4), regression_loader(n=16))
    return trainer, module


def test_a_test_after_fit_writes_its_row_at_the_fits_global_step(tmp_path):
    # Lightning 2.6.6: the test row at step 16 (trainer.global_step after the fit, whatever the best checkpoint's
    # step: here the first epoch's, 8) with epoch 2, after the fit's rows; a second test writes at 16 again.
    logger = CSVLogger(tmp_path)
    trainer, module = fit(tmp_path, logger, callbacks=[ModelCheckpoint(monitor="val_loss", mode="min")])
    (result,) = trainer.test(ckpt_path="best", dataloaders=regression_loader(n=16), verbose=False)
    assert trainer.ckpt_path.endswith("epoch=0-step=8.ckpt")
    header, rows = csv_rows(logger.metrics_file)
    assert header == ["step", "train_loss", "epoch", "val_loss", "test_loss"]
    assert [r["step"] for r in rows] == [str(s) for s in range(17)]
    assert {k: v for k, v in rows[-1].items() if v} == {
        "step": "16",
        "epoch": "2.0",
        "test_loss": repr(result["test_loss"]),
    }
    # A second test in the same process, on other data: its value at step 16 too, in a row of its own (one value
    # per key and row; equal values would share the row).
    (again,) = trainer.test(module, regression_loader(n=8, seed=1), verbose=False)
    _, rows = csv_rows(logger.metrics_file)
    assert [(r["step"], r["test_loss"]) for r in rows[16:]] == [
        ("16", repr(result["test_loss"])),
        ("16", repr(again["test_loss"])),
    ]


def test_the_default_logger_records_test_and_validate_after_a_fit_and_alone(tmp_path):
    # logger=True, checkpointing on. Lightning 2.6.6: a test after the fit at step 16 in the fit's directory; a
    # test or a validate on a new Trainer in the same root directory at step 0 (epoch 0), each in a new version
    # directory with the module's hparams.yaml.
    trainer, _ = fit(tmp_path, True)
    (result,) = trainer.test(ckpt_path="last", dataloaders=regression_loader(n=16), verbose=False)
    assert scalars(trainer.log_dir, "test_loss") == [(16, result["test_loss"])]
    assert hparams_text(trainer.log_dir) == "d: 4\nlr: 0.1\n"
    for stage, key, version in (("test", "test_loss", 1), ("validate", "val_loss", 2)):
        alone = ember.Trainer(enable_progress_bar=False, default_root_dir=str(tmp_path))
        (result,) = getattr(alone, stage)(Logged(lr=0.2), regression_loader(n=16), verbose=False)
        assert alone.log_dir == str(tmp_path / "ember_logs" / f"version_{version}")
        assert scalars(alone.log_dir, key) == [(0, result[key])]
        assert scalars(alone.log_dir, "epoch") == [(0, 0.0)]
        assert hparams_text(alone.log_dir) == "d: 4\nlr: 0.2\n"


@pytest.mark.parametrize("stage", ["test", "validate"])
def test_a_csv_logger_on_a_test_or_validate_alone_writes_its_file(tmp_path, stage):
    logger = CSVLogger(tmp_path)
    trainer = ember.Trainer(logger=logger, enable_progress_bar=False, default_root_dir=str(tmp_path))
    (result,) = getattr(trainer, stage)(Logged(), regression_loader(n=16), verbose=False)
    key = "test_loss" if stage == "test" else "val_loss"
    header, rows = csv_rows(logger.metrics_file)  # (before the run ends: flushed when it does)
    assert logger.log_dir == str(tmp_path / "ember_logs" / "version_0")
    assert header == ["step", key, "epoch"]
    assert rows == [{"step": "0", key: repr(result[key]), "epoch": "0.0"}]
    assert hparams_text(logger.log_dir) == "d: 4\nlr: 0.1\n"


def test_predict_writes_nothing(tmp_path):
    # Alone: no run directory at all (Lightning 2.6.6 makes one, holding hparams.yaml and, with TensorBoard, an
    # event file with no event: a version number used up by a run that logs nothing).
    for logger in (True, CSVLogger(tmp_path)):
        trainer = ember.Trainer(logger=logger, enable_progress_bar=False, default_root_dir=str(tmp_path))
        assert len(trainer.predict(Logged(), regression_loader(n=8))) == 1
    assert not (tmp_path / "ember_logs").exists()
    # After a fit: the run's files as the fit left them.
    trainer, module = fit(tmp_path, [TensorBoardLogger(tmp_path), CSVLogger(tmp_path)])

    def files() -> dict[str, bytes]:
        out = {}
        for name in sorted(os.listdir(trainer.log_dir)):
            path = os.path.join(trainer.log_dir, name)
            if os.path.isfile(path):
                with open(path, "rb") as fh:
                    out[name] = fh.read()
        return out

    before = files()
    assert "metrics.csv" in before and "hparams.yaml" in before
    trainer.predict(module, regression_loader(n=8))
    assert files() == before
