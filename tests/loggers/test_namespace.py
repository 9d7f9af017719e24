"""ember.loggers: the loggers under Lightning's module name (and only there, as in Lightning)."""

from __future__ import annotations

import pytest

import ember
import ember.callbacks
import ember.loggers
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


def test_the_loggers_are_defined_in_ember_loggers_and_a_fit_writes_through_them(tmp_path):
    for name in ("Logger", "CSVLogger", "TensorBoardLogger"):
        assert getattr(ember.loggers, name).__module__.startswith("ember.loggers."), name
    logger = ember.loggers.CSVLogger(str(tmp_path))
    fast_trainer(logger=logger, log_every_n_steps=1).fit(BoringModel(), regression_loader(n=8))
    assert (tmp_path / "ember_logs" / "version_0" / "metrics.csv").read_text().startswith("step,")
    assert {"Logger", "CSVLogger", "TensorBoardLogger", "MLFlowLogger"} <= set(dir(ember.loggers))


def test_an_unknown_name_says_so():
    with pytest.raises(AttributeError, match="no attribute 'CometLogger'"):
        ember.loggers.CometLogger  # noqa: B018


@pytest.mark.parametrize("name", ["Logger", "CSVLogger", "TensorBoardLogger"])
def test_a_logger_asked_of_ember_callbacks_says_where_it_lives(name):
    with pytest.raises(ImportError, match=rf"loggers live in ember.loggers.*from ember.loggers import {name}"):
        getattr(ember.callbacks, name)
    with pytest.raises(ImportError, match=rf"Use ember.loggers.{name}"):
        exec(f"from ember.callbacks import {name}", {})
