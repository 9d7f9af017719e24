"""The checkpoint writers the strategy holds: synchronous and background, chosen per save by the
arguments that travel with it (``storage_options=BackgroundSave(...)``), and the old import path."""

from __future__ import annotations

import importlib
import os
import sys
import zipfile
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
import ember.checkpoint
from ember.callbacks import Callback, ModelCheckpoint
from ember.callbacks.callback import overrides
from ember.checkpoint import BackgroundSave, CheckpointWriter
from ember.checkpoint.background import BackgroundWriter
from ember.strategies.single import SingleDeviceStrategy
from tests.helpers.models import OtherRank


class Net(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)), batch_size=2)


def fitted(tmp_path, **kw: Any) -> ember.Trainer:
    trainer = ember.Trainer(
        max_steps=3,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        **kw,
    )
    trainer.fit(Net(), loader())
    return trainer


def records(path: str | os.PathLike) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist() if not n.endswith("/.data/serialization_id")}


def test_the_synchronous_writer_writes_then_runs_after_then_on_done(tmp_path):
    order: list[str] = []

    def after(write: Any) -> None:
        order.append("after: " + ",".join(sorted(os.listdir(tmp_path))))
        write(str(tmp_path / "copy.ckpt"))

    CheckpointWriter().write(
        {"x": torch.arange(3)}, str(tmp_path / "a.ckpt"), after=after, on_done=lambda: order.append("done")
    )
    assert order == ["after: a.ckpt", "done"]
    assert records(tmp_path / "a.ckpt") == records(tmp_path / "copy.ckpt")
    assert torch.equal(torch.load(tmp_path / "a.ckpt", weights_only=True)["x"], torch.arange(3))


def test_a_background_save_goes_to_the_strategys_background_writer(tmp_path):
    trainer = fitted(tmp_path)
    done: list[str] = []
    background = BackgroundSave(on_done=lambda: done.append("done"))
    trainer.save_checkpoint(tmp_path / "bg.ckpt", storage_options=background)
    writer = trainer.strategy.background_writer
    assert isinstance(writer, BackgroundWriter) and background.submitted
    writer.wait()  # the training thread collects it: on_done runs there
    assert done == ["done"] and not writer.pending
    trainer.save_checkpoint(tmp_path / "sync.ckpt")
    # The same state, written by either writer, is the same file.
    assert records(tmp_path / "bg.ckpt") == records(tmp_path / "sync.ckpt")


def test_only_rank_zero_hands_a_save_to_a_writer(tmp_path):
    trainer = fitted(tmp_path, strategy=OtherRank("cpu"))
    background = BackgroundSave()
    trainer.save_checkpoint(tmp_path / "x.ckpt", storage_options=background)
    assert not background.submitted and not os.path.exists(tmp_path / "x.ckpt")


def test_storage_options_other_than_a_background_save_are_refused(tmp_path):
    trainer = fitted(tmp_path)
    with pytest.raises(TypeError, match=r"storage_options=\.\.\.\) takes None or an ember.checkpoint.BackgroundSave"):
        trainer.save_checkpoint(tmp_path / "x.ckpt", storage_options={"bucket": "s3://x"})  # type: ignore[arg-type]
    assert not os.path.exists(tmp_path / "x.ckpt")


def test_a_save_checkpoint_override_that_drops_storage_options_is_an_error(tmp_path):
    class Custom(ember.Trainer):
        def save_checkpoint(self, filepath: Any, weights_only: bool = False, storage_options: Any = None) -> None:
            super().save_checkpoint(filepath, weights_only)  # written, but not in the background

    cb = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, async_save=True)
    trainer = Custom(max_steps=2, enable_progress_bar=False, logger=False, callbacks=[cb])
    with pytest.raises(RuntimeError, match="does not pass storage_options on to it"):
        trainer.fit(Net(), loader())


def test_a_strategy_may_hold_a_writer_of_its_own(tmp_path):
    written: list[str] = []

    class Recording(CheckpointWriter):
        def write(self, obj: Any, path: str, *args: Any, **kwargs: Any) -> None:
            written.append(os.path.basename(path))
            super().write(obj, path, *args, **kwargs)

    strategy = SingleDeviceStrategy("cpu")
    strategy.checkpoint_writer = Recording()
    trainer = fitted(tmp_path, strategy=strategy)
    trainer.save_checkpoint(tmp_path / "mine.ckpt")
    assert written == ["mine.ckpt"] and ember.checkpoint.load(str(tmp_path / "mine.ckpt"))["global_step"] == 3
    # Other strategies keep the default, synchronous writer.
    assert type(SingleDeviceStrategy("cpu").checkpoint_writer) is CheckpointWriter


def test_callback_hooks_count_as_overridden_by_class_or_by_instance():
    class Saves(Callback):
        def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: Any) -> None:
            pass

    plain, given = Callback(), Callback()
    given.on_save_checkpoint = lambda trainer, module, checkpoint: None  # type: ignore[method-assign]
    assert overrides(Saves(), "on_save_checkpoint") and overrides(given, "on_save_checkpoint")
    assert not overrides(plain, "on_save_checkpoint") and not overrides(plain, "on_load_checkpoint")


def test_the_old_import_path_is_deprecated_and_names_the_same_objects(monkeypatch):
    monkeypatch.delitem(sys.modules, "ember.checkpoint_io", raising=False)  # imported afresh: it warns once
    with pytest.warns(DeprecationWarning, match="ember.checkpoint_io is deprecated.*from ember.checkpoint"):
        old = importlib.import_module("ember.checkpoint_io")
    for name in old.__all__:
        assert getattr(old, name) is getattr(ember.checkpoint, name), name
    assert ember.load_lightning_checkpoint is ember.checkpoint.load_lightning_checkpoint
