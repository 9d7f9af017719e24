"""ModelCheckpoint as Lightning's: when ``last`` is written, ``last`` name templates, ``save_last="link"``,
``-v1``/``-v2`` versions for names taken by an earlier run, and scores as tensors.

Every expected file list below was checked against Lightning 2.6.6 running the same module (4
training batches per epoch, validation once per epoch) unless a comment says where ember differs on
purpose (README, "Where ember deliberately differs from Lightning").
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint


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


def fit(
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


def files(directory: Any) -> list[str]:
    return sorted(os.listdir(directory))


def step_in(path: Any) -> int:
    return torch.load(path, weights_only=True)["global_step"]


# ---------------------------------------------------------------------------------------------- when last is written
@pytest.mark.parametrize("every_n_epochs", [0, 5])
def test_save_last_ignores_every_n_epochs(tmp_path, every_n_epochs):
    # Lightning 2.6.6 (save_top_k=0): no top-k file, and a last.ckpt of the final state (epoch 2, step 8).
    # ember writes that last.ckpt at each epoch end (steps 4 and 8): ``every_n_epochs`` does not affect
    # save_last, as Lightning's documentation says; 2.6.6 writes it once, when training ends.
    cb = ModelCheckpoint(dirpath=tmp_path, save_top_k=0, every_n_epochs=every_n_epochs, save_last=True)
    rec = fit(cb)
    assert files(tmp_path) == ["last.ckpt"]
    assert cb.last_model_path == str(tmp_path / "last.ckpt")
    assert [s for _, _, s in rec.saves] == [4, 8] and step_in(tmp_path / "last.ckpt") == 8


def test_top_k_follows_every_n_epochs_and_last_holds_the_final_state(tmp_path):
    # Lightning 2.6.6, 3 epochs, every_n_epochs=2: top-k files ['epoch=1-step=8.ckpt'] (+ last.ckpt).
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=2, save_top_k=-1, save_last=True)
    fit(cb, epochs=3)
    assert files(tmp_path) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert cb.best_model_path == str(tmp_path / "epoch=1-step=8.ckpt")
    # ember: last.ckpt is the final state (step 12); Lightning 2.6.6 leaves it at step 8 (README).
    assert step_in(tmp_path / "last.ckpt") == 12


def test_last_written_when_training_ends_without_a_save_point(tmp_path):
    # Lightning 2.6.6: no validation and save_on_train_epoch_end=False: only last.ckpt, written when
    # training ends (epoch 2, global step 8).
    cb = ModelCheckpoint(dirpath=tmp_path, save_on_train_epoch_end=False, save_last=True)
    rec = fit(cb, val=False)
    assert files(tmp_path) == ["last.ckpt"]
    assert rec.saves == [("last.ckpt", 2, 8)]
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert (ckpt["epoch"], ckpt["global_step"]) == (2, 8)


def test_a_save_at_the_last_step_is_not_repeated_when_training_ends(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    rec = fit(cb)
    assert rec.saves == [("epoch=0-step=4.ckpt", 0, 4), ("epoch=1-step=8.ckpt", 1, 8)]  # last.ckpt: hard links
    assert files(tmp_path) == ["epoch=1-step=8.ckpt", "last.ckpt"]


# ---------------------------------------------------------------------------------------------- last's name
def test_last_name_template_is_formatted_and_the_previous_one_removed(tmp_path):
    # Lightning 2.6.6, CHECKPOINT_NAME_LAST = "last-{epoch}", 3 epochs, monitor val_loss (improving):
    # ['epoch=2-step=12.ckpt', 'last-epoch=2.ckpt'], last_model_path .../last-epoch=2.ckpt
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_last=True)
    cb.CHECKPOINT_NAME_LAST = "last-{epoch}"
    fit(cb, epochs=3)
    assert files(tmp_path) == ["epoch=2-step=12.ckpt", "last-epoch=2.ckpt"]
    assert cb.last_model_path == str(tmp_path / "last-epoch=2.ckpt")
    # the checkpoint names itself as last (a resume from it continues with the right file list)
    state = torch.load(tmp_path / "last-epoch=2.ckpt", weights_only=True)["callbacks"]
    assert [s["last_model_path"] for s in state.values() if "last_model_path" in s] == [cb.last_model_path]


def test_save_last_link_is_a_relative_symlink_to_the_latest_top_k_file(tmp_path):
    # Lightning 2.6.6 (save_top_k=2, 3 epochs, improving): ['epoch=1-step=8.ckpt', 'epoch=2-step=12.ckpt',
    # 'last.ckpt'], last.ckpt -> 'epoch=2-step=12.ckpt' (a relative symbolic link), no second write.
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last="link")
    rec = fit(cb, epochs=3)
    assert files(tmp_path) == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"]
    assert os.path.islink(tmp_path / "last.ckpt") and os.readlink(tmp_path / "last.ckpt") == "epoch=2-step=12.ckpt"
    assert [name for name, _, _ in rec.saves] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    assert step_in(cb.last_model_path) == 12


def test_save_last_link_points_to_the_last_top_k_file_when_the_score_does_not_improve(tmp_path):
    # Lightning 2.6.6, val_loss 3, 1, 2, 4: top-1 is epoch=1-step=8.ckpt and last.ckpt links to it.
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_last="link")
    fit(cb, epochs=4, module=Module([3.0, 1.0, 2.0, 4.0]))
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
        fit(cb)
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
        fit(cb)
        assert os.path.basename(cb.last_model_path) == ["last-epoch=1.ckpt", "last-epoch=1-v1.ckpt"][run]
        link = ModelCheckpoint(dirpath=tmp_path / "link", save_last="link")
        fit(link)
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
        fit(ModelCheckpoint(dirpath=tmp_path, save_last=True, enable_version_counter=False))
        assert files(tmp_path) == ["epoch=1-step=8.ckpt", "last.ckpt"]


def test_a_kept_top_k_file_with_the_same_name_is_not_overwritten(tmp_path):
    # Lightning 2.6.6: filename "{epoch}", save_top_k=2 ranked by train_loss, saving every 2 steps of one
    # epoch: ['epoch=0-v1.ckpt', 'epoch=0.ckpt'], both in best_k_models.
    cb = ModelCheckpoint(
        dirpath=tmp_path, filename="{epoch}", monitor="train_loss", save_top_k=2, every_n_train_steps=2, save_last=False
    )
    fit(cb, epochs=1)
    assert files(tmp_path) == ["epoch=0-v1.ckpt", "epoch=0.ckpt"]
    assert sorted(os.path.basename(p) for p in cb.best_k_models) == ["epoch=0-v1.ckpt", "epoch=0.ckpt"]


def test_the_file_being_replaced_is_overwritten_not_versioned(tmp_path):
    # Lightning 2.6.6: filename "{epoch}", save_top_k=1 without a monitor, every 2 steps of one epoch:
    # ['epoch=0.ckpt', 'last.ckpt'] (the second save replaces the first under the same name).
    cb = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", every_n_train_steps=2, save_last=True)
    fit(cb, epochs=1)
    assert files(tmp_path) == ["epoch=0.ckpt", "last.ckpt"]
    assert step_in(tmp_path / "epoch=0.ckpt") == 4


# ---------------------------------------------------------------------------------------------- scores
def test_scores_are_tensors(tmp_path):
    # Lightning 2.6.6: current_score, best_model_score, kth_value and the best_k_models values are
    # tensors; current_score is the value of the last save that entered the top k (val_loss 3, 1, 2, 4 -> 1.0).
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_last=False)
    fit(cb, epochs=4, module=Module([3.0, 1.0, 2.0, 4.0]))
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
    fit(cb, epochs=3)
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
