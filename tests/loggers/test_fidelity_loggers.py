"""The loggers' file behaviour that Lightning code relies on: when CSVLogger writes, how a prefix joins."""

from __future__ import annotations

import csv
import os

import pytest

from ember.loggers import CSVLogger, TensorBoardLogger


def read_rows(path: str) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def test_csv_rows_reach_the_file_when_the_step_before_a_multiple_of_n_is_logged(tmp_path):
    # As Lightning: a write at step s flushes when (s + 1) % flush_logs_every_n_steps == 0, that row included.
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=2)
    logger.log_metrics({"a": 1.0}, step=0)
    assert not os.path.exists(logger.metrics_file)
    logger.log_metrics({"a": 2.0}, step=1)
    assert [r["a"] for r in read_rows(logger.metrics_file)[1]] == ["1.0", "2.0"]
    logger.log_metrics({"a": 3.0}, step=2)
    assert len(read_rows(logger.metrics_file)[1]) == 2
    logger.log_metrics({"a": 4.0}, step=3)
    assert [r["a"] for r in read_rows(logger.metrics_file)[1]] == ["1.0", "2.0", "3.0", "4.0"]


def test_csv_flush_uses_the_row_number_when_no_step_is_given(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=3)
    for value in (1.0, 2.0):
        logger.log_metrics({"a": value})
    assert not os.path.exists(logger.metrics_file)
    logger.log_metrics({"a": 3.0})  # row 2: (2 + 1) % 3 == 0
    assert [(r["step"], r["a"]) for r in read_rows(logger.metrics_file)[1]] == [
        ("0", "1.0"),
        ("1", "2.0"),
        ("2", "3.0"),
    ]


def test_csv_columns_that_appear_later_are_in_the_header_as_soon_as_their_row_is_written(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    logger.log_metrics({"a": 1, "b": 2})
    logger.log_metrics({"a": 1, "b": 2, "c": 3})
    header, rows = read_rows(logger.metrics_file)
    assert header == ["step", "a", "b", "c"]
    assert [r["c"] for r in rows] == ["", "3"]
    logger.log_metrics({"a": 1, "c": 3})  # a key that disappears keeps its column
    header, rows = read_rows(logger.metrics_file)
    assert header == ["step", "a", "b", "c"] and [r["b"] for r in rows] == ["2", "2", ""]


def test_csv_values_logged_at_a_step_already_written_go_into_its_row(tmp_path):
    # With every write flushed, a validation and an epoch end at a step whose row is on disk still fill that
    # row: once with a new column (the file is rewritten), once with known columns (its last row is).
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    logger.log_metrics({"train": 1.0, "epoch": 0.0}, step=0)
    logger.log_metrics({"val": 2.0, "epoch": 0.0}, step=0)
    logger.log_metrics({"train": 3.0, "epoch": 0.0}, step=1)
    logger.log_metrics({"val": 4.0}, step=1)
    logger.log_metrics({"train": 5.0}, step=1)  # the same key again at that step: a row of its own
    header, rows = read_rows(logger.metrics_file)
    assert header == ["step", "train", "epoch", "val"]
    assert [(r["step"], r["train"], r["epoch"], r["val"]) for r in rows] == [
        ("0", "1.0", "0.0", "2.0"),
        ("1", "3.0", "0.0", "4.0"),
        ("1", "5.0", "", ""),
    ]
    logger.log_metrics({"epoch": 0.0, "late": 6.0}, step=1)
    logger.finalize("success")
    header, rows = read_rows(logger.metrics_file)
    assert header == ["step", "train", "epoch", "val", "late"]
    assert [(r["step"], r["train"], r["epoch"], r["late"]) for r in rows][1:] == [
        ("1", "3.0", "0.0", ""),
        ("1", "5.0", "0.0", "6.0"),
    ]


def test_csv_a_later_logger_on_the_same_directory_appends_after_a_merged_last_row(tmp_path):
    logger = CSVLogger(tmp_path, version="v", flush_logs_every_n_steps=1)
    logger.log_metrics({"a": 1.0}, step=0)
    logger.log_metrics({"b": 2.0}, step=0)
    logger.log_metrics({"a": 3.0}, step=1)
    logger.log_metrics({"b": 4.0}, step=1)
    again = CSVLogger(tmp_path, version="v")
    again.log_metrics({"a": 5.0}, step=2)
    again.finalize("success")
    assert [(r["step"], r["a"], r["b"]) for r in read_rows(again.metrics_file)[1]] == [
        ("0", "1.0", "2.0"),
        ("1", "3.0", "4.0"),
        ("2", "5.0", ""),
    ]


@pytest.mark.parametrize("prefix", ["", "train"])
def test_csv_prefix_is_joined_with_a_dash(tmp_path, prefix):
    logger = CSVLogger(tmp_path, prefix=prefix, flush_logs_every_n_steps=1)
    logger.log_metrics({"loss": 1.0}, step=0)
    assert read_rows(logger.metrics_file)[0] == ["step", "train-loss" if prefix else "loss"]


def test_tensorboard_prefix_is_joined_with_a_dash(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, prefix="train")
    logger.log_metrics({"loss": 1.0}, step=3)
    logger.finalize("success")
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert events.Tags()["scalars"] == ["train-loss"]
    assert [(e.step, e.value) for e in events.Scalars("train-loss")] == [(3, 1.0)]


def test_csv_experiment_offers_lightnings_writer_names(tmp_path):
    logger = CSVLogger(tmp_path, name="test", version=0, flush_logs_every_n_steps=2)
    experiment = logger.experiment
    assert experiment.metrics_file_path == os.path.join(logger.log_dir, "metrics.csv") == logger.metrics_file
    assert experiment.log_dir == logger.log_dir
    experiment.log_metrics({"test": 1}, step=0)
    assert experiment.metrics == [{"step": 0, "test": 1}]  # buffered
    logger.log_metrics({"test": 2}, step=1)  # (1 + 1) % 2 == 0: written
    assert experiment.metrics == []
    experiment.log_metrics({"a": 1, "c": 3})
    experiment.save()
    with open(experiment.metrics_file_path) as fh:
        assert len(fh.readlines()) == 4  # the header and three rows
    experiment.log_hparams({"lr": 0.1})
    assert experiment.hparams == {"lr": 0.1}
    assert os.path.isfile(os.path.join(logger.log_dir, "hparams.yaml"))
