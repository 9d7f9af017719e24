"""ModelCheckpoint(async_save=True): the same files and contents as synchronous saves, written on a
background thread; ordering, failures, crashes, exact resume, and no thread left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint
from ember.checkpoint import background as checkpoint_writer
from ember.checkpoint import writer as trainer_checkpoint
from ember.checkpoint.background import BackgroundWriter
from tests.helpers.models import OtherRank

WRITER = "ember-checkpoint-writer"


class Net(ember.TrainModule):
    """Adam on a small MLP (optimizer state to copy); logs ``loss`` for top-k."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.fail_at:
            raise RuntimeError("boom in training_step")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loader(n: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))
    return DataLoader(data, batch_size=2, shuffle=True)


def run(
    root,
    async_save: bool,
    max_steps: int = -1,
    epochs: int = 2,
    ckpt_path: str | None = None,
    module: ember.TrainModule | None = None,
    extra: list[Callback] | None = None,
    **kw: Any,
) -> tuple[ember.Trainer, ModelCheckpoint, ember.TrainModule]:
    kw.setdefault("every_n_train_steps", 1)
    cb = ModelCheckpoint(dirpath=str(root), async_save=async_save, **kw)
    ember.seed_everything(0)
    module = module or Net()
    trainer = ember.Trainer(
        max_epochs=epochs,
        max_steps=max_steps,
        enable_progress_bar=False,
        logger=False,
        default_root_dir=str(root),
        callbacks=[cb, *(extra or [])],
    )
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return trainer, cb, module


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WRITER]


def same(a: Any, b: Any, root_a: str, root_b: str) -> bool:
    """Equal contents, tensors bitwise, with paths under ``root_a`` read as under ``root_b``."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, str):
        return isinstance(b, str) and a.replace(root_a, root_b) == b
    if isinstance(a, dict):
        a = {k.replace(root_a, root_b) if isinstance(k, str) else k: v for k, v in a.items()}
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k], root_a, root_b) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y, root_a, root_b) for x, y in zip(a, b))
    return bool(a == b)


def records(path: str | os.PathLike) -> dict[str, bytes]:
    """Every record of a torch.save file but its random serialization id, by name within the archive."""
    with zipfile.ZipFile(path) as z:
        return {
            name.split("/", 1)[1]: z.read(name) for name in z.namelist() if not name.endswith("/.data/serialization_id")
        }


class Gate:
    """Replaces the background writer's ``write_atomic``: records each write and holds the writes of
    paths containing ``hold`` until ``release`` (10 s at most, so a broken test cannot hang)."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, hold: str | None = None, fail: str | None = None, delay: float = 0.0
    ) -> None:
        self.original = checkpoint_writer.write_atomic
        self.hold, self.fail, self.delay = hold, fail, delay
        self.released = threading.Event()
        self.log: list[tuple[str, str, float]] = []  # (event, file name, time)
        self.busy = 0
        self.most_busy = 0
        monkeypatch.setattr(checkpoint_writer, "write_atomic", self.write)

    def write(self, obj: Any, path: str, before_rename: Any = None, background: bool = False) -> None:
        name = os.path.basename(path)
        self.busy += 1
        self.most_busy = max(self.most_busy, self.busy)
        self.log.append(("start", name, time.monotonic()))
        try:
            if self.hold and self.hold in name:
                assert self.released.wait(10), "the gate was never released"
            time.sleep(self.delay)
            if self.fail and self.fail in name:
                raise OSError(28, f"No space left on device (simulated) writing {path}")
            assert background  # through a Python file object, releasing the GIL
            self.original(obj, path, before_rename, background)
        finally:
            self.busy -= 1
            self.log.append(("end", name, time.monotonic()))


# ---------------------------------------------------------------------------------------------- same result
def test_async_writes_the_same_files_and_contents_as_synchronous_saves(tmp_path):
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    _, sync_cb, _ = run(sync_dir, False, monitor="loss", save_top_k=2)
    _, async_cb, _ = run(async_dir, True, monitor="loss", save_top_k=2)
    names = sorted(os.listdir(sync_dir))
    assert sorted(os.listdir(async_dir)) == names and "last.ckpt" in names and len(names) == 3
    for name in names:  # plain data only: loads with weights_only=True
        a = torch.load(os.path.join(async_dir, name), weights_only=True)
        b = torch.load(os.path.join(sync_dir, name), weights_only=True)
        assert same(a, b, async_dir, sync_dir), name
    assert same(async_cb.state_dict(), sync_cb.state_dict(), async_dir, sync_dir)
    assert os.path.samefile(os.path.join(async_dir, "last.ckpt"), async_cb.last_model_path)
    assert not writer_threads()


def test_epoch_end_saves_after_validation_match_synchronous_ones(tmp_path):
    from tests.callbacks.test_model_checkpoint import Scored, data

    results = {}
    for mode in (False, True):
        root = tmp_path / str(mode)
        cb = ModelCheckpoint(
            dirpath=str(root),
            monitor="val/acc",
            mode="max",
            save_top_k=2,
            async_save=mode,
            filename="{epoch}-{val/acc:.1f}",
        )
        trainer = ember.Trainer(
            max_epochs=4,
            enable_progress_bar=False,
            logger=False,
            default_root_dir=str(root),
            num_sanity_val_steps=0,
            callbacks=[cb],
        )
        trainer.fit(Scored([0.3, 0.1, 0.5, 0.4]), data(), data(2))
        results[mode] = (
            sorted(os.listdir(root)),
            os.path.basename(cb.best_model_path),
            float(cb.best_model_score),
            sorted(os.path.basename(p) for p in cb.best_k_models),
        )
    assert (
        results[True]
        == results[False]
        == (
            ["epoch=2-val_acc=0.5.ckpt", "epoch=3-val_acc=0.4.ckpt", "last.ckpt"],
            "epoch=2-val_acc=0.5.ckpt",
            pytest.approx(0.5),
            ["epoch=2-val_acc=0.5.ckpt", "epoch=3-val_acc=0.4.ckpt"],
        )
    )
    assert torch.load(tmp_path / "True" / "last.ckpt", weights_only=True)["epoch"] == 3


def test_resume_from_an_async_checkpoint_is_bitwise_equal_to_a_synchronous_one(tmp_path):
    finals = {}
    for mode in (False, True):
        root = tmp_path / str(mode)
        run(root, mode, max_steps=5)  # stops mid-epoch 0 (8 batches an epoch)
        _, _, module = run(root, mode, ckpt_path=str(root / "last.ckpt"))
        finals[mode] = module.state_dict()
    _, _, straight = run(tmp_path / "straight", True)
    for k, v in straight.state_dict().items():
        assert torch.equal(finals[True][k], v) and torch.equal(finals[False][k], v), k


def test_views_of_one_storage_stay_shared_and_buffers_are_reused_between_saves(tmp_path):
    writer = BackgroundWriter()
    base = torch.arange(12.0)
    path = str(tmp_path / "x.ckpt")
    writer.submit({"a": base, "b": base[4:8].view(2, 2), "n": [1, "s", (2.5,)]}, path)
    writer.wait()
    first = [b.data_ptr() for b in writer._buffers]
    base.add_(1)  # the live state moves on; the next save copies it into the same buffers
    writer.submit({"a": base, "b": base[4:8].view(2, 2), "n": [1, "s", (2.5,)]}, path)
    second = [b.data_ptr() for b in writer._buffers]
    writer.close(raise_errors=True)
    assert len(first) == 1 and second == first  # one storage, one buffer, the same one both times
    assert writer._buffers == []  # freed at the end of the fit
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["a"], base) and loaded["n"] == [1, "s", (2.5,)]
    assert loaded["b"].untyped_storage().data_ptr() == loaded["a"].untyped_storage().data_ptr()


def test_copies_keep_what_torch_save_keeps(tmp_path):
    """Conjugate and negative views, parameters, requires_grad, dtypes: the file written from the copy
    loads the same as one written from the live tensors."""
    z = torch.tensor([1 + 2j, 3 - 1j])
    live = {
        "conj": z.conj(),
        "neg": torch.tensor([1 + 2j]).conj().imag,
        "param": torch.nn.Parameter(torch.ones(2)),
        "grad": torch.ones(2, requires_grad=True),
        "half": torch.arange(3, dtype=torch.float16),
        "flags": torch.tensor([True, False]),
        "empty": torch.empty(0),
        "t": torch.arange(6.0).view(2, 3).t(),
    }
    direct, background = str(tmp_path / "direct.ckpt"), str(tmp_path / "background.ckpt")
    torch.save(live, direct)
    writer = BackgroundWriter()
    writer.submit(live, background)
    writer.close(raise_errors=True)
    a, b = torch.load(direct, weights_only=True), torch.load(background, weights_only=True)
    for k in live:
        assert type(a[k]) is type(b[k]) and a[k].dtype == b[k].dtype and a[k].requires_grad == b[k].requires_grad, k
        assert a[k].stride() == b[k].stride() and a[k].is_conj() == b[k].is_conj() and torch.equal(a[k], b[k]), k


def test_a_state_dicts_metadata_is_kept(tmp_path):
    """A module's ``state_dict`` carries ``_metadata`` (each module's version, which ``load_state_dict``
    reads): the copy keeps it, so the file holds the records torch.save writes, byte for byte."""
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    state = {"state_dict": module.state_dict()}
    torch.save(state, tmp_path / "direct.pt")
    writer = BackgroundWriter()
    writer.submit(state, str(tmp_path / "background.pt"))
    writer.close(raise_errors=True)
    loaded = torch.load(tmp_path / "background.pt", weights_only=True)["state_dict"]
    assert loaded._metadata == module.state_dict()._metadata  # type: ignore[attr-defined]
    assert records(tmp_path / "background.pt") == records(tmp_path / "direct.pt")


def test_copy_buffers_survive_from_one_save_to_the_next_during_fit(tmp_path, monkeypatch):
    seen: list[list[int]] = []
    original = BackgroundWriter.submit

    def submit(self: BackgroundWriter, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        seen.append([b.data_ptr() for b in self._buffers])

    monkeypatch.setattr(BackgroundWriter, "submit", submit)
    run(tmp_path, True, max_steps=4)
    assert len(seen) == 4 and seen[0] and all(s == seen[0] for s in seen)


# ---------------------------------------------------------------------------------------------- ordering
def test_one_write_in_flight_and_nothing_piles_up(tmp_path, monkeypatch):
    gate = Gate(monkeypatch, delay=0.05)
    run(tmp_path, True, max_steps=6)
    assert gate.most_busy == 1
    assert [n for e, n, _ in gate.log if e == "start"] == [f"epoch=0-step={s}.ckpt" for s in range(1, 7)]
    assert not writer_threads()


def test_a_new_file_is_neither_listed_nor_linked_nor_rotated_in_before_it_exists(tmp_path, monkeypatch):
    gate = Gate(monkeypatch, hold="step=4")
    seen: dict[str, Any] = {}

    class Probe(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 5:  # the write of step 4's checkpoint is held
                cb = trainer.checkpoint_callback
                seen["exists"] = os.path.exists(tmp_path / "epoch=0-step=4.ckpt")
                seen["previous_kept"] = os.path.exists(tmp_path / "epoch=0-step=2.ckpt")
                seen["last_is_previous"] = os.path.samefile(tmp_path / "last.ckpt", tmp_path / "epoch=0-step=2.ckpt")
                seen["best"] = os.path.basename(cb.best_model_path)
                seen["last"] = os.path.basename(cb.last_model_path)
                gate.released.set()

    _, cb, _ = run(tmp_path, True, max_steps=6, every_n_train_steps=2, extra=[Probe()])
    assert seen == {
        "exists": False,
        "previous_kept": True,
        "last_is_previous": True,
        "best": "epoch=0-step=2.ckpt",
        "last": "last.ckpt",
    }
    # Once written: listed, linked, and the files they replace are gone.
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=6.ckpt", "last.ckpt"]
    assert os.path.basename(cb.best_model_path) == "epoch=0-step=6.ckpt"
    assert os.path.samefile(tmp_path / "last.ckpt", tmp_path / "epoch=0-step=6.ckpt")


def test_a_synchronous_save_waits_for_the_write_in_flight(tmp_path, monkeypatch):
    gate = Gate(monkeypatch, delay=0.3)
    synchronous: list[tuple[str, float, float]] = []
    original = trainer_checkpoint.write_atomic

    def sync_write(obj: Any, path: str, before_rename: Any = None) -> None:
        start = time.monotonic()
        original(obj, path, before_rename)
        synchronous.append((os.path.basename(path), start, time.monotonic()))

    monkeypatch.setattr(trainer_checkpoint, "write_atomic", sync_write)

    class UserSave(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 2:  # step 1's checkpoint is being written in the background
                trainer.save_checkpoint(str(tmp_path / "mine.ckpt"))

    run(tmp_path, True, max_steps=2, extra=[UserSave()])
    ((name, start, _),) = synchronous
    ended = [t for e, n, t in gate.log if e == "end" and n == "epoch=0-step=1.ckpt"]
    assert name == "mine.ckpt" and ended and ended[0] <= start
    assert torch.load(tmp_path / "mine.ckpt", weights_only=True)["global_step"] == 2


# ---------------------------------------------------------------------------------------------- failures
def test_a_failed_background_write_is_raised_in_the_training_thread(tmp_path, monkeypatch):
    Gate(monkeypatch, fail="step=2")
    with pytest.raises(OSError, match="simulated") as info:
        run(tmp_path, True)
    assert any("background write" in note for note in getattr(info.value, "__notes__", []))
    # The previous checkpoint is intact and is what the lists name; no temporary file is left.
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=1.ckpt", "last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 1
    assert not writer_threads()


def test_a_failure_of_the_last_write_is_raised_by_fit(tmp_path, monkeypatch):
    Gate(monkeypatch, fail="step=3")
    with pytest.raises(OSError, match="simulated"):
        run(tmp_path, True, max_steps=3)
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 2


def test_an_exception_in_training_waits_for_the_write_and_leaves_no_thread(tmp_path, monkeypatch):
    gate = Gate(monkeypatch, delay=0.3)
    with pytest.raises(RuntimeError, match="boom"):
        run(tmp_path, True, module=Net(fail_at=2))
    assert gate.busy == 0 and not writer_threads()
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 2


def test_an_exception_warns_about_a_failed_write_and_still_raises_itself(tmp_path, monkeypatch):
    Gate(monkeypatch, fail="step=2", delay=0.2)
    with pytest.warns(RuntimeWarning, match="background failed"), pytest.raises(RuntimeError, match="boom"):
        run(tmp_path, True, module=Net(fail_at=2))
    assert not writer_threads()


def test_preemption_waits_for_the_write_in_flight_and_saves_last(tmp_path, monkeypatch):
    gate = Gate(monkeypatch, delay=0.2)

    class Signal(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)

    cb = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, async_save=True)
    trainer = ember.Trainer(
        max_epochs=1, enable_progress_bar=False, logger=False, default_root_dir=str(tmp_path), callbacks=[cb, Signal()]
    )
    trainer.preemption_signals = (signal.SIGUSR1,)
    with pytest.warns(UserWarning, match="SIGUSR1"), pytest.raises(ember.exceptions.Preempted) as info:
        trainer.fit(Net(), loader())
    assert info.value.checkpoint_path == str(tmp_path / "last.ckpt")
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 3
    assert gate.most_busy == 1 and not writer_threads()


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    cb = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, async_save=True)
    trainer = ember.Trainer(
        max_steps=3,
        enable_progress_bar=False,
        logger=False,
        strategy=OtherRank("cpu"),
        default_root_dir=str(tmp_path),
        callbacks=[cb],
    )
    trainer.fit(Net(), loader())
    assert gate.log == [] and not os.listdir(tmp_path)
    # Its lists say what rank zero's do, at once (nothing to wait for on this rank).
    assert os.path.basename(cb.best_model_path) == "epoch=0-step=3.ckpt"


def test_a_save_that_bypasses_ember_save_is_an_error(tmp_path):
    class Custom(ember.Trainer):
        def save_checkpoint(self, filepath: str, weights_only: bool = False) -> None:
            torch.save({"x": torch.zeros(1)}, filepath)

    cb = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, async_save=True)
    trainer = Custom(max_steps=2, enable_progress_bar=False, logger=False, callbacks=[cb])
    with pytest.raises(RuntimeError, match="did not go through ember's Trainer.save_checkpoint"):
        trainer.fit(Net(), loader())
    assert not writer_threads()


def _ddp_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    """On each of 2 gloo ranks: a reference fit, a fit with background saves stopped by an exception,
    and its resume (ember's ``ddp`` joins the process group ``run_ranks`` made)."""
    import warnings

    warnings.simplefilter("ignore")
    from tests.helpers.dist import join_as_rank

    join_as_rank(rank, world)
    from tests.trainer.test_checkpoint_resume import StopAt, fit

    ref, _ = fit(os.path.join(root, "ref"), strategy="ddp", devices=world, max_epochs=1)
    run = os.path.join(root, "async")

    def background() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=os.path.join(run, "ckpts"), every_n_train_steps=2, async_save=True)

    with pytest.raises(RuntimeError, match="stop at step 5"):
        fit(run, 0, [StopAt(5)], checkpoint=background(), strategy="ddp", devices=world, max_epochs=1)
    # Rank zero waited for its write in flight before fit raised (another rank's fit does not wait for it).
    files = sorted(os.listdir(os.path.join(run, "ckpts"))) if rank == 0 else None
    resumed, trainer = fit(
        run, 0, checkpoint=background(), ckpt_path="last", strategy="ddp", devices=world, max_epochs=1
    )
    # Every rank's fit returns once rank zero's last write is complete.
    last = torch.load(os.path.join(run, "ckpts", "last.ckpt"), weights_only=True)["global_step"]
    a, b = ref.state_dict(), resumed.state_dict()
    return {
        "same": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
        "files": files,
        "steps": (trainer.global_step, last),
        "threads": [t.name for t in writer_threads()],
    }


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_ddp_background_saves_resume_exactly_on_two_ranks(tmp_path):
    from tests.helpers.dist import run_ranks

    results = run_ranks(_ddp_ranks, 2, str(tmp_path), timeout=90)
    # 6 steps an epoch on 2 ranks; saves at steps 2 and 4 before the stop; rank zero alone writes.
    assert results[0] == {"same": True, "files": ["epoch=0-step=4.ckpt", "last.ckpt"], "steps": (6, 6), "threads": []}
    assert results[1] == {**results[0], "files": None}


def test_async_save_must_be_a_bool():
    with pytest.raises(ValueError, match="async_save must be True or False"):
        ModelCheckpoint(async_save="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- crash
CRASHING = textwrap.dedent("""
    import os, sys, time, torch
    from torch.utils.data import DataLoader, TensorDataset
    import ember
    from ember.callbacks import ModelCheckpoint
    from ember.checkpoint import background as checkpoint_writer

    root = sys.argv[1]
    original = checkpoint_writer.write_atomic

    def write(obj, path, before_rename=None, background=False):
        if "step=2" in path:  # step 2's file is durable under its temporary name: now wait to be killed
            def hang(tmp):
                open(os.path.join(root, "..", "in-flight"), "w").close()
                time.sleep(60)
            before_rename = hang
        original(obj, path, before_rename, background)

    checkpoint_writer.write_atomic = write

    class Net(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = ModelCheckpoint(dirpath=root, every_n_train_steps=1, async_save=True)
    trainer = ember.Trainer(max_steps=50, enable_progress_bar=False, logger=False, callbacks=[cb])
    trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(100, 2)), batch_size=2))
""")


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_kill_9_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpts"
    script = tmp_path / "train.py"
    script.write_text(CRASHING)
    proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 40
        while not (tmp_path / "in-flight").exists():
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "the child never reached the write of step 2"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()
    names = os.listdir(root)
    temporaries = [n for n in names if n.endswith(".tmp")]
    assert sorted(set(names) - set(temporaries)) == ["epoch=0-step=1.ckpt", "last.ckpt"] and temporaries
    assert ember.checkpoint.load(str(root / "last.ckpt"))["global_step"] == 1
    # The next run in the directory (ModelCheckpoint.setup) removes the dead writer's temporary file.
    assert sorted(ember.checkpoint.remove_stale_temporaries(str(root))) == sorted(temporaries)
