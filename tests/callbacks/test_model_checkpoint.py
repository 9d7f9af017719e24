"""ModelCheckpoint: names, cadence, top-k rotation, last.ckpt, monitors, state; OnExceptionCheckpoint.
Then ModelCheckpoint as Lightning's: when ``last`` is written, ``last`` name templates, ``save_last="link"``,
``-v1``/``-v2`` versions for names taken by an earlier run, and scores as tensors.

Every expected file list in that second part (from "Lightning parity" on) was checked against Lightning
2.6.6 running the same module (4 training batches per epoch, validation once per epoch) unless a comment
says where ember differs on purpose (docs/from-lightning.md, "Where ember deliberately differs from Lightning").
"""

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
    # 2.6.6 leaves it at step 6, the last top-k save (docs/from-lightning.md: where ember deliberately differs).
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
    # As Lightning: the file is named by the callback's template, for the metrics at the exception.
    def fit(directory):
        with pytest.raises(KeyboardInterrupt):
            ember.Trainer(
                max_epochs=2,
                enable_progress_bar=False,
                logger=False,
                callbacks=[
                    Interrupt(),
                    ModelCheckpoint(dirpath=directory, filename="m-{step}", save_on_exception=True, save_last=False),
                ],  # fmt: skip
            ).fit(Scored(), data())

    fit(tmp_path / "a")
    assert torch.load(tmp_path / "a" / "m-step=3.ckpt", weights_only=True)["progress"]["global_step"] == 3
    # A file of that name already there is kept: the exception's state goes beside it.
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "m-step=3.ckpt").write_bytes(b"earlier")
    fit(tmp_path / "b")
    assert (tmp_path / "b" / "m-step=3.ckpt").read_bytes() == b"earlier"
    assert torch.load(tmp_path / "b" / "m-step=3-v1.ckpt", weights_only=True)["progress"]["global_step"] == 3


def test_model_checkpoint_save_on_exception_keeps_the_templates_folder(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        ember.Trainer(
            max_epochs=2,
            enable_progress_bar=False,
            logger=False,
            callbacks=[Interrupt(), ModelCheckpoint(dirpath=tmp_path, filename="sub/m-{step}", save_on_exception=True)],
        ).fit(Scored(), data())
    assert torch.load(tmp_path / "sub" / "m-step=3.ckpt", weights_only=True)["progress"]["global_step"] == 3


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


# ---------------------------------------------------------------------------------------------- Lightning parity
class Module(ember.TrainModule):
    """``val_loss`` = ``scores[epoch]`` (default: always improving)."""

    def __init__(self, scores: list[float] | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.scores = scores or [5.0, 4.0, 3.0, 2.0, 1.0]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.tensor(self.scores[self.current_epoch]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SaveRecorder(Callback):
    """Records (file name, epoch, global step) of every ``trainer.save_checkpoint`` call."""

    def __init__(self) -> None:
        self.saves: list[tuple[str, int, int]] = []

    def setup(self, trainer: ember.Trainer, module: ember.TrainModule, stage: str) -> None:
        original = trainer.save_checkpoint

        def recording(path: Any, *args: Any, **kwargs: Any) -> Any:
            self.saves.append((os.path.basename(path), trainer.current_epoch, trainer.global_step))
            return original(path, *args, **kwargs)

        trainer.save_checkpoint = recording  # type: ignore[method-assign]


def loader(n: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 2, generator=torch.Generator().manual_seed(0))), batch_size=2)


def fit_recording(
    cb: ModelCheckpoint, epochs: int = 2, val: bool = True, module: ember.TrainModule | None = None, root: Any = None
) -> SaveRecorder:
    rec = SaveRecorder()
    trainer = ember.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        enable_model_summary=False,
        callbacks=[cb, rec],
        default_root_dir=root,
    )
    trainer.fit(module or Module(), loader(), loader() if val else None)
    return rec


def step_in(path: Any) -> int:
    return torch.load(path, weights_only=True)["global_step"]


# ---------------------------------------------------------------------------------------------- when last is written
@pytest.mark.parametrize("every_n_epochs", [0, 5])
def test_save_last_ignores_every_n_epochs(tmp_path, every_n_epochs):
    # Lightning 2.6.6 (save_top_k=0): no top-k file, and a last.ckpt of the final state (epoch 2, step 8).
    # ember writes that last.ckpt at each epoch end (steps 4 and 8): ``every_n_epochs`` does not affect
    # save_last, as Lightning's documentation says; 2.6.6 writes it once, when training ends.
    cb = ModelCheckpoint(dirpath=tmp_path, save_top_k=0, every_n_epochs=every_n_epochs, save_last=True)
    rec = fit_recording(cb)
    assert files(tmp_path) == ["last.ckpt"]
    assert cb.last_model_path == str(tmp_path / "last.ckpt")
    assert [s for _, _, s in rec.saves] == [4, 8] and step_in(tmp_path / "last.ckpt") == 8


def test_top_k_follows_every_n_epochs_and_last_holds_the_final_state(tmp_path):
    # Lightning 2.6.6, 3 epochs, every_n_epochs=2: top-k files ['epoch=1-step=8.ckpt'] (+ last.ckpt).
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=2, save_top_k=-1, save_last=True)
    fit_recording(cb, epochs=3)
    assert files(tmp_path) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert cb.best_model_path == str(tmp_path / "epoch=1-step=8.ckpt")
    # ember: last.ckpt is the final state (step 12); Lightning 2.6.6 leaves it at step 8 (docs/from-lightning.md).
    assert step_in(tmp_path / "last.ckpt") == 12


def test_last_written_when_training_ends_without_a_save_point(tmp_path):
    # Lightning 2.6.6: no validation and save_on_train_epoch_end=False: only last.ckpt, written when
    # training ends (epoch 2, global step 8).
    cb = ModelCheckpoint(dirpath=tmp_path, save_on_train_epoch_end=False, save_last=True)
    rec = fit_recording(cb, val=False)
    assert files(tmp_path) == ["last.ckpt"]
    assert rec.saves == [("last.ckpt", 2, 8)]
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert (ckpt["epoch"], ckpt["global_step"]) == (2, 8)


def test_a_save_at_the_last_step_is_not_repeated_when_training_ends(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    rec = fit_recording(cb)
    assert rec.saves == [("epoch=0-step=4.ckpt", 0, 4), ("epoch=1-step=8.ckpt", 1, 8)]  # last.ckpt: hard links
    assert files(tmp_path) == ["epoch=1-step=8.ckpt", "last.ckpt"]


# ---------------------------------------------------------------------------------------------- last's name
def test_last_name_template_is_formatted_and_the_previous_one_removed(tmp_path):
    # Lightning 2.6.6, CHECKPOINT_NAME_LAST = "last-{epoch}", 3 epochs, monitor val_loss (improving):
    # ['epoch=2-step=12.ckpt', 'last-epoch=2.ckpt'], last_model_path .../last-epoch=2.ckpt
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_last=True)
    cb.CHECKPOINT_NAME_LAST = "last-{epoch}"
    fit_recording(cb, epochs=3)
    assert files(tmp_path) == ["epoch=2-step=12.ckpt", "last-epoch=2.ckpt"]
    assert cb.last_model_path == str(tmp_path / "last-epoch=2.ckpt")
    # the checkpoint names itself as last (a resume from it continues with the right file list)
    state = torch.load(tmp_path / "last-epoch=2.ckpt", weights_only=True)["callbacks"]
    assert [s["last_model_path"] for s in state.values() if "last_model_path" in s] == [cb.last_model_path]


def test_save_last_link_is_a_relative_symlink_to_the_latest_top_k_file(tmp_path):
    # Lightning 2.6.6 (save_top_k=2, 3 epochs, improving): ['epoch=1-step=8.ckpt', 'epoch=2-step=12.ckpt',
    # 'last.ckpt'], last.ckpt -> 'epoch=2-step=12.ckpt' (a relative symbolic link), no second write.
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last="link")
    rec = fit_recording(cb, epochs=3)
    assert files(tmp_path) == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"]
    assert os.path.islink(tmp_path / "last.ckpt") and os.readlink(tmp_path / "last.ckpt") == "epoch=2-step=12.ckpt"
    assert [name for name, _, _ in rec.saves] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    assert step_in(cb.last_model_path) == 12


def test_save_last_link_points_to_the_last_top_k_file_when_the_score_does_not_improve(tmp_path):
    # Lightning 2.6.6, val_loss 3, 1, 2, 4: top-1 is epoch=1-step=8.ckpt and last.ckpt links to it.
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_last="link")
    fit_recording(cb, epochs=4, module=Module([3.0, 1.0, 2.0, 4.0]))
    assert files(tmp_path) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=1-step=8.ckpt"


def test_save_last_rejects_other_values():
    with pytest.raises(ValueError, match="save_last must be True, False or 'link'"):
        ModelCheckpoint(save_last="symlink")


# ---------------------------------------------------------------------------------------------- versions
def test_a_second_run_in_the_same_directory_gets_versioned_names(tmp_path):
    # Lightning 2.6.6, three Trainers one after the other, default ModelCheckpoint(save_last=True):
    # run 1: ['epoch=1-step=8.ckpt', 'last.ckpt']
    # run 2: adds 'epoch=1-step=8-v1.ckpt', 'last-v1.ckpt' (best and last of run 2)
    # run 3: adds 'epoch=1-step=8-v2.ckpt', 'last-v2.ckpt'
    expected = [["epoch=1-step=8.ckpt", "last.ckpt"]]
    expected.append(sorted(expected[0] + ["epoch=1-step=8-v1.ckpt", "last-v1.ckpt"]))
    expected.append(sorted(expected[1] + ["epoch=1-step=8-v2.ckpt", "last-v2.ckpt"]))
    for run, suffix in enumerate(["", "-v1", "-v2"]):
        cb = ModelCheckpoint(dirpath=tmp_path, save_last=True)
        fit_recording(cb)
        assert files(tmp_path) == expected[run]
        assert cb.best_model_path == str(tmp_path / f"epoch=1-step=8{suffix}.ckpt")
        assert cb.last_model_path == str(tmp_path / f"last{suffix}.ckpt")
        assert step_in(cb.last_model_path) == 8


def test_a_second_run_versions_a_templated_last_and_a_link(tmp_path):
    # Lightning 2.6.6: CHECKPOINT_NAME_LAST = "last-{epoch}" twice: 'last-epoch=1.ckpt', then 'last-epoch=1-v1.ckpt';
    # save_last="link" twice: last.ckpt -> epoch=1-step=8.ckpt, last-v1.ckpt -> epoch=1-step=8-v1.ckpt.
    for run in range(2):
        cb = ModelCheckpoint(dirpath=tmp_path / "template", monitor="val_loss", save_last=True)
        cb.CHECKPOINT_NAME_LAST = "last-{epoch}"
        fit_recording(cb)
        assert os.path.basename(cb.last_model_path) == ["last-epoch=1.ckpt", "last-epoch=1-v1.ckpt"][run]
        link = ModelCheckpoint(dirpath=tmp_path / "link", save_last="link")
        fit_recording(link)
    assert files(tmp_path / "template") == [
        "epoch=1-step=8-v1.ckpt",
        "epoch=1-step=8.ckpt",
        "last-epoch=1-v1.ckpt",
        "last-epoch=1.ckpt",
    ]
    assert files(tmp_path / "link") == ["epoch=1-step=8-v1.ckpt", "epoch=1-step=8.ckpt", "last-v1.ckpt", "last.ckpt"]
    assert os.readlink(tmp_path / "link" / "last.ckpt") == "epoch=1-step=8.ckpt"
    assert os.readlink(tmp_path / "link" / "last-v1.ckpt") == "epoch=1-step=8-v1.ckpt"


def test_without_the_version_counter_a_second_run_overwrites(tmp_path):
    # Lightning 2.6.6, enable_version_counter=False twice: ['epoch=1-step=8.ckpt', 'last.ckpt'] both times.
    for _ in range(2):
        fit_recording(ModelCheckpoint(dirpath=tmp_path, save_last=True, enable_version_counter=False))
        assert files(tmp_path) == ["epoch=1-step=8.ckpt", "last.ckpt"]


def test_a_kept_top_k_file_with_the_same_name_is_not_overwritten(tmp_path):
    # Lightning 2.6.6: filename "{epoch}", save_top_k=2 ranked by train_loss, saving every 2 steps of one
    # epoch: ['epoch=0-v1.ckpt', 'epoch=0.ckpt'], both in best_k_models.
    cb = ModelCheckpoint(
        dirpath=tmp_path, filename="{epoch}", monitor="train_loss", save_top_k=2, every_n_train_steps=2, save_last=False
    )
    fit_recording(cb, epochs=1)
    assert files(tmp_path) == ["epoch=0-v1.ckpt", "epoch=0.ckpt"]
    assert sorted(os.path.basename(p) for p in cb.best_k_models) == ["epoch=0-v1.ckpt", "epoch=0.ckpt"]


def test_the_file_being_replaced_is_overwritten_not_versioned(tmp_path):
    # Lightning 2.6.6: filename "{epoch}", save_top_k=1 without a monitor, every 2 steps of one epoch:
    # ['epoch=0.ckpt', 'last.ckpt'] (the second save replaces the first under the same name).
    cb = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", every_n_train_steps=2, save_last=True)
    fit_recording(cb, epochs=1)
    assert files(tmp_path) == ["epoch=0.ckpt", "last.ckpt"]
    assert step_in(tmp_path / "epoch=0.ckpt") == 4


# ---------------------------------------------------------------------------------------------- scores
def test_scores_are_tensors(tmp_path):
    # Lightning 2.6.6: current_score, best_model_score, kth_value and the best_k_models values are
    # tensors; current_score is the value of the last save that entered the top k (val_loss 3, 1, 2, 4 -> 1.0).
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_last=False)
    fit_recording(cb, epochs=4, module=Module([3.0, 1.0, 2.0, 4.0]))
    assert isinstance(cb.current_score, torch.Tensor) and isinstance(cb.best_model_score, torch.Tensor)
    assert cb.current_score.item() == 1.0 and cb.best_model_score.item() == 1.0
    assert cb.best_model_score.shape == () and cb.best_model_score.device.type == "cpu"
    assert isinstance(cb.kth_value, torch.Tensor) and cb.kth_value.item() == 1.0
    assert {os.path.basename(k): v.item() for k, v in cb.best_k_models.items()} == {"epoch=1-step=8.ckpt": 1.0}
    assert cb.best_model_path == str(tmp_path / "epoch=1-step=8.ckpt")


def test_a_replaced_top_k_file_is_removed_only_after_last_stopped_pointing_at_it(tmp_path, monkeypatch):
    # ember's own ordering (Lightning removes first, then links): a crash between the two steps must not
    # leave last.ckpt dangling or pointing at a deleted file.
    import ember.callbacks.model_checkpoint as mc

    seen: list[tuple[str, str]] = []
    remove = os.remove

    def recording_remove(path: str) -> None:
        seen.append((os.path.basename(path), os.readlink(tmp_path / "last.ckpt")))
        remove(path)

    monkeypatch.setattr(mc.os, "remove", recording_remove)
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_last="link")
    fit_recording(cb, epochs=3)
    assert seen == [("epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"), ("epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt")]
    assert files(tmp_path) == ["epoch=2-step=12.ckpt", "last.ckpt"]


def test_next_last_path_names_a_free_file_beside_an_earlier_run(tmp_path):
    first = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    rec = SaveRecorder()
    trainer = ember.Trainer(
        max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[first, rec]
    )
    trainer.fit(Module(), loader())
    assert first.next_last_path(trainer) == str(tmp_path / "last.ckpt")  # its own last: replaced in place
    assert ModelCheckpoint(dirpath=tmp_path).next_last_path(trainer) == str(tmp_path / "last-v1.ckpt")
