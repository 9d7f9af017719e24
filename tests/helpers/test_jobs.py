"""The job helper shows where a hung job stood: its output so far and every process's Python stack."""

from __future__ import annotations

import os
import sys
import time

import pytest

from tests.helpers.jobs import finish_job, job_processes, run_job, start_job

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]

HANG = """
import multiprocessing, sys, threading, time

def child_waits_here():
    time.sleep(600)

def side_thread_waits_here():
    time.sleep(600)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork")
    ctx.Process(target=child_waits_here).start()
    threading.Thread(target=side_thread_waits_here, daemon=True).start()
    print("started", flush=True)
    time.sleep(600)
"""


def test_a_hung_job_fails_with_its_output_and_every_process_stack(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    proc = start_job([sys.executable, str(script)])
    while not job_processes(proc.pid):  # the forked child exists
        time.sleep(0.05)
    with pytest.raises(pytest.fail.Exception) as failed:
        finish_job(proc, limit=1)
    message = str(failed.value)
    assert "did not end within 1 s" in message
    assert "started" in message  # what it printed before the hang
    assert "child_waits_here" in message  # the forked child's stack
    assert "side_thread_waits_here" in message  # the parent's other thread
    assert proc.poll() is not None
    assert not job_processes(proc.pid)


def test_a_job_that_ends_gives_its_status_and_output(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import sys\nprint('hello')\nsys.exit(3)\n")
    code, out = run_job([sys.executable, str(script)], limit=30)
    assert (code, out) == (3, "hello\n")
    assert "PYTHONFAULTHANDLER" not in os.environ  # only the job's environment has it
