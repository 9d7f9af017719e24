"""The ddp watchdog (ember/strategies/watchdog/: watchdog.py, and verdicts.py for what it reads and says).

Unit tests drive two ranks' watchdogs by hand over one in-process store (no threads, no clock):
who is named, when, and when not. The job tests run ``hang_script.py`` as a real 2-rank program
in a fresh directory (default logger and checkpoints): a rank that sleeps for good in
``training_step`` ends the job, named with its step and its stack, within seconds under a short
collective timeout and within the default deadline otherwise; a healthy job whose steps are slow
is not stopped; a collective that times out names the rank that did not arrive.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from ember.strategies import DDPStrategy
from ember.strategies.watchdog import watchdog as wd
from ember.strategies.watchdog.verdicts import AFTER_BACKWARD
from tests.helpers import session_jobs
from tests.helpers.dist import assert_processes_gone
from tests.helpers.jobs import finish_job, job_processes, start_job

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("hang_script.py"))
STACK_LINE = re.compile(r'File ".*hang_script\.py", line \d+ in training_step')
GRADIENTS = "the gradient all-reduce (backward)"


# ------------------------------------------------------------------------------ the deadline
def test_deadline_is_the_floor_or_twenty_slowest_steps_and_stays_under_the_collective_timeout():
    assert wd.deadline(60, 0.01, 1800) == 60  # fast steps: the floor
    assert wd.deadline(60, 9.0, 1800) == 180  # slow steps: 20 x the slowest
    assert wd.deadline(60, 200.0, 1800) == 1795  # never reaches the collective timeout...
    assert wd.deadline(60, 0.01, 10) == 5  # ...even a short one, so the watchdog speaks first
    assert wd.collective_cap(4) == 2


def test_watchdog_timeout_is_checked():
    assert DDPStrategy(watchdog_timeout=None).watchdog_timeout is None
    assert DDPStrategy(watchdog_timeout=False).watchdog_timeout is None
    assert DDPStrategy().watchdog_timeout == 60.0
    for bad in (0, -1, True, "60"):
        with pytest.raises(ValueError, match="watchdog_timeout.*None to turn the watchdog off"):
            DDPStrategy(watchdog_timeout=bad)


def test_timeouts_are_recognised_through_the_cause_chain():
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = RuntimeError("[unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation")
    assert wd.is_timeout(wrapped)
    assert wd.is_timeout(RuntimeError("Application timeout caused pair closure"))
    assert not wd.is_timeout(RuntimeError("Connection closed by peer"))


# ------------------------------------------------------------------------------ two ranks by hand
class Ranks:
    """Two watchdogs over one store, polled by hand at chosen times; verdicts are recorded, not acted on."""

    def __init__(self, floor: float | None = 5.0, timeout: float = 1800.0) -> None:
        store = dist.HashStore()
        self.beacons = [wd.Beacon(), wd.Beacon()]
        self.dogs = [
            wd.Watchdog(
                store,
                r,
                2,
                self.beacons[r],
                floor=floor,
                timeout=timeout,
                progress=lambda: {"stage": "fitting", "step": 3, "epoch": 0},
                run="test",
            )
            for r in range(2)
        ]
        self.verdicts: list[tuple[int, dict]] = []
        for r, dog in enumerate(self.dogs):
            dog._act = lambda verdict, r=r: self.verdicts.append((r, verdict))
        self.now = 0.0

    def run(self, seconds: float) -> None:
        """Polls both ranks every sample interval for ``seconds`` of pretend time."""
        for _ in range(round(seconds / wd.SAMPLE_S)):
            self.now += wd.SAMPLE_S
            for dog in self.dogs:
                dog.poll(self.now)

    def step(self, rank: int, batch: int, where: str = "training_step") -> None:
        b = self.beacons[rank]
        b.batches += 1
        b.batch = batch
        b.where = where

    def wait(self, rank: int, what: str = GRADIENTS) -> None:
        b = self.beacons[rank]
        b.waits += 1
        b.waiting = what


def test_the_rank_that_keeps_the_other_waiting_is_named_once_the_deadline_passes():
    ranks = Ranks(floor=5.0)
    for r in (0, 1):
        ranks.step(r, 3)
    ranks.wait(0)  # rank 0 is in the all-reduce; rank 1 stays in training_step
    ranks.run(4.8)
    assert ranks.verdicts == []
    ranks.run(1.2)
    # The waiting rank judged; the named rank read the verdict from the store in the same second.
    assert [r for r, _ in ranks.verdicts] == [0, 1]
    verdict = ranks.verdicts[0][1]
    assert ranks.verdicts[1][1] == verdict
    assert verdict["dump"] == [1] and verdict["exit"] == wd.HUNG_EXIT_CODE
    assert "rank 1 is stuck in training_step at step 3 (epoch 0, batch 3)" in verdict["summary"]
    assert f"Rank 0 waited 6 s for it in {GRADIENTS}" in verdict["summary"]  # judged once a second
    assert "watchdog_timeout=5 s" in verdict["detail"]


def test_waits_do_not_add_up_across_collectives():
    ranks = Ranks(floor=5.0)
    ranks.step(0, 3)
    for _ in range(6):  # rank 0 waits 3 s in each of six collectives: 18 s, never 5 in one
        ranks.wait(0)
        ranks.run(3.0)
        ranks.beacons[0].waiting = None
    assert ranks.dogs[0].slowest_step == 0  # (no batch began meanwhile: the floor is the deadline)
    assert ranks.verdicts == []


def test_slow_steps_raise_the_deadline():
    ranks = Ranks(floor=5.0)
    for batch in range(3):  # 2-second steps
        for r in (0, 1):
            ranks.step(r, batch)
        ranks.run(2.0)
    assert 2.0 <= ranks.dogs[0].slowest_step <= 2.0 + 2 * wd.SAMPLE_S
    assert ranks.dogs[0].deadline == pytest.approx(wd.STEP_FACTOR * ranks.dogs[0].slowest_step)
    ranks.wait(0)
    ranks.run(30.0)  # a 30 s wait: past the floor, inside 20 x 2 s
    assert ranks.verdicts == []


def test_waits_before_the_first_batch_are_left_to_the_collective_timeout():
    ranks = Ranks(floor=5.0)
    ranks.wait(0, "a barrier (prepare_data)")  # e.g. rank 0 downloads nothing, rank 1 downloads a dataset
    ranks.run(60.0)
    assert ranks.verdicts == []


def test_ranks_waiting_in_different_collectives_are_all_named():
    ranks = Ranks(floor=5.0)
    for r in (0, 1):
        ranks.step(r, 3)
    ranks.wait(0)
    ranks.wait(1, "an all-reduce (strategy.reduce, op='mean')")
    ranks.run(6.0)
    verdict = ranks.verdicts[0][1]
    assert verdict["dump"] == [0, 1]
    assert "different collectives" in verdict["summary"]


def test_ranks_waiting_in_the_same_collective_are_left_to_the_collective_timeout():
    ranks = Ranks(floor=5.0)
    for r in (0, 1):
        ranks.step(r, 3)
        ranks.wait(r)
    ranks.run(60.0)
    assert ranks.verdicts == []


def test_without_a_blocking_collective_the_rank_behind_is_named():
    # NCCL: rank 0's all-reduce waits on the GPU stream while its CPU goes on, to block later
    # outside any collective ember marks. Rank 1 is stuck in training_step at the same batch.
    ranks = Ranks(floor=5.0)
    for r in (0, 1):
        ranks.step(r, 3)
    ranks.beacons[0].where = AFTER_BACKWARD
    ranks.run(6.0)
    verdict = ranks.verdicts[0][1]
    assert ranks.verdicts[0][0] == 0 and verdict["dump"] == [1]
    assert "rank 1 is stuck in training_step at step 3 (epoch 0, batch 3)" in verdict["summary"]
    assert "Rank 0 is ahead, at step 3 (epoch 0, batch 3), and has made no progress for 6 s" in verdict["summary"]


@pytest.mark.parametrize("rank1", ["level", "waiting", "evaluating"])
def test_a_stalled_rank_names_nobody_who_is_not_behind_it(rank1):
    ranks = Ranks(floor=5.0)
    for r in (0, 1):
        ranks.step(r, 3)
    ranks.beacons[0].where = AFTER_BACKWARD
    if rank1 == "level":  # both stuck at the same place: nobody waits for anybody
        ranks.beacons[1].where = AFTER_BACKWARD
    elif rank1 == "waiting":  # waiting for rank 0: it is the one to judge
        ranks.wait(1)
    else:  # evaluation shards differ in length between ranks: positions there do not compare
        ranks.beacons[0].loop = ranks.beacons[1].loop = "validation"
    ranks.run(60.0)
    if rank1 == "waiting":  # (acted on here, a verdict would have ended both processes)
        assert ranks.verdicts and all(v["by"] == 1 and v["dump"] == [0] for _, v in ranks.verdicts)
    else:
        assert ranks.verdicts == []


def test_no_verdicts_when_turned_off_but_a_timeout_still_names_the_missing_rank():
    ranks = Ranks(floor=None, timeout=8.0)
    for r in (0, 1):
        ranks.step(r, 3)
    ranks.wait(0)
    ranks.run(8.0)
    assert ranks.verdicts == [] and ranks.dogs[0].deadline is None
    asked = []
    ranks.dogs[0]._await = lambda counter, expected: asked.append((counter, expected))
    message = ranks.dogs[0].explain_timeout(GRADIENTS)
    assert message.startswith("rank 1 is stuck in training_step at step 3 (epoch 0, batch 3)")
    assert f"did not arrive at {GRADIENTS}, where rank 0 waited for it until the collective timeout (8 s)" in message
    assert "rank 0 is" not in message  # the rank that waited is never the one blamed
    assert asked == [("request/1/answered", 1)]  # rank 1 was asked for its stack


def test_a_named_rank_prints_its_stack_when_asked(capfd):
    ranks = Ranks(floor=None)
    ranks.step(1, 3)
    ranks.run(1.0)
    ranks.dogs[0]._await = lambda counter, expected: None
    ranks.dogs[0].explain_timeout(GRADIENTS)
    ranks.dogs[1]._check_news()
    err = capfd.readouterr().err
    assert "[ember ddp] rank 1: rank 1 is stuck in training_step" in err
    assert "test_a_named_rank_prints_its_stack_when_asked" in err  # this (main) thread's stack
    assert ranks.dogs[1]._count("request/1/answered") == 1


def test_acting_on_a_verdict_prints_the_stack_and_exits(capfd, monkeypatch):
    exits = []

    def fake_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(wd.os, "_exit", fake_exit)
    ended_children: list[bool] = []  # in this process, the real one would end the suite's own jobs
    monkeypatch.setattr(wd, "end_children", lambda: ended_children.append(True))
    monkeypatch.setattr(wd, "ANSWER_S", 0.5)
    ranks = Ranks()
    dog = ranks.dogs[1]
    verdict = {"summary": "stopping the job: rank 1 is stuck", "dump": [1], "exit": 1, "by": 0}
    with pytest.raises(SystemExit):
        wd.Watchdog._act(dog, verdict)
    assert exits == [1] and ended_children == [True]  # the rank's loader workers end with it
    err = capfd.readouterr().err
    assert "[ember ddp] rank 1: stopping the job: rank 1 is stuck" in err
    assert "Python stack (pid" in err and "in test_acting_on_a_verdict_prints_the_stack_and_exits" in err


# ------------------------------------------------------------------------------ real jobs
def start(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return start_job([sys.executable, SCRIPT, "--out", str(out), *args], cwd=out, env=env)


def finish(proc: subprocess.Popen, limit: float) -> tuple[int, str]:
    return finish_job(proc, limit)


def hang_began(out: Path, rank: int, proc: subprocess.Popen) -> float:
    """The time the hang began (its marker file appeared)."""
    marker = out / f"hanging{rank}"
    while not marker.exists():
        assert proc.poll() is None, f"the job ended before the hang: {proc.communicate()[0]}"
        time.sleep(0.05)
    return time.monotonic()


def assert_names_rank_1_with_its_stack(log: str) -> None:
    assert (
        "[ember ddp] rank 0: stopping the job: rank 1 is stuck in training_step at step 3 (epoch 0, batch 3)" in log
    ), log
    assert "[ember ddp] rank 1: Python stack" in log, log
    assert STACK_LINE.search(log), log
    assert "Traceback" not in log, log  # no rank reports the stop as an error of its own


@pytest.mark.timeout(60)
def test_a_hung_rank_ends_the_job_within_seconds_under_a_short_collective_timeout(tmp_path):
    began = time.monotonic()
    proc = start(tmp_path, "--hang-rank", "1", "--timeout", "10")
    hung = hang_began(tmp_path, 1, proc)
    code, log = finish(proc, limit=30)
    ended = time.monotonic()
    assert code == wd.HUNG_EXIT_CODE, log
    assert_names_rank_1_with_its_stack(log)
    assert "The watchdog deadline was 5 s" in log, log  # half the 10 s collective timeout
    assert ended - began < 30, f"{ended - began:.1f} s"
    print(f"hang to end: {ended - hung:.1f} s; whole job {ended - began:.1f} s")
    assert_processes_gone(tmp_path, count=2)


@pytest.mark.timeout(60)
def test_a_rank_stuck_waiting_for_its_loader_worker_ends_with_the_job_and_so_does_the_worker(tmp_path):
    # Rank 1's loader worker never returns its batch (a stuck read, or a deadlock inherited through fork):
    # rank 1 waits in next(loader), rank 0 in the gradient all-reduce. The verdict ends both ranks, and
    # the stuck worker with them: left alone it would outlive the job for good, holding the job's output
    # open, so that whatever reads it (a shell pipeline, this test) never sees it end.
    proc = start(tmp_path, "--hang-rank", "1", "--hang-in-loader", "--timeout", "10")
    hang_began(tmp_path, 1, proc)
    code, log = finish(proc, limit=40)  # finish_job: the output ends only when every holder has ended
    assert code == wd.HUNG_EXIT_CODE, log
    assert "rank 1 is stuck in the training loop" in log, log
    deadline = time.monotonic() + 3.0  # killed ones may still be on their way out
    while job_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not job_processes(proc.pid), f"processes of the job outlived it: {job_processes(proc.pid)}"
    assert_processes_gone(tmp_path, count=2)


@pytest.mark.timeout(60)
def test_under_ddp_spawn_the_callers_error_is_the_watchdogs_verdict(tmp_path):
    proc = start(tmp_path, "--hang-rank", "1", "--timeout", "10", "--start-method", "spawn")
    hang_began(tmp_path, 1, proc)
    code, log = finish(proc, limit=40)
    assert code == 1, log
    assert "[ember ddp] rank 1: Python stack" in log and STACK_LINE.search(log), log
    # The caller raises once (its own traceback), with the watchdog's verdict as the message.
    assert log.count("Traceback") == 1, log
    last = log.strip().splitlines()[-1]
    assert last.startswith(
        "RuntimeError: [ember ddp] rank 0 (watchdog): stopping the job: rank 1 is stuck in "
        "training_step at step 3 (epoch 0, batch 3)"
    ), log
    assert last.endswith("(backward); the job was stopped."), last
    assert_processes_gone(tmp_path, count=2)


@pytest.mark.timeout(60)
def test_a_collective_timeout_names_the_rank_that_did_not_arrive(tmp_path):
    proc = start(tmp_path, "--hang-rank", "1", "--timeout", "5", "--watchdog", "none")
    code, log = finish(proc, limit=40)
    assert code == 1, log
    assert (
        "CollectiveTimeout: rank 1 is stuck in training_step at step 3 (epoch 0, batch 3)" in log
        and f"It did not arrive at {GRADIENTS}, where rank 0 waited for it until the collective timeout (5 s)." in log
    ), log
    assert STACK_LINE.search(log), log  # rank 1 printed its stack when asked
    assert "Timed out waiting" not in log.split("CollectiveTimeout")[-1]  # gloo's words are only the cause
    assert_processes_gone(tmp_path, count=2)


@pytest.mark.timeout(60)
def test_a_healthy_job_with_slow_steps_is_not_stopped(tmp_path):
    # Rank 1's steps take 1 s, then one takes 4 s: rank 0 waits that long in the all-reduce, past
    # the 2 s floor, but within 20 x the slowest step seen.
    proc = start(tmp_path, "--slow-rank", "1", "--slow", "1,1,1,4,0.5", "--steps", "6", "--watchdog", "2")
    code, log = finish(proc, limit=45)
    assert code == 0, log
    assert "[ember ddp]" not in log, log
    for rank in (0, 1):
        done = json.loads((tmp_path / f"done{rank}").read_text())
        assert done["slowest_step"] >= 1.0 and done["deadline"] >= 20.0, done
    # Rank 0 did wait well past the 2 s floor. Not the whole 4 s: the watchdog's thread samples every
    # 0.2 s (later on a loaded machine), and rank 0 starts the step after its own rank-zero work (the
    # logger's writes), while rank 1 already sleeps; 3.81 s was seen on a loaded machine.
    assert json.loads((tmp_path / "done0").read_text())["slowest_step"] > 3.0


@pytest.mark.timeout(150)
def test_a_hung_rank_ends_the_job_about_a_minute_later_by_default():
    # The session started this job (hang_script.py --hang-rank 1) when it collected this test, so that its
    # minute of waiting passes while the workers run other tests (tests/helpers/session_jobs.py).
    job = session_jobs.outcome("default_deadline", limit=120)
    log = job.log
    assert job.code == wd.HUNG_EXIT_CODE, log
    hung = (job.out / "hanging1").stat().st_mtime  # when rank 1 began to hang
    assert_names_rank_1_with_its_stack(log)
    assert "The watchdog deadline was 60 s" in log, log
    assert job.ended - hung >= 59, f"stopped {job.ended - hung:.1f} s after the hang, before the 60 s deadline"
    assert job.ended - job.began < 120, f"{job.ended - job.began:.1f} s"
    print(f"hang to end: {job.ended - hung:.1f} s; whole job {job.ended - job.began:.1f} s")
    assert_processes_gone(job.out, count=2)
