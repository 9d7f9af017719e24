"""ember.loggers: the loggers under Lightning's module name, the same classes as ember.callbacks'."""

from __future__ import annotations

import pytest

import ember
import ember.callbacks
import ember.loggers
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


def test_the_names_are_ember_callbacks_classes_and_a_fit_writes_through_them(tmp_path):
    assert ember.loggers.Logger is ember.callbacks.Logger
    assert ember.loggers.CSVLogger is ember.callbacks.CSVLogger
    assert ember.loggers.TensorBoardLogger is ember.callbacks.TensorBoardLogger
    logger = ember.loggers.CSVLogger(str(tmp_path))
    fast_trainer(logger=logger, log_every_n_steps=1).fit(BoringModel(), regression_loader(n=8))
    assert (tmp_path / "ember_logs" / "version_0" / "metrics.csv").read_text().startswith("step,")
    assert {"Logger", "CSVLogger", "TensorBoardLogger", "MLFlowLogger"} <= set(dir(ember.loggers))


def test_an_unknown_name_says_so():
    with pytest.raises(AttributeError, match="no attribute 'CometLogger'"):
        ember.loggers.CometLogger  # noqa: B018
