"""Exit statuses of a ddp job, as a scheduler reads them from the process that started it.

Every job is ``exit_script.py`` (default Trainer: logger and checkpointing on) run as a real
program in a fresh directory, with ``strategy="ddp"`` (the script re-runs itself for rank 1) or
``"ddp_spawn"``. A rank that ends without a traceback is named and the job exits 1; a stop signal
(SIGTERM, to the launching process alone, to one rank, or to the whole process group) makes every
rank stop at a step boundary, writes ``last.ckpt`` and exits 143; Ctrl-C ends the launching process
by SIGINT (a shell's 130), saying so in one line, with no rank's traceback. Each job runs in its own
session, killed as a group whatever happens.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from ember.strategies.launchers.interrupt import INTERRUPTED
from tests.helpers.dist import assert_processes_gone
from tests.helpers.jobs import finish_job, start_job

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("exit_script.py"))
pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]


class Job:
    """``exit_script.py`` running in ``workdir`` as its own process group."""

    def __init__(self, workdir: Path, *args: str) -> None:
        self.workdir = workdir
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = start_job([sys.executable, SCRIPT, "--out", str(workdir), *args], cwd=workdir, env=env)

    def wait_until_training(self, limit: float = 45, ranks: tuple[int, ...] = (0, 1)) -> None:
        """Returns once the ranks (both, by default) have taken a few steps."""
        deadline = time.monotonic() + limit
        while not all((self.workdir / f"training{r}").exists() for r in ranks):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code, log = self.finish()
                pytest.fail(f"the job never got to training (status {code}):\n{log}")
            time.sleep(0.05)

    def rank_pid(self, rank: int) -> int:
        return int((self.workdir / f"pid{rank}").read_text())

    def finish(self, limit: float = 45) -> tuple[int, str]:
        return finish_job(self.proc, limit)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def job(tmp_path):
    jobs: list[Job] = []

    def start(*args: str) -> Job:
        jobs.append(Job(tmp_path, *args))
        return jobs[-1]

    yield start
    for j in jobs:  # whatever happened, nothing of the job survives the test
        j.kill()
        j.proc.wait()


def assert_preempted(workdir: Path, code: int, log: str, strategy: str) -> None:
    assert code == 143, log
    assert log.count("Preempted by SIGTERM: saved ") == 1, log
    assert "Traceback" not in log and "[ember ddp]" not in log, log  # a stop, not a failure
    last = workdir / "ember_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert last.is_file(), sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*"))
    assert torch.load(last, weights_only=False)["global_step"] >= 5
    assert_processes_gone(workdir, within=3.0)
    if strategy == "ddp":  # ddp_spawn's caller stops its workers once they have sent their results
        assert_no_group_threads_at_shutdown(workdir)


def assert_no_group_threads_at_shutdown(workdir: Path) -> None:
    """Each rank freed its process group, joining the group's gloo threads, before the interpreter shut
    down: a gloo thread still running then aborts the process if it releases a collective's tensors."""
    for r in (0, 1):
        pid = (workdir / f"pid{r}").read_text()
        left = (workdir / f"threads-{pid}").read_text().split()
        assert not [name for name in left if "gloo" in name], (r, left)


def inherited(workdir: Path) -> str:
    """What each process of the job inherited (SIGINT's disposition, blocked signals), for a failure message."""
    return "; ".join(f"{p.name}: {p.read_text()}" for p in sorted(workdir.glob("inherited-*")))


# ------------------------------------------------------------------------------ no traceback
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
@pytest.mark.parametrize(
    "end, said", [("exit3", "rank 1 exited with status 3"), ("segv", "rank 1 was killed by signal 11 (SIGSEGV)")]
)
def test_a_rank_that_ends_without_a_traceback_is_named_and_the_job_exits_1(job, tmp_path, strategy, end, said):
    code, log = job("--strategy", strategy, "--end", end, "--end-rank", "1").finish()
    assert code == 1, log
    assert log.count(said) == 1, log
    assert f"{said}; " in log, log  # then what happens: "stopping the job" / "the job was stopped"
    assert_processes_gone(tmp_path, within=3.0)


# ------------------------------------------------------------------------------ SIGTERM
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_sigterm_to_the_launching_process_saves_last_ckpt_and_exits_143(job, tmp_path, strategy):
    j = job("--strategy", strategy)
    j.wait_until_training()
    os.kill(j.proc.pid, signal.SIGTERM)  # the script's process: rank 0, or ddp_spawn's caller
    code, log = j.finish()
    assert_preempted(tmp_path, code, log, strategy)


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_sigterm_to_the_whole_process_group_saves_last_ckpt_and_exits_143(job, tmp_path, strategy):
    j = job("--strategy", strategy)
    j.wait_until_training()
    os.killpg(j.proc.pid, signal.SIGTERM)  # what a scheduler does
    code, log = j.finish()
    assert_preempted(tmp_path, code, log, strategy)


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_sigterm_to_rank_1_alone_stops_every_rank_and_exits_143(job, tmp_path, strategy):
    code, log = job("--strategy", strategy, "--end", "term", "--end-rank", "1").finish()
    assert_preempted(tmp_path, code, log, strategy)


def test_a_rank_that_dies_while_the_job_stops_is_named_and_the_job_exits_1(job, tmp_path):
    # Rank 1 stops with the others at the step boundary (last.ckpt is written), then aborts on its way out.
    code, log = job("--strategy", "ddp", "--end", "term-abort", "--end-rank", "1").finish()
    assert code == 1, log
    said = "[ember ddp] rank 1 was killed by signal 6 (SIGABRT) while the job was stopping; exiting with status 1."
    assert log.count(said) == 1, log
    assert log.count("Preempted by SIGTERM: saved ") == 1, log
    assert_processes_gone(tmp_path, within=3.0)


# ------------------------------------------------------------------------------ Ctrl-C
@pytest.mark.parametrize(
    ("strategy", "to"),
    [("ddp", "group"), ("ddp", "launcher"), ("ddp_spawn", "group"), ("ddp_spawn", "launcher"), ("dp", "group"),
     ("auto", "group")],
)  # fmt: skip
def test_ctrl_c_ends_the_launching_process_by_sigint(job, tmp_path, strategy, to):
    j = job("--strategy", strategy)
    j.wait_until_training(ranks=(0,) if strategy in ("dp", "auto") else (0, 1))  # dp, auto: one process
    if to == "group":
        os.killpg(j.proc.pid, signal.SIGINT)  # Ctrl-C in a terminal
    else:
        os.kill(j.proc.pid, signal.SIGINT)
    code, log = j.finish()
    # As Python ends any script on Ctrl-C: killed by SIGINT, which a shell reports as 130.
    assert code == -signal.SIGINT, f"{log}\n{inherited(tmp_path)}"
    assert "KeyboardInterrupt" in log, log
    assert "failed" not in log and "was killed by" not in log, log  # not reported as a failure
    # One line for the job, as Lightning's; no rank's traceback, nor the collective errors that follow a peer's exit.
    assert log.count(INTERRUPTED) == 1, log
    assert "Traceback" not in log and "[rank" not in log and "Connection" not in log, log
    # The callbacks' on_exception ran with the KeyboardInterrupt: on the launching process (rank 0), and on
    # both ddp_spawn workers (a rank ddp re-ran may still be waiting in a collective when it is stopped).
    for rank in (0, 1) if strategy == "ddp_spawn" else (0,):
        assert (tmp_path / f"exception{rank}").read_text() == "KeyboardInterrupt", (rank, log)
    assert_processes_gone(tmp_path, within=3.0)
