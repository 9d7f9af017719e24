"""``trainer.state`` as Lightning's ``TrainerState``: ``status``, ``fn`` and ``stage`` at every hook of fit /
validate / test / predict and after an error (the table was recorded from PyTorch Lightning 2.6.6 running
the same hooks), the enums' string behaviour, and ember's earlier string state still comparing."""

from __future__ import annotations

import pickle

import pytest

import ember
from ember.trainer.states import RunningStage, TrainerFn, TrainerState, TrainerStatus
from tests.helpers.models import BoringModel, regression_loader

# Lightning 2.6.6, hook by hook: (hook, status, fn, stage, interrupted).
EXPECTED = [
    ("setup validate", "running", "validate", "validate", False),
    ("on_validation_start", "running", "validate", "validate", False),
    ("on_validation_batch_start", "running", "validate", "validate", False),
    ("on_validation_end", "running", "validate", "validate", False),
    ("teardown validate", "running", "validate", "validate", False),
    ("init", "initializing", None, None, False),
    ("setup fit", "running", "fit", "train", False),
    ("on_fit_start", "running", "fit", "train", False),
    ("on_sanity_check_start", "running", "fit", "sanity_check", False),
    ("on_validation_start", "running", "fit", "sanity_check", False),
    ("on_validation_batch_start", "running", "fit", "sanity_check", False),
    ("on_validation_end", "running", "fit", "sanity_check", False),
    ("on_sanity_check_end", "running", "fit", "sanity_check", False),
    ("on_train_start", "running", "fit", "train", False),
    ("on_train_batch_start", "running", "fit", "train", False),
    ("on_validation_start", "running", "fit", "validate", False),
    ("on_validation_batch_start", "running", "fit", "validate", False),
    ("on_validation_end", "running", "fit", "validate", False),
    ("on_train_epoch_end", "running", "fit", "train", False),
    ("on_train_end", "running", "fit", "train", False),
    ("on_fit_end", "running", "fit", "train", False),
    ("teardown fit", "running", "fit", "train", False),
    ("after fit", "finished", "fit", None, False),
    ("setup test", "running", "test", "test", False),
    ("on_test_start", "running", "test", "test", False),
    ("on_test_batch_start", "running", "test", "test", False),
    ("teardown test", "running", "test", "test", False),
    ("setup predict", "running", "predict", "predict", False),
    ("on_predict_batch_start", "running", "predict", "predict", False),
    ("teardown predict", "running", "predict", "predict", False),
    ("after predict", "finished", "predict", None, False),
    ("setup fit", "running", "fit", "train", False),
    ("on_fit_start", "running", "fit", "train", False),
    ("on_sanity_check_start", "running", "fit", "sanity_check", False),
    ("on_validation_start", "running", "fit", "sanity_check", False),
    ("on_validation_batch_start", "running", "fit", "sanity_check", False),
    ("on_validation_end", "running", "fit", "sanity_check", False),
    ("on_sanity_check_end", "running", "fit", "sanity_check", False),
    ("on_train_start", "running", "fit", "train", False),
    ("on_train_batch_start", "running", "fit", "train", False),
    ("on_exception", "interrupted", "fit", "train", True),
    # ember runs the teardown hooks after an error too (Lightning skips them; docs/from-lightning.md)
    ("teardown fit", "interrupted", "fit", "train", True),
    ("after error", "interrupted", "fit", None, True),
]


def note(seen: list, trainer: ember.Trainer, name: str) -> None:
    s = trainer.state
    seen.append((name, s.status.value, s.fn and s.fn.value, s.stage and s.stage.value, trainer.interrupted))


class Record(ember.Callback):
    def __init__(self) -> None:
        self.seen: list = []

    def setup(self, trainer, module, stage):
        note(self.seen, trainer, f"setup {stage}")

    def teardown(self, trainer, module, stage):
        note(self.seen, trainer, f"teardown {stage}")

    def on_exception(self, trainer, module, exception):
        note(self.seen, trainer, "on_exception")


for _hook in (
    "on_fit_start", "on_sanity_check_start", "on_sanity_check_end", "on_validation_start", "on_validation_end",
    "on_train_start", "on_train_epoch_end", "on_train_end", "on_fit_end", "on_test_start",
):  # fmt: skip
    setattr(Record, _hook, lambda self, trainer, module, _n=_hook: note(self.seen, trainer, _n))
for _hook in ("on_train_batch_start", "on_validation_batch_start", "on_test_batch_start", "on_predict_batch_start"):

    def _first(self, trainer, module, batch, batch_idx, *rest, _n=_hook):
        if batch_idx == 0:
            note(self.seen, trainer, _n)

    setattr(Record, _hook, _first)


class Fails(BoringModel):
    def training_step(self, batch, batch_idx):
        raise ValueError("boom")


def trainer(**kwargs) -> ember.Trainer:
    args = dict(max_epochs=1, limit_train_batches=2, limit_val_batches=2, limit_test_batches=1,
                limit_predict_batches=1, num_sanity_val_steps=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False)  # fmt: skip
    args.update(kwargs)
    return ember.Trainer(**args)


def test_state_at_every_hook_and_after_an_error_is_lightnings():
    record = Record()
    module = BoringModel()
    trainer(callbacks=[record], limit_val_batches=1).validate(module, regression_loader())
    t = trainer(callbacks=[record])
    note(record.seen, t, "init")
    t.fit(module, regression_loader(), regression_loader())
    note(record.seen, t, "after fit")
    t.test(module, regression_loader())
    t.predict(module, regression_loader())
    note(record.seen, t, "after predict")
    t = trainer(callbacks=[record])
    with pytest.raises(ValueError, match="boom"):
        t.fit(Fails(), regression_loader(), regression_loader())
    note(record.seen, t, "after error")
    assert record.seen == EXPECTED
    assert t.state.stopped and not t.state.finished


def test_enums_compare_as_lightnings_strings():
    assert TrainerFn.FITTING == "fit" and TrainerFn.FITTING == "FIT" and TrainerFn("validate") is TrainerFn.VALIDATING
    assert RunningStage.SANITY_CHECKING.evaluating and not RunningStage.TRAINING.evaluating
    assert RunningStage.SANITY_CHECKING.dataloader_prefix == "val" and RunningStage.TESTING.dataloader_prefix == "test"
    assert TrainerStatus.INTERRUPTED.stopped and TrainerStatus.FINISHED.stopped and not TrainerStatus.RUNNING.stopped
    assert TrainerFn.from_str("testing", source="key") is TrainerFn.TESTING
    assert {TrainerFn.FITTING: 1}["fit"] == 1  # hashed as its value


def test_state_compares_by_value_and_as_embers_earlier_string():
    t = trainer()
    assert t.state == "initializing" and t.state == TrainerState()
    assert repr(t.state) == "TrainerState(status=<TrainerStatus.INITIALIZING: 'initializing'>, fn=None, stage=None)"
    seen = []

    class During(ember.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.append((trainer.state == "fitting", trainer.state == "validating"))

    t = trainer(callbacks=[During()], num_sanity_val_steps=0, limit_train_batches=1)
    t.fit(BoringModel(), regression_loader())
    assert seen == [(True, False)]
    assert t.state == "finished" and t.state.finished and t.state != "fitting"
    # ember's earlier string state was used as a dict key: the object hashes as the string it equals.
    assert {"finished": 1, "fitting": 2}[t.state] == 1 and hash(t.state) == hash("finished")
    assert pickle.loads(pickle.dumps(TrainerFn.TESTING)) is TrainerFn.TESTING


def test_stage_cannot_be_assigned():
    with pytest.raises(AttributeError):
        trainer().state.stage = RunningStage.TRAINING  # the Trainer decides it
