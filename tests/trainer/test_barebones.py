"""Trainer(barebones=True): everything beside the training loop that may take time is off (checkpointing, loggers,
self.log, step logging, the progress bar, the model summary, the sanity check), and an argument turning one back on
is refused; log_every_n_steps=0 on its own. Expected values read from Lightning 2.6."""

from __future__ import annotations

import inspect
import logging
import warnings

import pytest

import ember
from ember.callbacks import ModelCheckpoint, ModelSummary, ProgressBar
from tests.helpers.models import BoringModel, OtherRank, RecordingLogger, regression_loader


def barebones(**kwargs) -> ember.Trainer:
    kwargs.setdefault("accelerator", "cpu")
    kwargs.setdefault("max_epochs", 1)
    return ember.Trainer(barebones=True, **kwargs)


def test_barebones_turns_off_checkpointing_loggers_bar_summary_step_logging_and_sanity_check():
    trainer = barebones()
    assert trainer.barebones is True
    assert not any(isinstance(c, (ModelCheckpoint, ProgressBar, ModelSummary)) for c in trainer.callbacks)
    assert trainer.checkpoint_callback is None and trainer.progress_bar_callback is None
    assert trainer.loggers == [] and trainer.logger is None
    assert trainer.log_every_n_steps == 0 and trainer.num_sanity_val_steps == 0


def test_without_barebones_the_defaults_stand():
    trainer = ember.Trainer(accelerator="cpu")
    assert trainer.barebones is False
    assert isinstance(trainer.checkpoint_callback, ModelCheckpoint)
    assert isinstance(trainer.progress_bar_callback, ProgressBar)
    assert trainer.log_every_n_steps == 50 and trainer.num_sanity_val_steps == 2
    assert len(trainer.loggers) == 1


def test_the_switches_default_to_none_as_lightning_and_none_means_the_default():
    params = inspect.signature(ember.Trainer).parameters
    for name in ("enable_checkpointing", "enable_progress_bar", "log_every_n_steps", "num_sanity_val_steps"):
        assert params[name].default is None, name
    assert params["barebones"].default is False
    trainer = ember.Trainer(
        accelerator="cpu", enable_checkpointing=None, enable_progress_bar=None, log_every_n_steps=None
    )
    assert isinstance(trainer.checkpoint_callback, ModelCheckpoint)
    assert isinstance(trainer.progress_bar_callback, ProgressBar)
    assert trainer.log_every_n_steps == 50
    assert ember.Trainer(accelerator="cpu", num_sanity_val_steps=None).num_sanity_val_steps == 2


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("enable_checkpointing", True),
        ("logger", "a logger"),
        ("logger", "a list of loggers"),
        ("enable_progress_bar", True),
        ("log_every_n_steps", 1),
        ("enable_model_summary", True),
        ("num_sanity_val_steps", 2),
        ("num_sanity_val_steps", -1),
        ("fast_dev_run", True),
        ("fast_dev_run", 3),
        ("detect_anomaly", True),
        ("profiler", "simple"),
    ],
)
def test_an_argument_turning_on_what_barebones_turns_off_is_refused_by_name(name, value):
    if value == "a logger":
        value = RecordingLogger()
    elif value == "a list of loggers":
        value = [RecordingLogger()]
    with pytest.raises(ValueError, match=rf"Trainer\(barebones=True\) cannot take {name}=") as err:
        barebones(**{name: value})
    assert "barebones=True" in str(err.value).split(":", 1)[1]  # and it says what to do


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enable_checkpointing": False},
        {"logger": False},
        {"logger": None},
        {"logger": True},  # ember's default: barebones cannot tell it was given, and turns it off
        {"enable_progress_bar": False},
        {"log_every_n_steps": 0},
        {"enable_model_summary": False},
        {"num_sanity_val_steps": 0},
        {"fast_dev_run": False},
        {"fast_dev_run": 0},
        {"detect_anomaly": False},
        {"profiler": None},
    ],
)
def test_values_that_agree_with_barebones_are_taken(kwargs):
    trainer = barebones(**kwargs)
    assert trainer.loggers == [] and trainer.checkpoint_callback is None and trainer.log_every_n_steps == 0


def test_a_callback_barebones_turns_off_is_refused():
    with pytest.raises(ValueError, match="enable_checkpointing=False but a ModelCheckpoint"):
        barebones(callbacks=[ModelCheckpoint()])
    with pytest.raises(ValueError, match="enable_progress_bar=False"):
        barebones(callbacks=[ProgressBar()])


def test_barebones_must_be_a_bool():
    with pytest.raises(ValueError, match="barebones must be True or False, got 'yes'"):
        ember.Trainer(accelerator="cpu", barebones="yes")


@pytest.mark.filterwarnings("ignore:self.log\\(\\) does nothing")
def test_barebones_says_so_when_made_and_when_each_run_starts(caplog):
    with caplog.at_level(logging.INFO, logger="ember"):
        trainer = barebones(limit_val_batches=1)
    made = [r.getMessage() for r in caplog.records if "barebones" in r.getMessage()]
    assert len(made) == 1
    for what in ("checkpointing", "progress bar", "model summary", "self.log", "sanity check", "fast_dev_run"):
        assert what in made[0], what
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ember"):
        trainer.fit(BoringModel(), regression_loader(), regression_loader())
        trainer.validate(BoringModel(), regression_loader(), verbose=False)
    running = [r.getMessage() for r in caplog.records if "barebones=True) is running" in r.getMessage()]
    assert len(running) == 2 and "no progress bar" in running[0]


@pytest.mark.filterwarnings("ignore:self.log\\(\\) does nothing")
def test_the_run_notice_is_said_on_global_rank_zero_only(caplog):
    trainer = ember.Trainer(strategy=OtherRank(), barebones=True, max_epochs=1)
    with caplog.at_level(logging.INFO, logger="ember"):
        trainer.fit(BoringModel(), regression_loader())
    assert not [r for r in caplog.records if "is running" in r.getMessage()]


class LogsEverywhere(BoringModel):
    def training_step(self, batch, batch_idx):
        self.log_dict({"a": 1.0, "b": 2.0}, prog_bar=True)
        return super().training_step(batch, batch_idx)  # (self.log("train_loss", ...))

    def on_train_epoch_end(self):
        self.log("epoch_value", 3.0)


def test_self_log_and_log_dict_do_nothing_and_warn_once():
    trainer = barebones(max_epochs=2, limit_val_batches=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LogsEverywhere(), regression_loader(), regression_loader())
        trainer.validate(LogsEverywhere(), regression_loader(), verbose=False)
    said = [w for w in caught if "barebones" in str(w.message)]
    assert len(said) == 1 and said[0].category is UserWarning
    assert "self.log() does nothing under Trainer(barebones=True)" in str(said[0].message)
    assert said[0].filename == __file__  # points at the module's self.log_dict line
    assert trainer.callback_metrics == {} and trainer.logged_metrics == {} and trainer.progress_bar_metrics == {}
    assert trainer.global_step == 8  # the training itself runs: 4 batches a epoch, 2 epochs


def test_the_self_log_warning_is_said_on_global_rank_zero_only():
    trainer = ember.Trainer(strategy=OtherRank(), barebones=True, max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LogsEverywhere(), regression_loader())
    assert not [w for w in caught if "barebones" in str(w.message)]
    assert trainer.callback_metrics == {}


def test_log_every_n_steps_zero_writes_no_step_metrics_but_the_epoch_ones():
    # Lightning 2.6.6, log_every_n_steps=0: the logger receives only the epoch-level values.
    class EpochAndStep(BoringModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("per_epoch", loss, on_step=False, on_epoch=True)
            return loss

    logger = RecordingLogger()
    trainer = ember.Trainer(
        accelerator="cpu",
        max_epochs=2,
        log_every_n_steps=0,
        logger=logger,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    assert trainer.log_every_n_steps == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(EpochAndStep(), regression_loader())
    assert not [w for w in caught if "log_every_n_steps" in str(w.message)]  # no "fewer batches than" warning
    assert logger.steps_with("train_loss") == []
    assert logger.steps_with("per_epoch") == [3, 7]
    assert "train_loss" in trainer.callback_metrics  # still logged: only the loggers' step writes are off


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_log_every_n_steps_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match=rf"log_every_n_steps must be a non-negative int .*got {bad!r}"):
        ember.Trainer(accelerator="cpu", log_every_n_steps=bad)
