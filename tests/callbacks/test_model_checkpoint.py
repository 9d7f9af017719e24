"""ModelCheckpoint: names, cadence, top-k rotation, last.ckpt, monitors, state; OnExceptionCheckpoint."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint


class Scored(ember.TrainModule):
    """Logs ``val/acc`` = ``scores[epoch]`` so tests choose which epochs are best."""

    def __init__(self, scores: list[float] | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.scores = scores or [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/acc", self.scores[self.current_epoch])

    def on_train_epoch_end(self) -> None:
        self.log("epoch_metric", float(self.current_epoch))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def data(n: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g)), batch_size=2)


def fit(
    tmp_path,
    cb: Callback | None = None,
    module: ember.TrainModule | None = None,
    val: bool = True,
    epochs: int = 3,
    ckpt_path: str | None = None,
    **kw: Any,
) -> ember.Trainer:
    trainer = ember.Trainer(
        max_epochs=epochs,
        enable_progress_bar=False,
        logger=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
        callbacks=[cb] if cb is not None else None,
        **kw,
    )
    trainer.fit(module or Scored(), data(), data(2) if val else None, ckpt_path=ckpt_path)
    return trainer


def files(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def test_default_checkpoint_is_added_and_writes_under_default_root_dir(tmp_path):
    trainer = fit(tmp_path, val=False, epochs=2)
    cbs = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    assert len(cbs) == 1 and cbs[0].dirpath == str(tmp_path / "checkpoints")
    assert files(tmp_path / "checkpoints") == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert os.path.samefile(tmp_path / "checkpoints" / "last.ckpt", cbs[0].best_model_path)  # a hard link, not a copy


def test_filename_template_with_metrics_and_slashes(tmp_path):
    cb = ModelCheckpoint(
        dirpath=tmp_path, filename="{epoch}-{val/acc:.3f}", monitor="val/acc", mode="max", save_last=False
    )
    fit(tmp_path, cb, epochs=2)
    assert files(tmp_path) == ["epoch=1-val_acc=0.200.ckpt"]
    assert cb.format_checkpoint_name({"epoch": 3, "val/acc": torch.tensor(0.81234)}) == os.path.join(
        str(tmp_path), "epoch=3-val_acc=0.812.ckpt"
    )
    plain = ModelCheckpoint(dirpath=tmp_path, filename="run-{epoch:02d}-{val/acc:.2f}", auto_insert_metric_name=False)
    assert os.path.basename(plain.format_checkpoint_name({"epoch": 3, "val/acc": 0.5})) == "run-03-0.50.ckpt"


def test_template_field_never_logged_is_a_clear_error(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{val/f1}")
    with pytest.raises(ValueError, match=r"uses \{val/f1\}, which was not logged.*'train/loss'.*'val/acc'"):
        fit(tmp_path, cb, epochs=1)


def test_monitored_key_never_logged_lists_logged_keys(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val/accuracy")
    with pytest.raises(
        ValueError,
        match=r"monitor='val/accuracy'\) could not find 'val/accuracy'.*Logged keys: "
        r"\[.*'train/loss'.*'val/acc'",
    ):
        fit(tmp_path, cb, epochs=1)
    assert files(tmp_path) == []


def test_top_k_keeps_the_best_and_tracks_best_and_kth(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", monitor="val/acc", mode="max", save_top_k=2)
    fit(tmp_path, cb, Scored([0.5, 0.9, 0.1, 0.7]), epochs=4)
    assert files(tmp_path) == ["epoch=1.ckpt", "epoch=3.ckpt", "last.ckpt"]
    assert cb.best_model_path == str(tmp_path / "epoch=1.ckpt") and float(cb.best_model_score) == pytest.approx(0.9)
    assert cb.kth_best_model_path == str(tmp_path / "epoch=3.ckpt") and cb.kth_value == pytest.approx(0.7)
    assert os.path.samefile(tmp_path / "last.ckpt", tmp_path / "epoch=1.ckpt") is False
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["progress"]["current_epoch"] == 3


def test_min_mode_monitors_a_metric_logged_in_the_modules_epoch_end_hook(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", monitor="epoch_metric", mode="min", save_last=False)
    fit(tmp_path, cb, val=False, epochs=3)
    assert files(tmp_path) == ["epoch=0.ckpt"] and float(cb.best_model_score) == 0.0


def test_rotation_never_deletes_the_checkpoint_resumed_from(tmp_path):
    scores = [0.1, 0.5, 0.7, 0.9]
    cb = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", monitor="val/acc", mode="max", save_top_k=1)
    fit(tmp_path, cb, Scored(scores), epochs=2)
    resumed_from = str(tmp_path / "epoch=1.ckpt")
    assert files(tmp_path) == ["epoch=1.ckpt", "last.ckpt"]
    cb2 = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", monitor="val/acc", mode="max", save_top_k=1)
    trainer = fit(tmp_path, cb2, Scored(scores), epochs=4, ckpt_path=resumed_from)
    assert trainer.ckpt_path == resumed_from
    # epoch=2 beat epoch=1 (kept: resumed from), then epoch=3 beat epoch=2 (deleted).
    assert files(tmp_path) == ["epoch=1.ckpt", "epoch=3.ckpt", "last.ckpt"]
    assert cb2.best_k_models == {str(tmp_path / "epoch=3.ckpt"): pytest.approx(0.9)}


def test_top_k_state_is_carried_over_by_resume(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", monitor="val/acc", mode="max", save_top_k=2)
    fit(tmp_path, cb, Scored([0.9, 0.1, 0.2, 0.95]), epochs=2)
    cb2 = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", monitor="val/acc", mode="max", save_top_k=2)
    fit(tmp_path, cb2, Scored([0.9, 0.1, 0.2, 0.95]), epochs=4, ckpt_path="last")
    assert files(tmp_path) == ["epoch=0.ckpt", "epoch=3.ckpt", "last.ckpt"]
    assert cb2.best_model_path == str(tmp_path / "epoch=3.ckpt")


def test_every_n_epochs_and_save_all(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=2, save_top_k=-1, save_last=False)
    fit(tmp_path, cb, val=False, epochs=5)
    assert files(tmp_path) == ["epoch=1-step=8.ckpt", "epoch=3-step=16.ckpt"]


def test_every_n_train_steps(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    fit(tmp_path, cb, epochs=2)
    assert files(tmp_path) == ["last.ckpt", "step=3.ckpt", "step=6.ckpt"]
    # last.ckpt is also refreshed at each epoch end, so it holds the final state (step 8); Lightning
    # 2.6.6 leaves it at step 6, the last top-k save (README: where ember deliberately differs).
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 8


def test_train_time_interval(tmp_path, monkeypatch):
    import ember.callbacks.model_checkpoint as mc

    clock = iter(range(0, 10_000, 10))  # every read of the clock is 10 s later
    monkeypatch.setattr(mc.time, "monotonic", lambda: next(clock))
    cb = ModelCheckpoint(dirpath=tmp_path, filename="{step}", train_time_interval=15, save_top_k=-1, save_last=False)
    fit(tmp_path, cb, val=False, epochs=1)
    # on_train_start reads 0; boundaries read 10 (no), 20 (save, reset to 30), 40 (save, reset to 50)...
    assert files(tmp_path) == ["step=2.ckpt", "step=4.ckpt"]


def test_save_weights_only(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, save_weights_only=True)
    fit(tmp_path, cb, epochs=1)
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert ckpt["weights_only"] and "optimizer_states" not in ckpt and "layer.weight" in ckpt["state_dict"]


def test_save_on_train_epoch_end_false_saves_after_validation_only(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, save_on_train_epoch_end=False, save_top_k=-1, save_last=False)
    fit(tmp_path, cb, epochs=2, val_check_interval=0.5)
    assert files(tmp_path) == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
        "epoch=1-step=6.ckpt",
        "epoch=1-step=8.ckpt",
    ]


def test_version_counter_does_not_overwrite_foreign_files(tmp_path):
    (tmp_path / "epoch=0-step=4.ckpt").write_bytes(b"someone else's")
    cb = ModelCheckpoint(dirpath=tmp_path, save_last=False)
    fit(tmp_path, cb, val=False, epochs=1)
    assert files(tmp_path) == ["epoch=0-step=4-v1.ckpt", "epoch=0-step=4.ckpt"]
    assert (tmp_path / "epoch=0-step=4.ckpt").read_bytes() == b"someone else's"


def test_validate_with_best(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", monitor="val/acc", mode="max")
    module = Scored([0.3, 0.9, 0.2, 0.0])
    trainer = fit(tmp_path, cb, module, epochs=3)
    trainer.validate(module, data(2), ckpt_path="best")
    assert trainer.ckpt_path == str(tmp_path / "epoch=1.ckpt")


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"mode": "maximum"}, "mode must be 'min' or 'max'"),
        ({"save_top_k": -2}, "save_top_k must be an int >= -1"),
        ({"save_top_k": 3}, "needs a metric to rank them by"),
        ({"every_n_epochs": 1, "every_n_train_steps": 5}, "mutually exclusive"),
        ({"train_time_interval": -1}, "positive timedelta"),
    ],
)
def test_invalid_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ModelCheckpoint(**kwargs)


def test_state_key_distinguishes_configurations():
    a, b = ModelCheckpoint(monitor="val/acc"), ModelCheckpoint(monitor="val/loss")
    assert a.state_key != b.state_key and a.state_key.startswith("ModelCheckpoint")


class Interrupt(Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 3:
            raise KeyboardInterrupt


def test_on_exception_checkpoint_on_ctrl_c(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        trainer = ember.Trainer(
            max_epochs=2,
            enable_progress_bar=False,
            logger=False,
            callbacks=[Interrupt(), OnExceptionCheckpoint(tmp_path)],
            enable_checkpointing=False,
        )
        trainer.fit(Scored(), data())
    ckpt = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    assert ckpt["progress"]["global_step"] == 3


def test_model_checkpoint_save_on_exception(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        ember.Trainer(
            max_epochs=2,
            enable_progress_bar=False,
            logger=False,
            callbacks=[Interrupt(), ModelCheckpoint(dirpath=tmp_path, save_on_exception=True)],
        ).fit(Scored(), data())
    assert "on_exception.ckpt" in files(tmp_path)


def test_the_saved_current_score_is_the_logged_tensor(tmp_path):
    """As Lightning: each checkpoint's current_score is the monitored value as logged (a float32 tensor, equal
    to the number logged), not a float64 rounding of it."""
    cb = ModelCheckpoint(dirpath=str(tmp_path / "c"), monitor="val/acc", mode="max", save_top_k=-1, save_last=False)
    fit(tmp_path, cb)
    scores = sorted(
        torch.load(os.path.join(cb.dirpath, name), weights_only=True)["callbacks"][cb.state_key]["current_score"]
        for name in files(cb.dirpath)
    )
    assert all(isinstance(s, torch.Tensor) and s.dtype == torch.float32 for s in scores)
    assert scores == [0.1, 0.2, 0.3]
