"""Each example in ``examples/`` run as a user runs it: ``python examples/<name>.py ...`` in a fresh
working directory, with small settings, checking its exit status and what it prints and writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("EMBER_DDP_PARENT_PID", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_example(cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Runs ``python <args>`` in ``cwd`` (killed after ``timeout`` seconds); output captured as text."""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _fail(proc: subprocess.CompletedProcess[str]) -> str:
    return f"status {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"


# ---------------------------------------------------------------- digits.py under torchrun
@pytest.mark.timeout(90)
def test_digits_runs_under_torchrun_with_two_processes(tmp_path):
    """``torchrun --nproc-per-node 2 examples/digits.py --strategy ddp --devices 2``: ember's ddp joins
    torchrun's world instead of starting its own ranks; both ranks finish and rank zero prints the result."""
    proc = run_example(
        tmp_path,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--tee",
        "3",
        str(EXAMPLES / "digits.py"),
        "--strategy",
        "ddp",
        "--devices",
        "2",
        "--max-epochs",
        "1",
        timeout=75,
    )
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
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "preemption.py"), "--print-every", "1", *small],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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


# ---------------------------------------------------------------- gan.py (manual optimization)
def test_gan_trains_with_two_optimizers_and_prints_losses(tmp_path):
    proc = run_example(tmp_path, str(EXAMPLES / "gan.py"), "--max-epochs", "2", "--limit-batches", "5")
    assert proc.returncode == 0, _fail(proc)
    lines = proc.stdout.splitlines()
    epochs = [line.split() for line in lines if line.startswith("epoch ")]
    assert [e[1] for e in epochs] == ["1/2", "2/2"], proc.stdout
    for e in epochs:
        assert e[2] == "d_loss" and e[4] == "g_loss"
        d_loss, g_loss = float(e[3]), float(e[5])
        assert 0 < d_loss < 10 and 0 < g_loss < 10, e
    assert epochs[0][3:] != epochs[1][3:]  # both networks train: the losses move
    # manual optimization: one global step per batch, however many optimizers stepped
    done = next(i for i, line in enumerate(lines) if line.startswith("trained "))
    assert lines[done].startswith("trained 10 steps"), proc.stdout
    digit = lines[done + 1 : done + 9]
    assert len(digit) == 8 and all(len(row) == 18 for row in digit), digit


# ---------------------------------------------------------------- custom_callback_logger.py
def test_custom_callback_stops_and_custom_logger_writes_json_lines(tmp_path):
    """``--target 0.5``: the callback stops the fit after the first epoch that reaches it; the logger's
    file holds the hyper-parameters, the logged metrics (the printed accuracy among them) and the end status."""
    proc = run_example(
        tmp_path,
        str(EXAMPLES / "custom_callback_logger.py"),
        "--max-epochs",
        "4",
        "--limit-batches",
        "6",
        "--target",
        "0.5",
    )
    assert proc.returncode == 0, _fail(proc)
    epoch_lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert epoch_lines and epoch_lines[-1].endswith("-> reached the target 0.5, stopping"), proc.stdout
    assert all("stopping" not in line for line in epoch_lines[:-1])
    assert len(epoch_lines) < 4  # stopped before max_epochs
    printed = [float(line.split("val/acc ")[1].split()[0]) for line in epoch_lines]

    path = tmp_path / "jsonl" / "version_0" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert f"{len(epoch_lines)} epochs; the JSON lines logger wrote {len(records)} records" in proc.stdout
    assert records[0] == {"hparams": {"lr": 0.003, "channels": 32}}
    assert records[-1] == {"status": "success"}
    logged_acc = [r["metrics"]["val/acc"] for r in records[1:-1] if "val/acc" in r["metrics"]]
    assert [round(a, 4) for a in logged_acc] == printed
    steps = [r["step"] for r in records[1:-1]]
    assert steps == sorted(steps) and steps[-1] == 6 * len(epoch_lines) - 1
    # the logger has a save_dir, so the checkpoints went beside its file
    assert "checkpoints in " + os.path.join("jsonl", "version_0", "checkpoints") in proc.stdout
    assert (tmp_path / "jsonl" / "version_0" / "checkpoints" / "last.ckpt").is_file()


# ---------------------------------------------------------------- finetune.py
@pytest.mark.timeout(150)
def test_finetune_trains_the_head_first_then_the_backbone(tmp_path):
    """``python examples/finetune.py``: BackboneFinetuning keeps the pretrained backbone frozen in epoch 0,
    adds it at epoch 1 with a tenth of the head's rate, doubles that rate each epoch; the default checkpoint
    and logger are written, and the finetuned model classifies the ten digits."""
    proc = run_example(
        tmp_path, str(EXAMPLES / "finetune.py"), "--max-epochs", "3", "--pretrain-epochs", "2", timeout=140
    )
    assert proc.returncode == 0, _fail(proc)
    assert "backbone frozen in epoch 0, trained from epoch 1 (lr 0.0003 -> 0.0006)" in proc.stdout
    acc = float(proc.stdout.split("validation accuracy ")[1].split()[0])
    assert acc > 0.7, proc.stdout
    assert (tmp_path / "ember_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()


# ---------------------------------------------------------------- metrics_finetune.py
@pytest.mark.timeout(200)
def test_metrics_finetune_logs_torchmetrics_while_the_backbone_joins(tmp_path):
    """``python examples/metrics_finetune.py``: the torchmetrics accuracy and F1 are computed per epoch (values
    in [0, 1] that differ between epochs), the backbone is frozen in epoch 0 and trains from epoch 1 with its
    learning rate doubling, and the finetuned model classifies the ten digits."""
    pytest.importorskip("torchmetrics")
    proc = run_example(
        tmp_path, str(EXAMPLES / "metrics_finetune.py"), "--max-epochs", "3", "--pretrain-epochs", "1", timeout=180
    )
    assert proc.returncode == 0, _fail(proc)
    epochs = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == ["epoch 0", "epoch 1", "epoch 2"], proc.stdout
    assert "backbone lr frozen" in epochs[0]
    assert "backbone lr 0.0003" in epochs[1] and "backbone lr 0.0006" in epochs[2]
    values = [dict(part.rsplit(" ", 1) for part in line.split(", ")[1:]) for line in epochs]
    assert [set(v) for v in values] == [{"train/acc", "val/acc", "val/f1"}] * 3
    accs = [float(v["val/acc"]) for v in values]
    assert all(0.0 <= float(x) <= 1.0 for v in values for x in v.values())
    assert len(set(accs)) == 3  # computed afresh each epoch (reset between epochs)
    final = proc.stdout.splitlines()[-1]
    assert final.startswith("validation accuracy") and float(final.split()[2]) > 0.5, proc.stdout
    assert float(final.split()[2]) == accs[-1]
