"""trainer.fit_state: the registry of what a fit carries, each part with state_dict / load_state_dict,
and what checkpoints save and restore through those methods."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback
from ember.trainer.state import FitState

PARTS_KEYS = {"optimizer_states", "lr_schedulers", "precision", "progress", "sampler", "loader"}


class Net(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1)}


def data(shuffle: bool = True) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(12, 3, generator=g), torch.randn(12, 1, generator=g)), batch_size=2, shuffle=shuffle
    )


class Stop(Callback):
    """Saves the fit's state at the step boundary after ``step`` batches, then stops the fit."""

    def __init__(self, step: int) -> None:
        self.step, self.saved = step, None

    def on_train_step_boundary(self, trainer: Any, module: Any) -> None:
        if trainer.global_step == self.step and self.saved is None:
            self.saved = copy.deepcopy(trainer.fit_state.state_dict())
            raise KeyboardInterrupt


def trainer_for(tmp_path, **kw: Any) -> ember.Trainer:
    return ember.Trainer(
        max_epochs=2,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        **kw,
    )


def test_the_state_is_built_once_and_its_progress_starts_again_with_each_fit(tmp_path):
    trainer = trainer_for(tmp_path)
    state = trainer.fit_state
    assert isinstance(state, FitState)
    trainer.fit(Net(), data())
    first_progress = state.progress
    assert trainer.fit_state is state and trainer.progress is first_progress and first_progress.global_step == 12
    trainer.fit(Net(), data())
    assert trainer.fit_state is state and state.progress is not first_progress and state.progress.global_step == 12
    assert trainer.optimizers == state.optim.optimizers and trainer.lr_scheduler_configs == state.optim.schedulers


def test_a_mid_epoch_state_names_the_sampler_position_and_the_epochs_running_sums(tmp_path):
    stop = Stop(step=3)
    trainer = trainer_for(tmp_path, callbacks=[stop])
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(Net(), data())
    saved = stop.saved
    assert saved is not None and PARTS_KEYS <= saved.keys()
    assert saved["progress"]["global_step"] == 3 and saved["progress"]["batch_in_epoch"] == 3
    assert saved["sampler"]["position"] == 6 and saved["sampler"]["epoch"] == 0 and saved["loader"] is None
    ((sums,),) = [[e for e in saved["epoch_metrics"] if e["name"] == "loss"]]
    assert sums["on_epoch"] and float(sums["weight"]) == 6.0  # three batches of two samples
    assert len(saved["optimizer_states"]) == 1 and saved["optimizer_states"][0]["state"]  # Adam has stepped


def test_the_checkpoint_holds_the_states_parts_under_their_keys(tmp_path):
    stop = Stop(step=3)

    class SaveToo(Callback):
        def on_train_step_boundary(self, trainer: Any, module: Any) -> None:
            if trainer.global_step == 3:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    trainer = trainer_for(tmp_path, callbacks=[SaveToo(), stop])
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(Net(), data())
    ckpt = ember.checkpoint.load(str(tmp_path / "mid.ckpt"))
    for key in ("progress", "sampler", "loader", "lr_schedulers"):
        assert ckpt[key] == stop.saved[key], key
    assert ckpt["optimizer_states"][0]["param_groups"] == stop.saved["optimizer_states"][0]["param_groups"]


def test_loading_the_training_parts_into_another_fit_gives_the_same_state_and_the_snapshot_puts_it_back(tmp_path):
    stop = Stop(step=3)
    with pytest.raises(KeyboardInterrupt):
        trainer_for(tmp_path, callbacks=[stop]).fit(Net(), data())
    other = trainer_for(tmp_path)
    other.fit(Net(), data())  # a finished fit of its own: optimizers and schedulers of the same shape
    state = other.fit_state
    training = [name for name, _ in state.parts("training")]
    assert training == ["optimizers", "precision", "progress", "metrics"]
    before = state.snapshot(training)
    saved = stop.saved
    state.optim.load_state_dict(saved)
    state.progress.load_state_dict(saved["progress"])
    state["metrics"].load_state_dict(saved)
    assert state.optim.state_dict()["lr_schedulers"] == saved["lr_schedulers"]
    assert state.progress.state_dict() == saved["progress"]
    assert [e["name"] for e in state["metrics"].state_dict()["epoch_metrics"]] == ["loss"]
    state.rollback(before)  # what a failed resume does
    after = state.snapshot(training)
    assert (
        after["progress"] == before["progress"]
        and after["optimizers"]["lr_schedulers"] == before["optimizers"]["lr_schedulers"]
    )
    assert after["metrics"]["epoch_metrics"] == [] and state.progress.global_step == 12


def test_a_loader_ember_cannot_resume_has_no_position(tmp_path):
    class Odd(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(range(12))

        def __len__(self) -> int:
            return 12

    g = torch.Generator().manual_seed(0)
    odd = DataLoader(
        TensorDataset(torch.randn(12, 3, generator=g), torch.randn(12, 1, generator=g)), batch_size=2, sampler=Odd()
    )
    stop = Stop(step=2)
    with pytest.raises(KeyboardInterrupt):
        trainer_for(tmp_path, callbacks=[stop]).fit(Net(), odd)
    assert stop.saved["sampler"] is None and stop.saved["loader"] is None
    assert stop.saved["progress"]["batch_in_epoch"] == 2  # the resume skips that many batches, with a warning
