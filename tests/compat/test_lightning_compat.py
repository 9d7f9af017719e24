"""ember against a recorded Lightning run: the same Lightning-style scenario (``scenario.py``: logging in
training and validation steps and in epoch-end hooks, a scheduler, ModelCheckpoint with top-k and
``save_last``, EarlyStopping, a recording logger) run on ember must give what PyTorch Lightning 2.6.6
gave (``lightning_2_6_6.json``, recorded by ``record_lightning.py``): the same counters, metrics,
logger calls and checkpoint file names. Values are compared rounded to 4 decimals.
"""

from __future__ import annotations

import json
import os
import types
from typing import Any

import pytest

import ember
from tests.compat.scenario import run

EXPECTED = json.load(open(os.path.join(os.path.dirname(__file__), "lightning_2_6_6.json")))

EMBER = types.SimpleNamespace(
    Module=ember.TrainModule,
    Trainer=ember.Trainer,
    Logger=ember.loggers.Logger,
    ModelCheckpoint=ember.callbacks.ModelCheckpoint,
    EarlyStopping=ember.callbacks.EarlyStopping,
)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(EMBER, str(tmp_path_factory.mktemp("compat")))


@pytest.mark.parametrize(
    "field",
    [
        "global_step",
        "current_epoch",
        "stopped_epoch",
        "callback_metrics",
        "progress_bar_metrics",
        "logged_metrics",
        "logger_calls",
        "checkpoint_files",
        "best_model_path",
        "fit_logger_calls",
        "validate_results",
        "test_results",
    ],
)
def test_matches_lightning(result: dict[str, Any], field: str) -> None:
    assert result[field] == EXPECTED[field]
