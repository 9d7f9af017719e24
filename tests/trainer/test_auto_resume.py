"""fit(ckpt_path="auto") and the automatic resume of a restarted torchrun / SLURM job, in one process
(the real restarts are in test_elastic.py)."""

from __future__ import annotations

import os
import re
import signal
import struct
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import ember
from ember.callbacks import ModelCheckpoint
from ember.checkpoint import CheckpointNotFoundError, auto_resume
from ember.exceptions import Preempted
from ember.trainer.preemption import requeue_slurm_job
from tests.helpers.models import BoringModel, regression_loader


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith(("TORCHELASTIC_", "SLURM_")):
            monkeypatch.delenv(var)


def trainer(root: Path, epochs: int, **kwargs) -> ember.Trainer:
    kwargs.setdefault("callbacks", [ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)])
    return ember.Trainer(
        max_epochs=epochs,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        **kwargs,
    )


def fit(root: Path, epochs: int, ckpt_path=None, **kwargs) -> ember.Trainer:
    torch.manual_seed(0)
    t = trainer(root, epochs, **kwargs)
    t.fit(BoringModel(), regression_loader(), ckpt_path=ckpt_path)
    return t


def test_restart_and_job_key_from_the_environment() -> None:
    assert auto_resume.restart({}) is None
    assert auto_resume.restart({"TORCHELASTIC_RESTART_COUNT": "0", "SLURM_RESTART_COUNT": ""}) is None
    assert (
        auto_resume.restart({"TORCHELASTIC_RESTART_COUNT": "2"}) == "torchrun restart 2 (TORCHELASTIC_RESTART_COUNT=2)"
    )
    assert auto_resume.restart({"SLURM_RESTART_COUNT": "1"}) == "SLURM requeue 1 (SLURM_RESTART_COUNT=1)"
    assert auto_resume.job_key({}) is None
    assert auto_resume.job_key({"SLURM_JOB_ID": "17"}) == "slurm:17"
    # A requeue keeps the job id; an array task is named by its array job and task.
    assert (
        auto_resume.job_key({"SLURM_JOB_ID": "20", "SLURM_ARRAY_JOB_ID": "19", "SLURM_ARRAY_TASK_ID": "1"})
        == "slurm:19_1"
    )
    a = auto_resume.job_key({"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "none"})
    b = auto_resume.job_key({"TORCHELASTIC_RESTART_COUNT": "3", "TORCHELASTIC_RUN_ID": "none"})
    assert a == b and a is not None and a.startswith("torchrun:none:")  # the same agent: the same job


def test_auto_starts_fresh_without_a_word_then_continues_the_run(tmp_path: Path, capfd) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*log_every_n_steps|.*val_dataloader|.*num_workers")
        first = fit(tmp_path, 1, ckpt_path="auto")
    assert first.global_step == 4 and "[ember]" not in capfd.readouterr().err
    second = fit(tmp_path, 3, ckpt_path="auto")
    err = capfd.readouterr().err
    last = tmp_path / "ember_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"[ember] ckpt_path='auto': resuming from {last} (epoch 0, global step 4)." in err
    assert second.global_step == 12 and second.ckpt_path == str(last)
    assert sorted(p.name for p in (tmp_path / "ember_logs").iterdir()) == ["version_0"]  # the same run
    ref = fit(tmp_path / "ref", 3)
    for (k, a), b in zip(ref.module.state_dict().items(), second.module.state_dict().values()):
        assert torch.equal(a, b), k


def test_auto_skips_weights_only_exception_and_unreadable_files(tmp_path: Path, capfd) -> None:
    fit(tmp_path, 1, callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=2, save_top_k=-1)])
    ck = tmp_path / "ck"
    good = ck / "epoch=0-step=2.ckpt"
    os.utime(good, (1e9 + 10, 1e9 + 10))  # the oldest, so every other file would come first
    for name in ("epoch=0-step=4.ckpt", "last.ckpt"):
        os.remove(ck / name)
    (ck / "zz-garbage.ckpt").write_bytes(b"not a checkpoint")
    state = torch.load(good, weights_only=True)
    torch.save({**state, "weights_only": True}, ck / "weights.ckpt")
    torch.save(state, ck / "on_exception.ckpt")
    with pytest.warns(UserWarning, match="zz-garbage.ckpt .* cannot be read"):
        t = fit(
            tmp_path,
            1,
            ckpt_path="auto",
            callbacks=[ModelCheckpoint(dirpath=str(ck), every_n_train_steps=2, save_top_k=-1)],
        )
    assert t.ckpt_path == str(good)
    assert f"resuming from {good} (epoch 0, global step 2)" in capfd.readouterr().err


def test_auto_is_for_fit_only(tmp_path: Path) -> None:
    t = fit(tmp_path, 1)
    with pytest.raises(ValueError, match="ckpt_path='auto' applies to fit"):
        t.validate(t.module, regression_loader(), ckpt_path="auto")


def test_a_restart_resumes_its_own_job_whatever_ckpt_path_says(tmp_path: Path, monkeypatch, capfd) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    fit(tmp_path, 1)  # the first attempt wrote ember_logs/version_0
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    # The path the first attempt started from (here: none existing) is not used again.
    t = fit(tmp_path, 2, ckpt_path=str(tmp_path / "pretrained.ckpt"))
    assert t.ckpt_path == str(tmp_path / "ember_logs" / "version_0" / "checkpoints" / "last.ckpt")
    assert "[ember] SLURM requeue 1 (SLURM_RESTART_COUNT=1): resuming from" in capfd.readouterr().err
    assert t.global_step == 8


def test_a_restart_never_takes_another_jobs_checkpoint(tmp_path: Path, monkeypatch, capfd) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    fit(tmp_path, 1)  # job 7 finished here
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # job 8 restarted before writing any checkpoint
    t = fit(tmp_path, 1)
    assert (
        "SLURM requeue 1 (SLURM_RESTART_COUNT=1): no checkpoint of this job yet; starting from scratch"
        in capfd.readouterr().err
    )
    assert t.ckpt_path is None and t.global_step == 4


class StopAtStep(ember.callbacks.Callback):
    """Raises once the fit reached ``step``: the attempt dies there."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            raise RuntimeError("killed")


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_a_restart_without_a_checkpoint_yet_continues_the_first_attempts_run(
    tmp_path: Path, monkeypatch, capfd, launcher: str
) -> None:
    # The first attempt dies after it wrote into ember_logs/version_0 but before its first checkpoint:
    # the restart starts from scratch in the same run, not in a version_1 of its own.
    if launcher == "torchrun":
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    else:
        monkeypatch.setenv("SLURM_JOB_ID", "7")
    with pytest.raises(RuntimeError, match="killed"):
        fit(tmp_path, 1, callbacks=[ModelCheckpoint(every_n_train_steps=3), StopAtStep(1)], logger=True)
    runs = tmp_path / "ember_logs"
    assert sorted(p.name for p in runs.iterdir()) == ["version_0"]
    assert not list(runs.glob("version_0/checkpoints/*.ckpt"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT" if launcher == "torchrun" else "SLURM_RESTART_COUNT", "1")
    t = fit(tmp_path, 1, callbacks=[ModelCheckpoint(every_n_train_steps=3)], logger=True)
    assert "no checkpoint of this job yet; starting from scratch" in capfd.readouterr().err
    assert t.global_step == 4 and t.log_dir == str(runs / "version_0")
    assert sorted(p.name for p in runs.iterdir()) == ["version_0"]
    assert (runs / "version_0" / "checkpoints" / "last.ckpt").exists()


def test_another_jobs_run_is_not_continued_and_a_plain_run_marks_nothing(tmp_path: Path, monkeypatch) -> None:
    fit(tmp_path, 1)  # no launcher: no job to record
    assert not (tmp_path / "ember_logs" / "version_0" / ".ember_job").exists()
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    with pytest.raises(RuntimeError, match="killed"):
        fit(tmp_path, 1, callbacks=[ModelCheckpoint(every_n_train_steps=3), StopAtStep(1)])
    assert (tmp_path / "ember_logs" / "version_1" / ".ember_job").read_text() == "slurm:7\n"
    monkeypatch.setenv("SLURM_JOB_ID", "8")  # a different job, restarted before any checkpoint
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    t = fit(tmp_path, 1)
    assert t.log_dir == str(tmp_path / "ember_logs" / "version_2")


@pytest.mark.processes
def test_sigusr1_requeue_reports_how_and_falls_back_when_scontrol_fails(tmp_path: Path, monkeypatch) -> None:
    exc = Preempted(signal.SIGUSR1, "x/last.ckpt", "requeued SLURM job 5 (scontrol requeue 5)")
    assert exc.code == 0 and "the requeued job resumes from it on its own" in str(exc)
    assert Preempted(signal.SIGUSR1, "x/last.ckpt").code == 128 + signal.SIGUSR1
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.warns(UserWarning, match="`scontrol` is not on PATH"):
        assert requeue_slurm_job("5") is None
    failing = tmp_path / "scontrol"
    failing.write_text("#!/bin/sh\necho 'Invalid job id specified' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.warns(UserWarning, match=r"`scontrol requeue 5` failed \(Invalid job id specified\)"):
        assert requeue_slurm_job("5") is None


def flip_a_byte_of_the_first_tensor(path: Path) -> None:
    """Bit rot inside a tensor's bytes: torch.load still reads the file; only its CRC32 tells."""
    with zipfile.ZipFile(path) as zf:
        record = next(i for i in zf.infolist() if "/data/" in i.filename)
    with open(path, "r+b") as f:
        f.seek(record.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(record.header_offset + 30 + name_len + extra_len)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_auto_skips_a_newest_file_that_fails_its_checksum(tmp_path: Path, capfd) -> None:
    fit(tmp_path, 1)
    ck = tmp_path / "ember_logs" / "version_0" / "checkpoints"
    assert os.path.samefile(ck / "last.ckpt", ck / "epoch=0-step=4.ckpt")  # a hard link: both damaged at once
    flip_a_byte_of_the_first_tensor(ck / "last.ckpt")
    torch.load(ck / "last.ckpt", weights_only=True)  # no error: only the checksum finds it
    with zipfile.ZipFile(ck / "last.ckpt") as zf:
        record = zf.testzip()
    with pytest.warns(UserWarning) as caught:
        t = fit(tmp_path, 3, ckpt_path="auto")
    skipped = [str(w.message) for w in caught if str(w.message).startswith("Skipping")]
    assert sorted(skipped) == sorted(
        f"Skipping {ck / name} while looking for a checkpoint to resume from: it is corrupt: record "
        f"'{record}' fails its checksum. Trying the next most recent one."
        for name in ("last.ckpt", "epoch=0-step=4.ckpt")
    )
    assert t.ckpt_path == str(ck / "epoch=0-step=2.ckpt")
    assert f"resuming from {ck / 'epoch=0-step=2.ckpt'} (epoch 0, global step 2)" in capfd.readouterr().err
    ref = fit(tmp_path / "ref", 3)
    assert t.global_step == ref.global_step == 12
    for (k, a), b in zip(ref.module.state_dict().items(), t.module.state_dict().values()):
        assert torch.equal(a, b), k  # resumed exactly from step 2


def test_auto_finds_checkpoints_in_a_filename_folder(tmp_path: Path) -> None:
    callbacks = [ModelCheckpoint(filename="sub/{epoch}-{step}", every_n_train_steps=2, save_top_k=-1, save_last=False)]
    fit(tmp_path, 1, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the run continues in version_0: no "another directory" warning
        warnings.filterwarnings("ignore", message=".*log_every_n_steps|.*val_dataloader|.*num_workers")
        t = fit(tmp_path, 2, ckpt_path="auto", callbacks=callbacks)
    ck = tmp_path / "ember_logs" / "version_0" / "checkpoints"
    assert t.ckpt_path == str(ck / "sub" / "epoch=0-step=4.ckpt") and t.global_step == 8
    assert sorted(os.listdir(tmp_path / "ember_logs")) == ["version_0"]
    assert (ck / "sub" / "epoch=1-step=8.ckpt").exists()


def test_last_skips_a_dangling_link_for_the_good_last_beside_it(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    fit(tmp_path, 1, callbacks=[ModelCheckpoint(dirpath=str(ck), save_last="link")])
    fit(tmp_path, 1, callbacks=[ModelCheckpoint(dirpath=str(ck))])  # a second run: last-v1.ckpt
    (ck / os.readlink(ck / "last.ckpt")).unlink()  # the file the first run's link points to
    with pytest.warns(
        UserWarning,
        match=rf"ckpt_path='last' skips {re.escape(str(ck / 'last.ckpt'))}, a symbolic "
        r"link to 'epoch=0-step=4.ckpt', which does not exist \(the checkpoint it pointed to",
    ):
        t = fit(tmp_path, 2, ckpt_path="last", callbacks=[ModelCheckpoint(dirpath=str(ck))])
    assert t.ckpt_path == str(ck / "last-v1.ckpt") and t.global_step == 8
    os.remove(ck / "last-v1.ckpt")
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"ckpt_path='last': .*last.ckpt is a symbolic link to "
        r"'epoch=0-step=4.ckpt', which does not exist .* and there is no other last checkpoint",
    ):
        fit(tmp_path, 2, ckpt_path="last", callbacks=[ModelCheckpoint(dirpath=str(ck))])
