"""Nothing a user owns is lost: resume finds the previous run, never deletes another run's files,
changes nothing when a checkpoint is bad, and two jobs on one directory never break each other.

These run in the default configuration (TensorBoard logger on, checkpointing on) unless a test
says otherwise, because that is where users are.
"""

from __future__ import annotations

import copy
import errno
import glob
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import ember
from ember import checkpoint
from ember.callbacks import ModelCheckpoint
from ember.checkpoint import CheckpointError, remove_stale_temporaries, temporary_prefix, write_atomic
from tests.helpers.models import BoringModel, regression_loader

_SCRIPT = textwrap.dedent("""
    import sys, torch, ember
    from torch.utils.data import DataLoader, TensorDataset

    class Net(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    max_epochs, ckpt_path = int(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else None)
    trainer = ember.Trainer(max_epochs=max_epochs, log_every_n_steps=1, enable_progress_bar=False)
    trainer.fit(Net(), DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    print("RESULT", trainer.global_step, trainer.log_dir)
""")


def _run(script, cwd, *args):
    proc = subprocess.run(
        [sys.executable, str(script), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    step, log_dir = proc.stdout.split("RESULT ", 1)[1].split()
    return int(step), log_dir, proc.stderr


def _event_steps(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return sorted(e.step for e in acc.Scalars("train_loss"))


def _versions(root):
    return sorted(os.listdir(root / "ember_logs"))


# ---------------------------------------------------------------------------------------------- 1: "last"
@pytest.mark.processes
@pytest.mark.timeout(120)
def test_second_script_run_with_last_resumes_the_first_and_continues_its_log_directory(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    step, log_dir, _ = _run(script, tmp_path, 3)
    assert step == 12 and log_dir.endswith(os.path.join("ember_logs", "version_0"))
    step, log_dir, err = _run(script, tmp_path, 5, "last")
    assert "found no checkpoint" not in err
    assert step == 20, "the second run trained from scratch instead of resuming"
    assert log_dir.endswith(os.path.join("ember_logs", "version_0"))
    assert _versions(tmp_path) == ["version_0"], "the resumed run opened a new version directory"
    # TensorBoard's curve continues: steps 0..19 once each (as Lightning, a step's metrics are written at the
    # step's index), not a second curve starting again at 0.
    assert _event_steps(tmp_path / "ember_logs" / "version_0") == list(range(20))
    names = sorted(os.listdir(tmp_path / "ember_logs" / "version_0" / "checkpoints"))
    assert names == ["epoch=4-step=20.ckpt", "last.ckpt"]
    # A third run without ckpt_path starts a run of its own beside it.
    step, log_dir, _ = _run(script, tmp_path, 1)
    assert step == 4 and log_dir.endswith("version_1")


def test_two_trainers_in_one_process_resume_like_two_scripts(tmp_path):
    first = ember.Trainer(max_epochs=2, enable_progress_bar=False, default_root_dir=str(tmp_path))
    first.fit(BoringModel(), regression_loader())
    # log_every_n_steps within the 4-batch epochs: Lightning's (and ember's) short-epoch warning is not the point here.
    second = ember.Trainer(max_epochs=3, enable_progress_bar=False, default_root_dir=str(tmp_path), log_every_n_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "found no checkpoint", no other-directory warning
        warnings.filterwarnings("ignore", message=".*defines validation_step, but this fit has no validation data")
        second.fit(BoringModel(), regression_loader(), ckpt_path="last")
    assert second.global_step == 12 and second.log_dir == first.log_dir
    assert _versions(tmp_path) == ["version_0"]


def test_last_picks_the_most_recently_written_run(tmp_path):
    for epochs in (1, 2):  # version_0 then version_1, each a fresh run
        ember.Trainer(max_epochs=epochs, enable_progress_bar=False, default_root_dir=str(tmp_path)).fit(
            BoringModel(), regression_loader()
        )
    old = tmp_path / "ember_logs" / "version_1" / "checkpoints" / "last.ckpt"
    os.utime(old, (time.time() - 100, time.time() - 100))  # version_0's last.ckpt is now the newer one
    t = ember.Trainer(max_epochs=3, enable_progress_bar=False, default_root_dir=str(tmp_path))
    t.fit(BoringModel(), regression_loader(), ckpt_path="last")
    assert t.log_dir.endswith("version_0") and t.global_step == 12
    assert _versions(tmp_path) == ["version_0", "version_1"]


def test_last_keeps_a_logger_version_the_user_chose(tmp_path):
    ember.Trainer(max_epochs=1, enable_progress_bar=False, default_root_dir=str(tmp_path)).fit(
        BoringModel(), regression_loader()
    )
    logger = ember.loggers.TensorBoardLogger(save_dir=str(tmp_path), version="mine")
    t = ember.Trainer(max_epochs=2, enable_progress_bar=False, default_root_dir=str(tmp_path), logger=logger)
    with pytest.warns(UserWarning, match="found no checkpoint"):  # only version "mine" is searched
        t.fit(BoringModel(), regression_loader(), ckpt_path="last")
    assert t.global_step == 8 and t.log_dir.endswith("mine")


# ---------------------------------------------------------------------------------------------- 2: other runs' files
def _files(directory):
    return {p: (os.path.getsize(p), os.path.getmtime(p)) for p in glob.glob(os.path.join(directory, "*.ckpt"))}


@pytest.mark.parametrize("monitor", [None, "train_loss"])
def test_resuming_from_another_runs_checkpoint_leaves_that_run_untouched(tmp_path, monitor):
    run_a = tmp_path / "runA"
    ember.Trainer(
        max_epochs=2,
        enable_progress_bar=False,
        default_root_dir=str(run_a),
        callbacks=[ModelCheckpoint(monitor=monitor)],
    ).fit(BoringModel(), regression_loader())
    a_dir = run_a / "ember_logs" / "version_0" / "checkpoints"
    before = _files(a_dir)
    assert len(before) == 2, before  # epoch=1-step=8.ckpt and last.ckpt
    t = ember.Trainer(
        max_epochs=4,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path / "runB"),
        callbacks=[ModelCheckpoint(monitor=monitor)],
    )
    with pytest.warns(UserWarning, match="not carried over"):
        t.fit(BoringModel(), regression_loader(), ckpt_path=str(a_dir / "last.ckpt"))
    assert t.global_step == 16
    assert _files(a_dir) == before, "resuming deleted or rewrote the other run's checkpoints"
    assert sorted(os.listdir(tmp_path / "runB" / "ember_logs" / "version_0" / "checkpoints")) == [
        "epoch=3-step=16.ckpt",
        "last.ckpt",
    ]


def test_resuming_version_0s_checkpoint_from_a_new_version_deletes_nothing_of_version_0(tmp_path):
    ember.Trainer(max_epochs=2, enable_progress_bar=False, default_root_dir=str(tmp_path)).fit(
        BoringModel(), regression_loader()
    )
    v0 = tmp_path / "ember_logs" / "version_0" / "checkpoints"
    before = _files(v0)
    t = ember.Trainer(max_epochs=4, enable_progress_bar=False, default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="not carried over"):
        t.fit(BoringModel(), regression_loader(), ckpt_path=str(v0 / "last.ckpt"))
    assert t.log_dir.endswith("version_1") and _files(v0) == before


def test_a_stale_best_model_path_outside_the_directory_is_never_removed(tmp_path):
    outside = tmp_path / "precious.ckpt"
    outside.write_bytes(b"mine")
    cb = ModelCheckpoint(dirpath=str(tmp_path / "c"))
    t = ember.Trainer(max_epochs=2, enable_progress_bar=False, logger=False, callbacks=[cb])
    cb.best_model_path = str(outside)  # as if restored from anywhere
    t.fit(BoringModel(), regression_loader())
    assert outside.read_bytes() == b"mine"


# ---------------------------------------------------------------------------------------------- 3: transactional
def _saved(tmp_path):
    cb = ModelCheckpoint(dirpath=str(tmp_path / "c"), every_n_train_steps=3, save_top_k=-1)
    t = ember.Trainer(max_epochs=2, enable_progress_bar=False, logger=False, callbacks=[cb])
    t.fit(BoringModel(), regression_loader())
    return torch.load(tmp_path / "c" / "last.ckpt", weights_only=True)


class _Recorder(ember.callbacks.Callback):
    def __init__(self):
        self.loaded = None

    def state_dict(self):
        return {"value": 1}

    def load_state_dict(self, state):
        self.loaded = state


def _resume_expecting_error(tmp_path, ckpt, match):
    path = tmp_path / "bad.ckpt"
    torch.save(ckpt, path)
    module = BoringModel()
    rec = _Recorder()
    cb = ModelCheckpoint(dirpath=str(tmp_path / "d"))
    t = ember.Trainer(max_epochs=3, enable_progress_bar=False, logger=False, callbacks=[rec, cb])
    before = copy.deepcopy(module.state_dict())
    optimizers = []
    real = t._fit

    def run_fit(*args):
        try:
            real(*args)
        finally:
            optimizers.extend(t.optimizers)

    t._fit = run_fit
    with pytest.raises(CheckpointError, match=match) as info:
        t.fit(module, regression_loader(), ckpt_path=str(path))
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the module's weights changed"
    assert all(not opt.state for opt in optimizers), "an optimizer was loaded"
    assert rec.loaded is None and cb.best_k_models == {} and cb.best_model_path == ""
    assert t.global_step == 0 and t.current_epoch == 0
    assert not isinstance(info.value.__cause__, AttributeError)
    return str(info.value)


@pytest.mark.parametrize(
    "entry, corrupt, match",
    [
        ("progress", lambda c: c.__setitem__("progress", "epoch 3"), r"'progress' entry: progress is a str"),
        ("progress", lambda c: c["progress"].__setitem__("global_step", "7"), r"'progress'.*global_step is '7'"),
        ("progress", lambda c: c["progress"].pop("batch_in_epoch"), r"'progress'.*batch_in_epoch is None"),
        (
            "progress",
            lambda c: c["progress"].__setitem__("batch_in_epoch", 99),
            r"'progress'.*at batch 99 of an epoch "
            r"that has 4 batches",
        ),
        ("optimizer_states", lambda c: c.__setitem__("optimizer_states", [{"state": {}}]), r"'optimizer_states'"),
        (
            "optimizer_states",
            lambda c: c["optimizer_states"][0].__setitem__("state", {0: {"momentum_buffer": torch.ones(7)}}),
            r"'optimizer_states'.*'momentum_buffer' for parameter 0 has shape \(7,\)",
        ),
        ("lr_schedulers", lambda c: c.__setitem__("lr_schedulers", ["x"]), r"'optimizer_states'.*1 LR scheduler"),
        ("callbacks", lambda c: c.__setitem__("callbacks", ["x"]), r"'callbacks' entry: callbacks is a list"),
        ("callbacks", lambda c: c["callbacks"].__setitem__("_Recorder", 3), r"'callbacks'.*_Recorder"),
        ("sampler", lambda c: c["sampler"].__setitem__("position", 33), r"'sampler'.*position 33 is beyond the 32"),
        ("sampler", lambda c: c["sampler"].__setitem__("epoch", -1), r"'sampler'.*epoch is -1"),
        ("rng", lambda c: c["rng"]["per_rank"][0].__setitem__("torch", torch.zeros(3)), r"'rng'.*torch generator"),
        ("strategy", lambda c: c.__setitem__("strategy", {"world_size": 0}), r"'strategy'.*world_size is 0"),
        ("callback_metrics", lambda c: c["callback_metrics"].__setitem__("x", "high"), r"'callback_metrics'"),
        ("epoch_metrics", lambda c: c.__setitem__("epoch_metrics", [{"name": "x"}]), r"'epoch_metrics'.*lacks"),
    ],
)
def test_a_malformed_entry_changes_nothing_and_names_the_entry(tmp_path, entry, corrupt, match):
    ckpt = _saved(tmp_path)
    corrupt(ckpt)
    message = _resume_expecting_error(tmp_path, ckpt, match)
    assert "Nothing was loaded" in message


def test_an_integer_tensor_is_not_cast_into_a_float_parameter(tmp_path):
    ckpt = _saved(tmp_path)
    ckpt["state_dict"]["layer.weight"] = torch.ones(1, 4, dtype=torch.int64)
    message = _resume_expecting_error(
        tmp_path,
        ckpt,
        r"dtype mismatches: layer.weight: checkpoint torch.int64 vs "
        r"module torch.float32",
    )
    assert "Nothing was loaded" in message


class _Explodes(ember.callbacks.Callback):
    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        if state["n"] == 2:
            raise RuntimeError("cannot load this")


def test_a_failing_callback_load_puts_everything_back(tmp_path):
    ckpt = _saved(tmp_path)
    path = tmp_path / "ok.ckpt"
    torch.save(ckpt, path)
    ckpt["callbacks"]["_Explodes"] = {"n": 2}
    torch.save(ckpt, path)
    module = BoringModel()
    before = copy.deepcopy(module.state_dict())
    cb = ModelCheckpoint(dirpath=str(tmp_path / "c"), every_n_train_steps=3, save_top_k=-1)
    t = ember.Trainer(max_epochs=3, enable_progress_bar=False, logger=False, callbacks=[cb, _Explodes()])
    with pytest.raises(RuntimeError, match="cannot load this"):
        t.fit(module, regression_loader(), ckpt_path=str(path))
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert cb.best_k_models == {} and t.global_step == 0 and t.progress.batch_in_epoch == 0


class _Counting(ember.callbacks.Callback):
    def __init__(self, calls: list[str]):
        self.calls = calls
        self.history = [0]

    def state_dict(self):
        self.calls.append("state_dict")
        return {"history": list(self.history)}

    def load_state_dict(self, state):
        self.calls.append("load_state_dict")
        self.history.extend(state["history"])  # mutates in place: the snapshot must be a copy


def test_a_restore_calls_each_callback_hook_once_and_a_failure_still_puts_its_attributes_back(tmp_path):
    """As Lightning, a resume calls load_state_dict once and state_dict never: the copy kept to put a
    callback back if a later part fails is taken without calling its hooks."""
    ckpt = _saved(tmp_path)
    ckpt["callbacks"]["_Counting"] = {"history": [5, 6]}
    path = tmp_path / "ok.ckpt"
    torch.save(ckpt, path)
    calls: list[str] = []
    counting = _Counting(calls)
    t = ember.Trainer(
        max_epochs=3, enable_progress_bar=False, logger=False, enable_checkpointing=False, callbacks=[counting]
    )
    t.fit(BoringModel(), regression_loader(), ckpt_path=str(path))
    assert calls == ["load_state_dict"] and counting.history == [0, 5, 6]

    ckpt["callbacks"]["_Explodes"] = {"n": 2}
    torch.save(ckpt, path)
    calls = []
    counting = _Counting(calls)
    t = ember.Trainer(
        max_epochs=3,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        callbacks=[counting, _Explodes()],
    )
    with pytest.raises(RuntimeError, match="cannot load this"):
        t.fit(BoringModel(), regression_loader(), ckpt_path=str(path))
    assert calls == ["load_state_dict"] and counting.history == [0]  # loaded, then put back


def test_a_valid_checkpoint_still_resumes_after_validation(tmp_path):
    _saved(tmp_path)
    t = ember.Trainer(
        max_epochs=3,
        enable_progress_bar=False,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "c"), every_n_train_steps=3, save_top_k=-1)],
    )
    t.fit(BoringModel(), regression_loader(), ckpt_path="last")
    assert t.global_step == 12


# ---------------------------------------------------------------------------------------------- 4: two jobs
_SLOW = textwrap.dedent("""
    import os, sys, time, torch, ember
    sys.path.insert(0, sys.argv[2])
    from tests.helpers.models import BoringModel, regression_loader

    class Slow(ember.callbacks.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                print("RUNNING", flush=True)
                # Still running when the second job starts, however long its start takes on a loaded machine.
                until = time.monotonic() + 60
                while len(sys.argv) > 4 and not os.path.exists(sys.argv[4]) and time.monotonic() < until:
                    time.sleep(0.05)
            time.sleep(0.2)

    trainer = ember.Trainer(max_epochs=int(sys.argv[3]), enable_progress_bar=False, logger=False,
                            default_root_dir=sys.argv[1], callbacks=[Slow()])
    trainer.fit(BoringModel(), regression_loader())
    print("DONE", trainer.global_step, flush=True)
""")


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_a_second_job_on_the_same_directory_stops_at_start_up_and_the_first_finishes(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(_SLOW)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    go = tmp_path / "go"
    first = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), repo, "6", str(go)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout.readline().strip() == "RUNNING"
        try:
            second = subprocess.run(
                [sys.executable, str(script), str(tmp_path), repo, "1"], capture_output=True, text=True, timeout=60
            )
        finally:
            go.touch()
        assert second.returncode != 0 and "DONE" not in second.stdout
        assert (
            f"Another run (pid {first.pid} on host {socket.gethostname()}) is writing checkpoints into "
            f"{tmp_path / 'checkpoints'}" in second.stderr
        ), second.stderr[-2000:]
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err[-3000:]
    assert "DONE 24" in out
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["epoch=5-step=24.ckpt", "last.ckpt"]


@pytest.mark.processes
def test_only_temporaries_of_dead_writers_on_this_host_are_removed(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        host = temporary_prefix("x").split("~")[1]
        names = {
            "live": f".last.ckpt~{host}~{sleeper.pid}~abc123.tmp",
            "dead": f".last.ckpt~{host}~{dead.pid}~abc123.tmp",
            "dead_link": f".last.ckpt~{host}~{dead.pid}~link.tmp",
            "old_link": f"last.ckpt.{dead.pid}.link.tmp",
            "other_host": f".last.ckpt~elsewhere-{host}~{dead.pid}~abc123.tmp",
            "mine": f".last.ckpt~{host}~{os.getpid()}~abc123.tmp",
            "user": "notes.tmp",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"x")
        removed = remove_stale_temporaries(str(tmp_path))
        assert sorted(removed) == sorted([names["dead"], names["dead_link"], names["old_link"]])
        assert sorted(os.listdir(tmp_path)) == sorted([names[k] for k in ("live", "other_host", "mine", "user")])
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.processes
def test_a_live_writers_temporary_file_survives_another_fits_start_up(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.makedirs(tmp_path / "c")
        in_flight = tmp_path / "c" / f".last.ckpt~{temporary_prefix('x').split('~')[1]}~{sleeper.pid}~q1w2e3.tmp"
        in_flight.write_bytes(b"half a checkpoint")
        ember.Trainer(
            max_epochs=1,
            enable_progress_bar=False,
            logger=False,
            callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "c"))],
        ).fit(BoringModel(), regression_loader())
        assert in_flight.read_bytes() == b"half a checkpoint"
    finally:
        sleeper.kill()
        sleeper.wait()
    ember.Trainer(
        max_epochs=1, enable_progress_bar=False, logger=False, callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "c"))]
    ).fit(BoringModel(), regression_loader())
    assert not in_flight.exists(), "the dead writer's temporary file was not removed"


# ---------------------------------------------------------------------------------------------- 5: disk full
@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MiB tmpfs (needs root and mount permission; skipped elsewhere)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


class _Big(BoringModel):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(600, 600)  # 1.4 MB of weights: the second checkpoint does not fit


@pytest.mark.processes
def test_disk_full_says_so_and_keeps_the_previous_checkpoint(tiny_disk):
    t = ember.Trainer(
        max_epochs=3,
        enable_progress_bar=False,
        default_root_dir=str(tiny_disk),
        callbacks=[ModelCheckpoint(save_on_exception=True)],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(OSError) as info:
            t.fit(_Big(), regression_loader())
    err = info.value
    assert err.errno == errno.ENOSPC
    assert str(err).startswith(
        f"[Errno {errno.ENOSPC}] No space left on device while writing "
        f"{tiny_disk / 'ember_logs' / 'version_0' / 'checkpoints' / 'epoch=1-step=8.ckpt'}"
    )
    assert isinstance(err.__cause__, RuntimeError)  # torch's own error stays chained
    ckpts = tiny_disk / "ember_logs" / "version_0" / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert checkpoint.load(str(ckpts / "last.ckpt"))["global_step"] == 4
    # The exception-time checkpoint fails too; its warning names the callback, not the module's repr.
    messages = [str(w.message) for w in caught if "on_exception" in str(w.message)]
    assert messages and all("Linear(" not in m and "_Big(" not in m for m in messages), messages
    assert messages[0].startswith("ModelCheckpoint.on_exception raised OSError: [Errno 28] No space left on device")


def test_write_atomic_reports_no_space_from_the_final_fsync(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=r"No space left on device while writing .*a\.ckpt") as info:
        write_atomic({"x": torch.ones(3)}, str(tmp_path / "a.ckpt"))
    assert info.value.errno == errno.ENOSPC and info.value.__cause__ is not None
    assert os.listdir(tmp_path) == []


def test_other_write_errors_are_not_called_disk_full(tmp_path, monkeypatch):
    def broken(obj, f):
        raise RuntimeError("[enforce fail at inline_container.cc:1] . unexpected pos 1 vs 2")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        write_atomic({"x": torch.ones(3)}, str(tmp_path / "a.ckpt"))
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------- 6: ddp_spawn
_SPAWN = textwrap.dedent("""
    import sys, warnings
    sys.path.insert(0, sys.argv[2])
    import ember
    from tests.helpers.models import BoringModel, regression_loader

    if __name__ == "__main__":
        warnings.simplefilter("always")
        t = ember.Trainer(strategy="ddp_spawn", devices=2, accelerator="cpu", max_epochs=2,
                          enable_progress_bar=False, default_root_dir=sys.argv[1], log_every_n_steps=1)
        t.fit(BoringModel(), regression_loader(), regression_loader())  # (validation_step without data warns)
        fit_dir = t.log_dir
        t.test(dataloaders=regression_loader())
        print("DIRS", fit_dir, t.log_dir)
""")


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_ddp_spawn_fit_does_not_warn_and_test_logs_into_the_fits_version(tmp_path):
    script = tmp_path / "spawn.py"
    script.write_text(_SPAWN)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), repo], capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    fit_dir, test_dir = proc.stdout.split("DIRS ", 1)[1].split()
    assert fit_dir == test_dir == str(tmp_path / "ember_logs" / "version_0")
    assert _versions(tmp_path) == ["version_0"]
    assert len(glob.glob(str(tmp_path / "ember_logs" / "version_0" / "events.out.tfevents.*"))) == 2
    shutil.rmtree(tmp_path / "ember_logs")
