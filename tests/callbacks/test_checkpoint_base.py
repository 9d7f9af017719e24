"""Checkpoint: the base class of the checkpointing callbacks, for ``isinstance(cb, Checkpoint)`` as in Lightning."""

from __future__ import annotations

import torch

import ember
from ember.callbacks import Callback, Checkpoint, EarlyStopping, ModelCheckpoint, OnExceptionCheckpoint


def test_the_checkpointing_callbacks_are_checkpoints_and_the_others_are_not(tmp_path) -> None:
    assert isinstance(ModelCheckpoint(dirpath=tmp_path), Checkpoint)
    assert isinstance(OnExceptionCheckpoint(dirpath=tmp_path), Checkpoint)
    assert not isinstance(EarlyStopping(monitor="loss"), Checkpoint)
    assert issubclass(Checkpoint, Callback)
    assert "Checkpoint" in ember.callbacks.__all__


def test_a_checkpoint_of_ones_own_is_a_callback_the_trainer_runs(tmp_path) -> None:
    class Marks(Checkpoint):
        def __init__(self) -> None:
            self.ends = 0

        def on_train_end(self, trainer, module) -> None:
            self.ends += 1

    class Net(ember.TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            return (self.w - batch[0]).pow(2).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    marks = Marks()
    trainer = ember.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
        callbacks=[marks],
    )  # fmt: skip
    trainer.fit(Net(), [torch.ones(1)])
    assert marks.ends == 1
    assert [type(c) for c in trainer.callbacks if isinstance(c, Checkpoint)][0] is Marks


def test_checkpoints_of_ones_own_run_after_the_other_callbacks(tmp_path) -> None:
    class Mine(Checkpoint):
        pass

    class Other(Callback):
        pass

    mine, other = Mine(), Other()
    trainer = ember.Trainer(callbacks=[mine, other], logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    order = [c for c in trainer.callbacks if c in (mine, other)]
    assert order == [other, mine]  # as Lightning: a checkpoint saves what the others did at that hook
