"""Restarts that continue exactly: torchrun --max-restarts with a rank killed by SIGKILL, a shell
loop around a single-process script with ckpt_path="auto", and a SLURM requeue after SIGUSR1.

Each compares the final weights of the interrupted job with an uninterrupted run of the same
script (same checkpoint cadence, same data loader workers): they must be bitwise equal. The runs
are real processes in the default configuration (default logger, checkpointing on, a fresh
directory); elastic_script.py kills or signals itself at a chosen step of the first attempts.
"""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.processes

SCRIPT = Path(__file__).with_name("elastic_script.py")
_LAUNCH_VARS = (
    "TORCHELASTIC_",
    "SLURM_",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (the test may itself run under one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_VARS)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run(cmd: list[str], env: dict[str, str], timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    out.mkdir()
    return run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--monitor-interval",
            "0.1",
            str(SCRIPT),
            str(out),
            *args,
        ],
        clean_env(),
    )


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.pt", weights_only=True)


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], why: str) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{why}: final weights differ in {differ}"


def attempts(out: Path) -> int:
    return (out / "attempts").read_text().count("\n")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2])
def test_torchrun_restarts_after_kill9_continue_bitwise(tmp_path: Path, workers: int) -> None:
    # Rank 1 is killed with SIGKILL at a random step of the first attempt (and, with workers=0, again
    # in the second: restarts keep connecting, each with process-group keys of its own in the agent's
    # store); every restart resumes from the job's last checkpoint on its own.
    kills = [random.randint(2, 8)]  # of 18 steps (3 epochs of 6 per rank)
    if workers == 0:
        kills.append(random.randint(kills[0] + 2, 16))
    ref = torchrun(tmp_path / "ref", "--workers", str(workers))
    assert ref.returncode == 0, ref.stderr[-3000:]
    job = torchrun(tmp_path / "job", "--workers", str(workers), "--kill-at", ",".join(map(str, kills)))
    why = f"killed rank 1 at steps {kills} with {workers} loader workers"
    assert job.returncode == 0, f"{why}:\n{job.stderr[-4000:]}"
    assert attempts(tmp_path / "job") == len(kills) + 1, why
    for n in range(1, len(kills) + 1):
        assert (
            f"[ember] torchrun restart {n} (TORCHELASTIC_RESTART_COUNT={n}): resuming from " in job.stderr
            or f"torchrun restart {n} (TORCHELASTIC_RESTART_COUNT={n}): no checkpoint of this job yet" in job.stderr
        ), why
    assert_bitwise(final_weights(tmp_path / "ref"), final_weights(tmp_path / "job"), why)
    # The restarts wrote into the first attempt's run directory: one run, not one per attempt.
    assert sorted(p.name for p in (tmp_path / "job" / "ember_logs").iterdir()) == ["version_0"]


@pytest.mark.timeout(120)
def test_shell_loop_with_ckpt_path_auto_continues_bitwise(tmp_path: Path) -> None:
    kill = random.randint(2, 30)  # of 36 steps
    (tmp_path / "ref").mkdir()
    (tmp_path / "job").mkdir()
    env = clean_env()
    ref = run([sys.executable, str(SCRIPT), str(tmp_path / "ref"), "--auto"], env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "[ember]" not in ref.stderr  # a fresh start with "auto" says nothing
    loop = (
        f'for i in 1 2 3; do "{sys.executable}" "{SCRIPT}" "{tmp_path / "job"}" --auto '
        f"--kill-rank 0 --kill-at {kill} && exit 0; done; exit 1"
    )
    job = run(["bash", "-c", loop], env)
    assert job.returncode == 0, f"killed at step {kill}:\n{job.stderr[-3000:]}"
    assert attempts(tmp_path / "job") == 2
    assert "[ember] ckpt_path='auto': resuming from " in job.stderr or kill < 3  # cadence: every 3 steps
    assert_bitwise(final_weights(tmp_path / "ref"), final_weights(tmp_path / "job"), f"killed at step {kill}")


@pytest.mark.timeout(120)
def test_slurm_sigusr1_requeues_and_the_requeued_job_resumes_bitwise(tmp_path: Path) -> None:
    # `scontrol` here is a stand-in program on PATH that records its arguments (there is no SLURM on
    # this machine); ember itself runs unchanged.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path / "scontrol.log"}"\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = clean_env(SLURM_JOB_ID="4242", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    sig = random.randint(1, 30)  # of 36 steps
    for d in ("ref", "job"):
        (tmp_path / d).mkdir()
    ref = run([sys.executable, str(SCRIPT), str(tmp_path / "ref")], env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    first = run([sys.executable, str(SCRIPT), str(tmp_path / "job"), "--signal-at", str(sig)], env)
    assert first.returncode == 0, first.stderr[-3000:]  # requeued: this attempt's part is done
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert "requeued SLURM job 4242" in first.stderr
    assert not (tmp_path / "job" / "final.pt").exists()  # it stopped early
    requeued = run([sys.executable, str(SCRIPT), str(tmp_path / "job")], {**env, "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert "[ember] SLURM requeue 1 (SLURM_RESTART_COUNT=1): resuming from " in requeued.stderr
    assert f"global step {sig + 1})" in requeued.stderr  # the boundary after the signal
    assert_bitwise(final_weights(tmp_path / "ref"), final_weights(tmp_path / "job"), f"SIGUSR1 at step {sig}")
