"""Each example in ``examples/`` run as a user runs it: ``python examples/<name>.py ...`` in a fresh
working directory, with small settings, checking its exit status and what it prints and writes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("EMBER_DDP_PARENT_PID", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_example(cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Runs ``python <args>`` in ``cwd`` (killed after ``timeout`` seconds); output captured as text."""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _fail(proc: subprocess.CompletedProcess[str]) -> str:
    return f"status {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"


# ---------------------------------------------------------------- digits.py under torchrun
@pytest.mark.timeout(90)
def test_digits_runs_under_torchrun_with_two_processes(tmp_path):
    """``torchrun --nproc-per-node 2 examples/digits.py --strategy ddp --devices 2``: ember's ddp joins
    torchrun's world instead of starting its own ranks; both ranks finish and rank zero prints the result."""
    proc = run_example(tmp_path, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--tee", "3",
                       str(EXAMPLES / "digits.py"), "--strategy", "ddp", "--devices", "2", "--max-epochs", "1",
                       timeout=75)
    assert proc.returncode == 0, _fail(proc)  # torchrun exits 0 only when every worker did
    out = proc.stdout
    # --tee 3 prefixes each worker's lines with its rank: rank zero printed the result, once.
    result_lines = [line for line in out.splitlines() if "validation accuracy" in line]
    assert len(result_lines) == 1 and result_lines[0].startswith("[default0]"), out
    assert float(result_lines[0].split("validation accuracy ")[1].split()[0]) > 0.5
    assert not any(line.startswith("[default1]") and "validation accuracy" in line for line in out.splitlines())
    assert sorted(p.name for p in (tmp_path / "ember_logs").iterdir()) == ["version_0"]


# ---------------------------------------------------------------- preemption.py
def _last_ckpt(tmp_path: Path) -> Path:
    found = sorted(tmp_path.glob("ember_logs/version_*/checkpoints/last.ckpt"))
    assert len(found) == 1, found
    return found[0]


@pytest.mark.timeout(60)
def test_preemption_stops_with_143_and_resume_finishes(tmp_path):
    """The script SIGTERMs itself after step 7: status 143 and last.ckpt at step 7; ``--resume``
    continues from step 7 and ends at 2 epochs x 10 batches = step 20."""
    small = ("--max-epochs", "2", "--limit-batches", "10")
    first = run_example(tmp_path, str(EXAMPLES / "preemption.py"), "--stop-after-step", "7", *small)
    assert first.returncode == 143, _fail(first)
    assert "sending SIGTERM to myself after step 7" in first.stdout
    assert "preempted at step 7: saved " in first.stdout, _fail(first)
    saved = _last_ckpt(tmp_path)
    assert str(saved) in first.stdout
    assert "finished" not in first.stdout

    import torch
    assert torch.load(saved, map_location="cpu", weights_only=False)["global_step"] == 7

    second = run_example(tmp_path, str(EXAMPLES / "preemption.py"), "--resume", *small)
    assert second.returncode == 0, _fail(second)
    assert "resumed from step 7 (epoch 0)" in second.stdout, _fail(second)
    assert "training from scratch" not in second.stdout
    assert "finished at step 20 (2 epochs), validation accuracy" in second.stdout, _fail(second)


@pytest.mark.timeout(60)
def test_preemption_by_an_outside_sigterm(tmp_path):
    """As a scheduler does it: SIGTERM from outside once the run prints "step 3"; the run stops at a
    step boundary with 143, and the resumed run continues from the step it saved."""
    small = ("--max-epochs", "3", "--limit-batches", "10")
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "preemption.py"), "--print-every", "1", *small],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if line.strip() == "step 3":
                proc.send_signal(signal.SIGTERM)
                break
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    out = "".join(seen) + rest
    assert proc.returncode == 143, f"{out}\n{err[-4000:]}"
    stopped = int(out.split("preempted at step ")[1].split(":")[0])
    assert 3 <= stopped < 30, out

    second = run_example(tmp_path, str(EXAMPLES / "preemption.py"), "--resume", *small)
    assert second.returncode == 0, _fail(second)
    assert f"resumed from step {stopped} " in second.stdout, _fail(second)
    assert "finished at step 30 (3 epochs)" in second.stdout, _fail(second)
