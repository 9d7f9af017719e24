"""The Trainer's API as Lightning's: predict(return_predictions=), trainer.model, assignable loggers, the
checkpoint / early-stopping callback properties, configure_optimizers returning None, float limits,
and unknown keywords. Each expectation was checked against Lightning 2.6.6 first (values noted)."""

from __future__ import annotations

import warnings

import pytest
import torch

import ember
from ember.callbacks import EarlyStopping, ModelCheckpoint
from tests.helpers.models import BoringModel, RecordingLogger, TrainOnlyModel, fast_trainer, regression_loader


# ---------------------------------------------------------------------- predict(return_predictions=)
def test_predict_return_predictions_false_returns_none_and_keeps_nothing():
    """Lightning 2.6.6: predict(..., return_predictions=False) -> None; True -> 4 outputs for 32 samples / 8."""
    seen = []

    class Module(BoringModel):
        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            seen.append(batch_idx)
            return self(batch[0])

    trainer = fast_trainer()
    module = Module()
    assert trainer.predict(module, regression_loader(), return_predictions=False) is None
    assert seen == [0, 1, 2, 3]  # the steps still ran
    out = trainer.predict(module, regression_loader(), return_predictions=True)
    assert len(out) == 4
    assert len(trainer.predict(module, regression_loader())) == 4  # None (the default) keeps them


def test_predict_return_predictions_must_be_a_bool():
    with pytest.raises(TypeError, match=r"return_predictions must be True, False or None, got 'no'"):
        fast_trainer().predict(BoringModel(), regression_loader(), return_predictions="no")


# ---------------------------------------------------------------------- trainer.model
def test_trainer_model_is_none_before_and_the_module_after_fit():
    """Lightning 2.6.6 (single device): trainer.model is None before fit, the LightningModule after."""
    trainer = fast_trainer()
    assert trainer.model is None
    module = TrainOnlyModel()
    trainer.fit(module, regression_loader())
    assert trainer.model is module


# ---------------------------------------------------------------------- trainer.logger / trainer.loggers
def test_logger_and_loggers_are_assignable():
    """Lightning 2.6.6: logger=lg -> loggers == [lg]; logger=None -> logger None, loggers [];
    loggers=[a, b] -> logger is a; loggers=None -> []."""
    trainer = fast_trainer()
    assert trainer.logger is None and trainer.loggers == []
    a, b = RecordingLogger(), RecordingLogger()
    trainer.logger = a
    assert trainer.logger is a and trainer.loggers == [a]
    trainer.logger = None
    assert trainer.logger is None and trainer.loggers == []
    assert a not in trainer.callbacks  # ember's loggers are callbacks: an unassigned one gets no hook
    trainer.loggers = [a, b]
    assert trainer.logger is a and trainer.loggers == [a, b]
    trainer.loggers = None
    assert trainer.loggers == []


def test_an_assigned_logger_receives_the_fit_metrics():
    trainer = fast_trainer(log_every_n_steps=1)
    lg = RecordingLogger()
    trainer.logger = lg
    trainer.fit(TrainOnlyModel(), regression_loader())
    assert lg.steps_with("train_loss") == [0, 1, 2, 3]
    assert lg.status == "success"


def test_assigning_something_else_as_logger_is_an_error():
    # Lightning 2.6.6 accepts anything here (trainer.logger = "x" -> loggers ['x']) and fails later; ember says so now.
    trainer = fast_trainer()
    with pytest.raises(TypeError, match=r"take None, an ember Logger or a list of them, got 'x'"):
        trainer.logger = "x"
    with pytest.raises(TypeError, match=r"got \[1\]"):
        trainer.loggers = [1]


# ---------------------------------------------------------------------- callbacks by kind
def test_checkpoint_and_early_stopping_callback_properties(tmp_path):
    """Lightning 2.6.6: without any -> None and []; with [c1, e1, c2] -> checkpoint_callback is c1,
    checkpoint_callbacks has both, early_stopping_callback is e1; enable_checkpointing adds a default one."""
    trainer = fast_trainer()
    assert trainer.checkpoint_callback is None and trainer.checkpoint_callbacks == []
    assert trainer.early_stopping_callback is None and trainer.early_stopping_callbacks == []
    c1, c2 = ModelCheckpoint(dirpath=tmp_path), ModelCheckpoint(dirpath=tmp_path, monitor="val_loss")
    e1 = EarlyStopping("val_loss")
    trainer = fast_trainer(callbacks=[c1, e1, c2], enable_checkpointing=True)
    assert trainer.checkpoint_callback is c1 and trainer.checkpoint_callbacks == [c1, c2]
    assert trainer.early_stopping_callback is e1 and trainer.early_stopping_callbacks == [e1]
    trainer = fast_trainer(enable_checkpointing=True, default_root_dir=tmp_path)
    assert isinstance(trainer.checkpoint_callback, ModelCheckpoint)


# ---------------------------------------------------------------------- configure_optimizers -> None
def test_configure_optimizers_returning_none_trains_without_an_optimizer():
    """Lightning 2.6.6, 2 epochs x 2 batches: warns "`configure_optimizers` returned `None`, this fit will run
    with no optimizer"; training_step and backward run (grads exist), global_step 4, weights unchanged,
    trainer.optimizers is one stand-in whose repr is "No Optimizer", no scheduler."""
    grads = []

    class NoOpt(TrainOnlyModel):
        def configure_optimizers(self):
            return None

        def on_train_batch_end(self, outputs, batch, batch_idx):
            grads.append((self.trainer.global_step, self.layer.weight.grad is not None))

    module = NoOpt()
    before = module.layer.weight.detach().clone()
    trainer = fast_trainer(max_epochs=2, limit_train_batches=2)
    with pytest.warns(
        UserWarning,
        match=r"NoOpt.configure_optimizers returned None, this fit will run with no "
        r"optimizer",
    ):
        trainer.fit(module, regression_loader())
    assert grads == [(1, True), (2, True), (3, True), (4, True)]
    assert trainer.global_step == 4
    torch.testing.assert_close(module.layer.weight, before, rtol=0, atol=0)
    assert [repr(o) for o in trainer.optimizers] == ["No Optimizer"] and trainer.lr_scheduler_configs == []


def test_configure_optimizers_returning_none_in_manual_optimization():
    """Lightning 2.6.6: self.optimizers() is the stand-in; opt.step() counts: global_step 1 after 1 batch."""

    class Manual(TrainOnlyModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def configure_optimizers(self):
            return None

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            self.manual_backward(super().training_step(batch, batch_idx))
            opt.step()

    trainer = fast_trainer(limit_train_batches=1)
    with pytest.warns(UserWarning, match="this fit will run with no optimizer"):
        trainer.fit(Manual(), regression_loader())
    assert trainer.global_step == 1


# ---------------------------------------------------------------------- float limits
@pytest.mark.parametrize(("value", "expected", "steps"), [(2.0, 2, 2), (3, 3, 3), (1.0, 1.0, 4)])
def test_whole_float_limits_above_one_count_batches(value, expected, steps):
    """Lightning 2.6.6: limit_train_batches=2.0 -> 2 (an int), 2 steps; 3 -> 3; 1.0 stays the fraction 1.0."""
    trainer = fast_trainer(limit_train_batches=value)
    assert trainer.limit_train_batches == expected and type(trainer.limit_train_batches) is type(expected)
    trainer.fit(TrainOnlyModel(), regression_loader())
    assert trainer.global_step == steps


def test_a_fractional_float_limit_above_one_is_an_error():
    """Lightning 2.6.6 raises for 1.5: "it has to be in [0.0, 1.0] or an int"."""
    with pytest.raises(
        ValueError,
        match=r"limit_val_batches=1.5 is neither a fraction in \[0, 1\] nor a whole "
        r"number of batches",
    ):
        fast_trainer(limit_val_batches=1.5)


# ---------------------------------------------------------------------- unknown keywords
def test_an_unknown_keyword_suggests_the_argument_meant():
    # Lightning 2.6.6 raises Python's TypeError "got an unexpected keyword argument 'max_epoch'"; ember adds the hint.
    with pytest.raises(
        TypeError,
        match=r"Trainer\(\) got an unexpected keyword argument 'max_epoch'. Did you mean "
        r"'max_epochs'\?",
    ):
        ember.Trainer(max_epoch=3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'. See help\(ember.Trainer\)"):
        ember.Trainer(zzz=1)


def test_a_lightning_argument_ember_does_not_take_says_why():
    with pytest.raises(TypeError, match=r"Lightning argument 'plugins', which ember does not take: .*precision="):
        ember.Trainer(plugins=[])


def test_a_removed_lightning_1_argument_names_its_replacement():
    with pytest.raises(
        TypeError,
        match=r"'resume_from_checkpoint', a Lightning 1.x argument removed in Lightning "
        r"2.0: pass ckpt_path= to trainer.fit",
    ):
        ember.Trainer(resume_from_checkpoint="last.ckpt")


def test_no_warning_for_an_ordinary_trainer():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast_trainer(limit_train_batches=2.0)


def test_none_means_the_default_where_lightnings_signature_says_so(tmp_path):
    """Lightning 2.6.6: Trainer(num_sanity_val_steps=None, log_every_n_steps=None, enable_checkpointing=None,
    enable_progress_bar=None, val_check_interval=None, gradient_clip_algorithm=None) -> sanity 2, every 50,
    val_check_interval 1.0, a progress bar and a ModelCheckpoint; clipping by norm. (Lightning also takes
    precision=None as "32-true"; ember's tests/trainer/test_precision.py still expects an error there.)"""
    from ember.callbacks import ProgressBar

    trainer = ember.Trainer(
        num_sanity_val_steps=None,
        log_every_n_steps=None,
        enable_checkpointing=None,
        enable_progress_bar=None,
        val_check_interval=None,
        gradient_clip_algorithm=None,
        logger=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    assert (trainer.num_sanity_val_steps, trainer.log_every_n_steps, trainer.val_check_interval) == (2, 50, 1.0)
    assert trainer.gradient_clip_algorithm == "norm"
    assert isinstance(trainer.checkpoint_callback, ModelCheckpoint)
    assert any(isinstance(c, ProgressBar) for c in trainer.callbacks)
