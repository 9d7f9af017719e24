"""Every way a ddp job starts (script re-run, torchrun on one and on two "nodes", ddp_spawn) and
how it stops when a rank raises or is killed: within 10 s, non-zero, the rank named once, and no
process left behind. Jobs run ``ddp_script.py`` as real programs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ember.strategies.launchers import launcher
from tests.helpers.dist import assert_processes_gone
from tests.helpers.jobs import finish_job, start_job
from tests.strategies import ddp_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("ddp_script.py"))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return start_job(command, cwd=ROOT, env=env)


def finish(proc: subprocess.Popen, limit: float = 60) -> tuple[int, str]:
    return finish_job(proc, limit)


def reference(batch: int) -> torch.nn.Module:
    module, _ = ddp_script.train("single", 1, batch)
    return module


def assert_trained_like_single(out: Path, ranks: int) -> None:
    results = [torch.load(out / f"rank{r}.pt") for r in range(ranks)]
    expected = reference(ddp_script.B * ranks).state_dict()
    for r in results:
        assert r["world_size"] == ranks
        for key, value in expected.items():
            torch.testing.assert_close(r["weights"][key], value, atol=1e-5, rtol=0)
        epoch = {k: v for k, v in r["metrics"].items() if not k.endswith("_step")}
        assert epoch == {k: v for k, v in results[0]["metrics"].items() if not k.endswith("_step")}


# ------------------------------------------------------------------------------ launch paths
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_plain_script_reruns_itself_for_the_other_ranks(tmp_path, strategy):
    code, log = finish(
        start([sys.executable, SCRIPT, "--strategy", strategy, "--devices", "2", "--out", str(tmp_path)])
    )
    assert code == 0, log
    assert_trained_like_single(tmp_path, 2)
    assert_processes_gone(tmp_path)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_nproc_per_node(tmp_path, strategy):
    code, log = finish(
        start(
            [
                *TORCHRUN,
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(free_port()),
                SCRIPT,
                "--strategy",
                strategy,
                "--devices",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
    )
    assert code == 0, log
    assert_trained_like_single(tmp_path, 2)


def test_torchrun_two_nodes_on_loopback(tmp_path):
    port = str(free_port())
    nodes = [
        start(
            [
                *TORCHRUN,
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                SCRIPT,
                "--devices",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        for node in (0, 1)
    ]
    for node in nodes:
        code, log = finish(node)
        assert code == 0, log
    assert_trained_like_single(tmp_path, 2)


def test_ddp_spawn_hands_back_weights_and_metrics(tmp_path):
    module, trainer = ddp_script.train("ddp_spawn", 2, ddp_script.B)
    alone, single = ddp_script.train("single", 1, 2 * ddp_script.B)
    for key, value in alone.state_dict().items():
        torch.testing.assert_close(module.state_dict()[key], value, atol=1e-5, rtol=0)
    assert trainer.global_step == single.global_step > 0
    for key in ("train_loss_epoch", "val_loss"):
        assert float(trainer.callback_metrics[key]) == pytest.approx(float(single.callback_metrics[key]), rel=1e-5)


# ------------------------------------------------------------------------------ failures
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
@pytest.mark.parametrize("fail", ["raise", "kill"])
def test_a_failing_rank_stops_the_whole_job_quickly_and_is_reported_once(tmp_path, strategy, fail):
    code, log = finish(
        start(
            [
                sys.executable,
                SCRIPT,
                "--strategy",
                strategy,
                "--devices",
                "2",
                "--fail",
                fail,
                "--fail-rank",
                "1",
                "--out",
                str(tmp_path),
            ]
        ),
        limit=30,
    )
    ended = time.time()
    assert code != 0, log
    # Quickly: seconds after the failure, not a collective timeout later (starting the two Pythons before
    # it, slower on a loaded machine, is not counted).
    after_failure = ended - float((tmp_path / "failed_at").read_text())
    print(f"the job ended {after_failure:.1f} s after rank 1 failed")
    assert after_failure < 8, f"the job ended {after_failure:.1f} s after rank 1 failed\n{log}"
    if fail == "raise":
        assert log.count("ValueError: boom: a deliberate failure at step 3") == 1, log
        assert log.count("raised on rank 1 of 2") == 1, log
        # One report: the error (for spawn with the worker's frames as its cause), nothing else.
        assert log.count("Traceback (most recent call last)") <= 2, log
    else:
        assert log.count("rank 1 was killed by signal 9 (SIGKILL)") == 1, log
    assert not list(tmp_path.glob("rank*.pt"))
    assert_processes_gone(tmp_path)


# ------------------------------------------------------------------------------ environments
def test_detects_torchrun_slurm_and_plain_runs():
    torchrun = launcher.detect_world(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert torchrun == launcher.World(3, 4, 1, 2, 1, "10.0.0.1", 29500, "torchrun")
    slurm = launcher.detect_world(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "2",
            "SLURM_NTASKS_PER_NODE": "4(x2)",
            "SLURM_NODELIST": "gpu[07-08]",
            "SLURM_JOB_ID": "123",
            "SLURM_JOB_NAME": "train",
        }
    )
    assert slurm == launcher.World(5, 8, 1, 4, 2, "gpu07", 15123, "slurm")
    assert (
        launcher.detect_world({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NAME": "bash"}) is None
    )  # an interactive allocation
    assert launcher.detect_world({}) is None


@pytest.mark.parametrize(
    "nodelist, first",
    [("node7", "node7"), ("gpu[03-05,9],cpu1", "gpu03"), ("a[1],b[2-3]", "a1"), ("host-1,host-2", "host-1")],
)
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert launcher.first_host(nodelist) == first


def test_store_listens_on_loopback_only():
    import datetime

    store = launcher.loopback_store(datetime.timedelta(seconds=5))
    port = f":{store.port:04X}"
    listening = [
        line.split()[1]
        for name in ("/proc/net/tcp", "/proc/net/tcp6")
        for line in Path(name).read_text().splitlines()[1:]
        if line.split()[1].endswith(port) and line.split()[3] == "0A"
    ]
    assert listening == ["0100007F" + port], listening  # 127.0.0.1, not every interface
    del store


def test_interactive_sessions_are_told_to_use_ddp_spawn(monkeypatch):
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    with pytest.raises(RuntimeError, match="ddp_spawn"):
        launcher.rerun_command()


def test_peer_failures_are_recognised():
    assert launcher.is_peer_failure(RuntimeError("[pair.cc:553] Connection closed by peer [x]:1"))
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = ConnectionResetError("Connection reset by peer")
    assert launcher.is_peer_failure(wrapped)
    assert not launcher.is_peer_failure(ValueError("boom"))
    assert signal.SIGKILL  # the kill tests above rely on POSIX signals


def test_ddp_spawn_explains_what_could_not_be_pickled():
    train, _ = ddp_script.loaders(4)
    unpicklable = torch.utils.data.DataLoader(train.dataset, batch_size=4, collate_fn=lambda b: b)
    trainer = ddp_script.ember.Trainer(
        strategy="ddp_spawn",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(RuntimeError, match="ddp_spawn.*pickling.*strategy='ddp'"):
        trainer.fit(ddp_script.Net(), unpicklable)


def test_ddp_spawn_of_a_script_read_from_stdin_says_to_save_it(tmp_path):
    # Its workers would re-import the main module from a file that does not exist and die at start-up.
    script = (
        "import torch, ember\nfrom tests.helpers.models import BoringModel, regression_loader\n"
        "t = ember.Trainer(strategy='ddp_spawn', devices=2, max_epochs=1, logger=False, "
        "enable_checkpointing=False, enable_progress_bar=False)\n"
        "t.fit(BoringModel(), regression_loader())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-"], input=script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "'<stdin>' is not a file (a script read from stdin?). Save the script to a file" in done.stderr


def test_after_a_stop_signal_no_failure_record_is_waited_for(monkeypatch):
    # Under torchrun, the agent's SIGTERM means it saw a process end: a rank that raised recorded its
    # failure before ending, so a record that is missing now (a rank killed by SIGKILL) never comes.
    monkeypatch.setattr(launcher, "_stop_signal", None)
    record = launcher.FailureRecord(torch.distributed.HashStore())
    began = time.monotonic()
    assert record.wait(timeout=0.3) is None
    assert time.monotonic() - began >= 0.3  # no signal: waits the whole timeout
    launcher.note_stop_signal(signal.SIGTERM)
    began = time.monotonic()
    assert record.wait(timeout=30) is None
    assert time.monotonic() - began < 5
    assert record.claim("rank 1: ValueError: boom")
    assert record.wait(timeout=30) == "rank 1: ValueError: boom"  # a record that is there is still read
