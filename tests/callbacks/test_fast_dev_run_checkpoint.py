"""ModelCheckpoint under fast_dev_run: as Lightning 2.6, it stays in ``trainer.callbacks`` (the default one too),
its ``dirpath`` is resolved, and it saves nothing and creates no directory; loggers become one DummyLogger."""

from __future__ import annotations

import os

import pytest
import torch

import ember
from ember.callbacks import ModelCheckpoint
from tests.helpers.models import BoringModel, RecordingLogger, TrainOnlyModel, regression_loader


def files_under(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def dev_trainer(root: str, **kwargs) -> ember.Trainer:
    kwargs.setdefault("accelerator", "cpu")
    kwargs.setdefault("enable_progress_bar", False)
    return ember.Trainer(default_root_dir=root, fast_dev_run=kwargs.pop("fast_dev_run", 2), **kwargs)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"save_last": True},  # (Lightning 2.6.6 writes last.ckpt at train end here, against its own docs)
        {"every_n_train_steps": 1, "save_top_k": -1},
        {"monitor": "val_loss", "save_top_k": 2},
        {"async_save": True},
    ],
)
def test_a_given_model_checkpoint_stays_resolves_its_dirpath_and_saves_nothing(tmp_path, options):
    checkpoint = ModelCheckpoint(**options)
    trainer = dev_trainer(str(tmp_path), callbacks=[checkpoint], logger=RecordingLogger())
    assert checkpoint in trainer.callbacks and trainer.checkpoint_callback is checkpoint
    trainer.fit(BoringModel(), regression_loader(), regression_loader())
    assert trainer.global_step == 2
    assert checkpoint.dirpath == os.path.join(str(tmp_path), "checkpoints")  # (the DummyLogger has no run folder)
    assert not os.path.exists(checkpoint.dirpath)
    assert files_under(str(tmp_path)) == []
    assert checkpoint.best_model_path == "" and checkpoint.last_model_path == "" and checkpoint.best_k_models == {}


def test_the_default_model_checkpoint_is_there_too_and_saves_nothing(tmp_path):
    trainer = dev_trainer(str(tmp_path))
    assert isinstance(trainer.checkpoint_callback, ModelCheckpoint)  # as Lightning
    trainer.fit(BoringModel(), regression_loader(), regression_loader())
    assert files_under(str(tmp_path)) == []


def test_a_given_dirpath_is_not_created(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "mine" / "ckpts"), save_last=True)
    dev_trainer(str(tmp_path), callbacks=[checkpoint]).fit(TrainOnlyModel(), regression_loader())
    assert checkpoint.dirpath == str(tmp_path / "mine" / "ckpts")
    assert not os.path.exists(tmp_path / "mine")


def test_save_on_exception_saves_nothing_under_fast_dev_run(tmp_path):
    class Fails(TrainOnlyModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    checkpoint = ModelCheckpoint(save_on_exception=True)
    with pytest.raises(RuntimeError, match="boom"):
        dev_trainer(str(tmp_path), callbacks=[checkpoint]).fit(Fails(), regression_loader())
    assert files_under(str(tmp_path)) == []


def test_the_same_callback_saves_in_a_later_run_without_fast_dev_run(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"))
    dev_trainer(str(tmp_path), callbacks=[checkpoint]).fit(TrainOnlyModel(), regression_loader())
    assert not os.path.exists(tmp_path / "ckpts")
    trainer = ember.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[checkpoint], logger=False, enable_progress_bar=False
    )
    trainer.fit(TrainOnlyModel(), regression_loader())
    assert os.path.basename(checkpoint.best_model_path) == "epoch=0-step=4.ckpt"
    assert os.path.isfile(checkpoint.best_model_path)


def test_enable_checkpointing_false_with_a_model_checkpoint_is_refused_under_fast_dev_run_too(tmp_path):
    # Lightning 2.6.6 raises here as without fast_dev_run.
    with pytest.raises(ValueError, match="enable_checkpointing=False but a ModelCheckpoint is in callbacks"):
        dev_trainer(str(tmp_path), enable_checkpointing=False, callbacks=[ModelCheckpoint()])
    assert dev_trainer(str(tmp_path), enable_checkpointing=False).checkpoint_callback is None


@pytest.mark.parametrize(
    ("logger", "expected"),
    [(True, ["DummyLogger"]), ("one", ["DummyLogger"]), ("two", ["DummyLogger"]), (False, []), (None, []), ([], [])],
)
def test_loggers_become_one_dummy_logger_as_lightning(tmp_path, logger, expected):
    # Lightning 2.6.6: [DummyLogger()] when any logger is asked for, [] otherwise (an empty list included).
    if logger == "one":
        logger = RecordingLogger()
    elif logger == "two":
        logger = [RecordingLogger(), RecordingLogger()]
    trainer = dev_trainer(str(tmp_path), logger=logger)
    assert [type(lg).__name__ for lg in trainer.loggers] == expected
    trainer.fit(TrainOnlyModel(), regression_loader())
    assert files_under(str(tmp_path)) == []


def test_nothing_is_written_when_the_module_saves_weights_through_the_trainer_elsewhere(tmp_path):
    # The Trainer's own save_checkpoint still writes (as Lightning): only the callback's save points are off.
    class SavesItself(TrainOnlyModel):
        def on_train_end(self):
            self.trainer.save_checkpoint(str(tmp_path / "mine.ckpt"))

    dev_trainer(str(tmp_path)).fit(SavesItself(), regression_loader())
    assert files_under(str(tmp_path)) == ["mine.ckpt"]
    assert "state_dict" in torch.load(tmp_path / "mine.ckpt", weights_only=True)
