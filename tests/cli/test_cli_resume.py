"""An EmberCLI fit stopped by SIGTERM (exit 143, ``last.ckpt`` written) continues with the same command
and ``--ckpt_path last``, or on its own as a restarted SLURM job: in the same run directory, from the
checkpoint, keeping the run's saved config when it is the same and saving a changed one beside it
(``ember/cli/save_config.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ember
from tests.helpers.models import TrainOnlyModel, regression_loader

pytest.importorskip("jsonargparse")
yaml = pytest.importorskip("yaml")

from ember.cli import EmberCLI  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "resume_script.py"
ROOT = Path(__file__).resolve().parent.parent.parent


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    full_env.update(env, PYTHONUNBUFFERED="1")
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), full_env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=full_env, capture_output=True, text=True, timeout=150
    )


def _fail(proc: subprocess.CompletedProcess[str]) -> str:
    return f"status {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-4000:]}"


def run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("version_*") if p.is_dir())


def stopped_run(root: Path, args: list[str], **env: str) -> tuple[Path, int]:
    """The first attempt, stopped by SIGTERM after the 5th step: its run directory and checkpoint step."""
    proc = run(*args, STOP_AT_STEP="5", **env)
    assert proc.returncode == 143, _fail(proc)
    (run_dir,) = run_dirs(root)
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] >= 5
    assert (run_dir / "config.yaml").is_file()
    return run_dir, ckpt["global_step"]


def starts(root: Path) -> list[str]:
    return (root / "starts.txt").read_text().split("\n")[:-1]


@pytest.mark.processes
@pytest.mark.timeout(500)
def test_a_stopped_fit_continues_in_its_run_with_ckpt_path_last(tmp_path):
    args = [
        "fit",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_epochs=2",
        "--trainer.enable_progress_bar=false",
    ]
    run_dir, step = stopped_run(tmp_path, args)
    saved = (run_dir / "config.yaml").read_text()

    # The same command, resuming: the same run directory, the run's config kept, training from the checkpoint.
    proc = run(*args, "--ckpt_path=last")
    assert proc.returncode == 0, _fail(proc)
    assert f"Restored all states from the checkpoint at {run_dir / 'checkpoints' / 'last.ckpt'}" in proc.stderr
    assert run_dirs(tmp_path) == [run_dir]
    assert (run_dir / "config.yaml").read_text() == saved
    assert sorted(p.name for p in run_dir.glob("config*")) == ["config.yaml"]
    assert starts(tmp_path) == ["start 0", f"start {step}", "end 16"]  # 2 epochs of 8 batches

    # A changed config (train on for another epoch): saved beside the run's, which stays as it was.
    proc = run(*args, "--trainer.max_epochs=3", "--ckpt_path=last")
    assert proc.returncode == 0, _fail(proc)
    assert run_dirs(tmp_path) == [run_dir]
    assert (run_dir / "config.yaml").read_text() == saved
    changed = yaml.safe_load((run_dir / "config-1.yaml").read_text())
    assert changed["trainer"]["max_epochs"] == 3 and changed["ckpt_path"] == "last"
    assert starts(tmp_path)[-2:] == ["start 16", "end 24"]


@pytest.mark.processes
@pytest.mark.timeout(500)
def test_a_restarted_slurm_job_continues_its_run_without_being_told(tmp_path):
    args = [
        "fit",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_epochs=1",
        "--trainer.enable_progress_bar=false",
    ]
    run_dir, step = stopped_run(tmp_path, args, SLURM_JOB_ID="4242")
    saved = (run_dir / "config.yaml").read_text()
    proc = run(*args, SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1")  # SLURM requeued the job: the same command
    assert proc.returncode == 0, _fail(proc)
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'}" in proc.stderr
    assert run_dirs(tmp_path) == [run_dir]
    assert sorted(p.name for p in run_dir.glob("config*")) == ["config.yaml"]
    assert (run_dir / "config.yaml").read_text() == saved
    assert starts(tmp_path) == ["start 0", f"start {step}", "end 8"]


class Data(ember.DataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return regression_loader(batch_size=self.batch_size)


def test_each_changed_resume_gets_the_next_file_and_an_unchanged_one_none(tmp_path):
    args = [
        "fit",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--seed_everything=3",
    ]
    EmberCLI(TrainOnlyModel, Data, args=[*args, "--trainer.max_epochs=1"])
    first = (tmp_path / "config.yaml").read_text()
    for epochs, expected in (
        (1, []),
        (2, ["config-1.yaml"]),
        (2, ["config-1.yaml"]),
        (3, ["config-1.yaml", "config-2.yaml"]),
    ):
        cli = EmberCLI(TrainOnlyModel, Data, args=[*args, f"--trainer.max_epochs={epochs}", "--ckpt_path=last"])
        assert cli.trainer.current_epoch == epochs  # (it resumed: each fit trains on from the last)
        assert sorted(p.name for p in tmp_path.glob("config-*.yaml")) == expected
        assert (tmp_path / "config.yaml").read_text() == first
    assert yaml.safe_load((tmp_path / "config-2.yaml").read_text())["trainer"]["max_epochs"] == 3
    # A seed the user chose is part of the run's config: another one is a change too.
    EmberCLI(TrainOnlyModel, Data, args=[*args, "--trainer.max_epochs=3", "--ckpt_path=last", "--seed_everything=4"])
    assert (tmp_path / "config-3.yaml").is_file()
    # A run that does not resume still never writes into another run's folder.
    with pytest.raises(RuntimeError, match="already exists.*does not overwrite.*--ckpt_path last"):
        EmberCLI(TrainOnlyModel, Data, args=[*args, "--trainer.max_epochs=1"])
