"""Where ModelCheckpoint writes: the directory lock across fits in one process (persistent DataLoader
workers, two callbacks on one directory), file names with folders, and a directory that cannot be
written, found before training starts. Default configuration: logger and checkpointing on."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ember
from ember.callbacks import ModelCheckpoint
from tests.helpers.models import BoringModel, regression_data


class Counting(BoringModel):
    """Counts its training batches, so a test can tell that none ran."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batches += 1
        return super().training_step(batch, batch_idx)


def trainer(root: Path, epochs: int = 1, **kwargs: Any) -> ember.Trainer:
    return ember.Trainer(
        max_epochs=epochs,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        **kwargs,
    )


def loader(**kwargs: Any) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(regression_data(), batch_size=8, **kwargs)


# ---------------------------------------------------------------------------------------------- the lock
@pytest.mark.processes
@pytest.mark.timeout(120)
def test_fit_then_resume_in_one_process_with_persistent_workers(tmp_path: Path) -> None:
    first = trainer(tmp_path)
    first.fit(BoringModel(), loader(num_workers=1, persistent_workers=True))
    # The workers ember's copy of the loader started are stopped when fit ends, not when the Trainer
    # is collected (which took about 5 s per worker).
    assert multiprocessing.active_children() == []
    second = trainer(tmp_path, epochs=2)  # `first` is still alive
    second.fit(BoringModel(), loader(num_workers=1, persistent_workers=True), ckpt_path="last")
    assert second.global_step == 8
    assert second.ckpt_path == str(tmp_path / "ember_logs" / "version_0" / "checkpoints" / "last.ckpt")
    assert multiprocessing.active_children() == []


def test_two_checkpoint_callbacks_share_the_default_directory(tmp_path: Path) -> None:
    best, every_step = (
        ModelCheckpoint(monitor="train_loss"),
        ModelCheckpoint(every_n_train_steps=1, filename="{step}", save_top_k=-1),
    )
    trainer(tmp_path, callbacks=[best, every_step]).fit(BoringModel(), loader())
    ck = tmp_path / "ember_logs" / "version_0" / "checkpoints"
    assert best.dirpath == every_step.dirpath == str(ck)
    assert {"step=1.ckpt", "step=2.ckpt", "step=3.ckpt", "step=4.ckpt", "epoch=0-step=4.ckpt"} <= set(os.listdir(ck))


# ---------------------------------------------------------------------------------------------- names with folders
def test_top_k_rotation_reaches_files_in_a_filename_folder(tmp_path: Path) -> None:
    callback = ModelCheckpoint(filename="sub/e{epoch}", save_top_k=1)
    trainer(tmp_path, epochs=3, callbacks=[callback]).fit(BoringModel(), loader())
    ck = tmp_path / "ember_logs" / "version_0" / "checkpoints"
    assert sorted(os.listdir(ck / "sub")) == ["eepoch=2.ckpt"]  # as Lightning: one kept
    assert sorted(os.listdir(ck)) == ["last.ckpt", "sub"]
    assert callback.best_model_path == str(ck / "sub" / "eepoch=2.ckpt")


@pytest.mark.parametrize("filename", ["../x{epoch}", "sub/../../x{epoch}", "{epoch}/../../x", "/elsewhere/x{epoch}"])
def test_a_name_outside_the_directory_is_refused_when_the_callback_is_made(filename: str) -> None:
    with pytest.raises(
        ValueError,
        match=r"ModelCheckpoint\(filename=.*\) names a file outside the checkpoint "
        r"directory\. .* Choose the directory with dirpath=",
    ):
        ModelCheckpoint(filename=filename)


def test_a_last_name_outside_the_directory_stops_fit_before_training(tmp_path: Path) -> None:
    callback = ModelCheckpoint()
    callback.CHECKPOINT_NAME_LAST = "../last"
    module = Counting()
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(CHECKPOINT_NAME_LAST='../last'\) names a file outside"):
        trainer(tmp_path, callbacks=[callback]).fit(module, loader())
    assert module.batches == 0
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_logged_value_that_leads_outside_the_directory_is_refused(tmp_path: Path) -> None:
    callback = ModelCheckpoint(dirpath=str(tmp_path / "ck"), filename="{tag}/w", auto_insert_metric_name=False)
    assert callback.format_checkpoint_name({"tag": "a"}) == str(tmp_path / "ck" / "a" / "w.ckpt")
    with pytest.raises(
        ValueError,
        match=rf"names {tmp_path / 'w.ckpt'}, outside the checkpoint directory "
        rf"{tmp_path / 'ck'}: a logged value in the name contains '\.\.'",
    ):
        callback.format_checkpoint_name({"tag": ".."})


# ---------------------------------------------------------------------------------------------- unwritable
# Tested with what root cannot write either (the suite may run as root, for whom a chmod'ed
# directory stays writable): a directory under a regular file, and a read-only mount.
@pytest.fixture
def read_only_mount(tmp_path: Path):
    """A read-only tmpfs (needs root and mount permission; skipped elsewhere)."""
    import subprocess

    mount = tmp_path / "ro"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def assert_stops_before_training(root: Path, dirpath: Path, reason: str, **kwargs: Any) -> None:
    module = Counting()
    callbacks = [ModelCheckpoint(dirpath=str(dirpath))] if kwargs.pop("given", True) else []
    with pytest.raises(
        OSError,
        match=rf"Checkpoints cannot be written into {dirpath} \({reason}.*\)\. Found before "
        r"training started, so nothing is lost: make that directory writable, or write checkpoints "
        r"elsewhere \(ModelCheckpoint\(dirpath=\.\.\.\), Trainer\(default_root_dir=\.\.\.\)\)\.",
    ):
        trainer(root, callbacks=callbacks, **kwargs).fit(module, loader())
    assert module.batches == 0


def test_a_checkpoint_directory_under_a_regular_file_stops_fit_before_training(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("not a directory")
    assert_stops_before_training(tmp_path, tmp_path / "a_file" / "checkpoints", "NotADirectoryError")
    assert_stops_before_training(tmp_path, tmp_path / "a_file", "FileExistsError")


@pytest.mark.processes
def test_a_read_only_default_directory_stops_fit_before_training(read_only_mount: Path) -> None:
    # The default configuration: the logger on, the checkpoints in its run directory.
    assert_stops_before_training(
        read_only_mount,
        read_only_mount / "ember_logs" / "version_0" / "checkpoints",
        "OSError: Read-only file system",
        given=False,
    )


@pytest.mark.processes
def test_an_existing_read_only_directory_stops_fit_before_training(read_only_mount: Path) -> None:
    # Nothing to create (the mount point itself), the logs elsewhere: without the probe, the first save
    # failed, an epoch later.
    assert_stops_before_training(read_only_mount.parent, read_only_mount, "OSError: Read-only file system")


# ---------------------------------------------------------------------------------------------- under ddp
def _ddp_problems(rank: int, world: int, root: str) -> list[str]:
    """On each of 2 gloo ranks: fits that must stop at start-up, on every rank alike (rank zero looks)."""
    import warnings

    from tests.helpers.dist import join_as_rank

    join_as_rank(rank, world)
    warnings.simplefilter("ignore")
    seen = []
    for dirpath, ckpt_path in ((os.path.join(root, "a_file", "ck"), None), (os.path.join(root, "links"), "last")):
        module = Counting()
        t = ember.Trainer(
            strategy="ddp",
            devices=world,
            accelerator="cpu",
            max_epochs=1,
            default_root_dir=root,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ModelCheckpoint(dirpath=dirpath)],
        )
        try:
            t.fit(module, loader(), ckpt_path=ckpt_path)
            seen.append("no error")
        except Exception as err:
            seen.append(f"{type(err).__name__} after {module.batches} batches: {err}")
    return seen


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_under_ddp_every_rank_stops_at_start_up(tmp_path: Path) -> None:
    from tests.helpers.dist import run_ranks

    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "links").mkdir()
    os.symlink("epoch=0-step=4.ckpt", tmp_path / "links" / "last.ckpt")  # a link to a removed file
    ranks = run_ranks(_ddp_problems, 2, str(tmp_path), timeout=100)
    for seen in ranks:
        assert seen[0].startswith(
            f"NotADirectoryError after 0 batches: [Errno 20] Checkpoints cannot be written into "
            f"{tmp_path / 'a_file' / 'ck'}"
        ), seen[0]
        assert seen[1].startswith(
            f"CheckpointNotFoundError after 0 batches: ckpt_path='last': "
            f"{tmp_path / 'links' / 'last.ckpt'} is a symbolic link to 'epoch=0-step=4.ckpt', "
            "which does not exist"
        ), seen[1]
