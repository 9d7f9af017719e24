"""Checkpoint contents, atomic writes, validated loading and its errors, RNG state, load_from_checkpoint."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember import checkpoint, rng
from ember.callbacks import Callback, ModelCheckpoint
from ember.checkpoint import CheckpointError, CheckpointNotFoundError


class Net(ember.TrainModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1, note: str = "x") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.MultiStepLR(opt, [1, 2])]


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)), batch_size=4, shuffle=True
    )


def trained(tmp_path, module: ember.TrainModule | None = None, **kw: Any) -> tuple[ember.TrainModule, ember.Trainer]:
    module = module or Net()
    kw.setdefault("callbacks", [ModelCheckpoint(dirpath=str(tmp_path / "c"))])
    trainer = ember.Trainer(max_epochs=2, enable_progress_bar=False, logger=False, default_root_dir=str(tmp_path), **kw)
    trainer.fit(module, loader())
    return module, trainer


@pytest.fixture
def ckpt_file(tmp_path) -> str:
    trained(tmp_path)
    return str(tmp_path / "c" / "last.ckpt")


def snapshot(directory) -> dict[str, tuple[int, bytes]]:
    return {
        n: (os.stat(os.path.join(directory, n)).st_mtime_ns, open(os.path.join(directory, n), "rb").read())
        for n in sorted(os.listdir(directory))
    }


# ---------------------------------------------------------------------------------------------- contents
def test_checkpoint_holds_full_state_and_loads_with_weights_only(ckpt_file):
    ckpt = torch.load(ckpt_file, weights_only=True)
    assert ckpt["format"] == "ember.checkpoint" and ckpt["format_version"] == checkpoint.FORMAT_VERSION
    assert ckpt["ember_version"] == ember.__version__
    assert ckpt["hyper_parameters"] == {"hidden": 8, "lr": 0.1, "note": "x"}
    assert ckpt["module_class"].endswith("Net")
    assert set(ckpt["state_dict"]) == set(Net().state_dict())
    assert len(ckpt["optimizer_states"]) == 1 and ckpt["optimizer_states"][0]["state"]
    assert ckpt["lr_schedulers"][0]["last_epoch"] == 2  # as Lightning: epoch schedulers step before the epoch-end save
    assert ckpt["progress"]["current_epoch"] == 1 and ckpt["progress"]["global_step"] == 8
    assert ckpt["progress"]["epoch_finished"] is True
    assert ckpt["sampler"]["position"] == 16 and ckpt["sampler"]["epoch"] == 1
    assert isinstance(ckpt["sampler"]["seed"], int)
    assert any(k.startswith("ModelCheckpoint") for k in ckpt["callbacks"])
    assert ckpt["strategy"] == {"name": "single", "world_size": 1}
    rng = ckpt["rng"]["per_rank"][0]
    assert rng["torch"].dtype == torch.uint8 and rng["numpy"] is not None and rng["python"]["version"] == 3
    assert "loss" in ckpt["callback_metrics"]


def test_module_and_callback_hooks_add_and_read_keys(tmp_path):
    class Hooked(Net):
        loaded: Any = None

        def on_save_checkpoint(self, ckpt):
            ckpt["mine"] = {"n": torch.ones(2)}

        def on_load_checkpoint(self, ckpt):
            Hooked.loaded = ckpt["mine"]["n"]

    class CB(Callback):
        def __init__(self):
            self.count = 0

        def state_dict(self):
            return {"count": self.count}

        def load_state_dict(self, state):
            self.count = state["count"]

        def on_train_epoch_end(self, trainer, module):
            self.count += 1

        def on_save_checkpoint(self, trainer, module, ckpt):
            ckpt["cb_extra"] = 5

    trained(tmp_path, Hooked(), callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "c")), CB()])
    assert torch.load(tmp_path / "c" / "last.ckpt", weights_only=True)["cb_extra"] == 5
    cb = CB()
    t = ember.Trainer(
        max_epochs=3,
        enable_progress_bar=False,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "c")), cb],
    )
    t.fit(Hooked(), loader(), ckpt_path=str(tmp_path / "c" / "last.ckpt"))
    assert torch.equal(Hooked.loaded, torch.ones(2))
    assert cb.count == 3  # 2 restored + 1 more epoch


def test_non_plain_hyperparameters_are_left_out_with_a_warning(tmp_path):
    class WithModule(Net):
        def __init__(self, extra: Any = None, lr: float = 0.1):
            super().__init__(lr=lr)

    with pytest.warns(UserWarning, match="'extra'.*not plain data"):
        trained(tmp_path, WithModule(extra=torch.nn.Linear(1, 1)))
    assert "extra" not in torch.load(tmp_path / "c" / "last.ckpt", weights_only=True)["hyper_parameters"]


def test_non_plain_user_key_is_refused_before_writing(tmp_path):
    class Bad(Net):
        def on_save_checkpoint(self, ckpt):
            ckpt["obj"] = object()

    with pytest.raises(CheckpointError, match=r"checkpoint\['obj'\] is a builtins.object"):
        trained(tmp_path, Bad())
    assert not os.path.exists(tmp_path / "c") or not os.listdir(tmp_path / "c")


def test_rng_capture_and_apply_round_trip():
    state = rng.capture_rng()
    a = (torch.rand(3), random.random(), np.random.rand())
    rng.apply_rng(state)
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    flat = rng.rng_to_tensor(state)  # the form ranks exchange through all_gather
    back = rng.rng_from_tensor(flat, state)
    rng.apply_rng(back)
    assert torch.equal(torch.rand(3), a[0]) and random.random() == a[1] and np.random.rand() == a[2]


def test_load_from_checkpoint_rebuilds_from_hparams_with_overrides(ckpt_file):
    module = Net.load_from_checkpoint(ckpt_file, note="override")
    assert module.hparams.hidden == 8 and module.hparams.note == "override"
    saved = torch.load(ckpt_file, weights_only=True)["state_dict"]
    assert all(torch.equal(v, saved[k]) for k, v in module.state_dict().items())


def test_load_from_checkpoint_of_another_model_names_keys(ckpt_file):
    class Other(ember.TrainModule):
        def __init__(self, hidden: int = 8, **kw: Any):
            super().__init__()
            self.body = torch.nn.Linear(4, hidden)

    with pytest.raises(CheckpointError, match=r"missing keys.*body.weight.*unexpected keys.*net.0.weight"):
        Other.load_from_checkpoint(ckpt_file)


def test_save_weights_only_and_validate_from_checkpoint(tmp_path):
    module, trainer = trained(tmp_path)
    path = str(tmp_path / "w.ckpt")
    trainer.save_checkpoint(path, weights_only=True)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["weights_only"] and "optimizer_states" not in ckpt
    with pytest.raises(CheckpointError, match="weights only"):
        ember.Trainer(max_epochs=3, enable_progress_bar=False, logger=False, enable_checkpointing=False).fit(
            Net(), loader(), ckpt_path=path
        )


# ---------------------------------------------------------------------------------------------- atomic writes
def test_write_is_atomic_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "a.ckpt"
    checkpoint.write_atomic({"x": torch.ones(3)}, str(path))
    checkpoint.write_atomic({"x": torch.zeros(3)}, str(path))
    assert os.listdir(tmp_path) == ["a.ckpt"]
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.zeros(3))


def test_failed_write_keeps_the_previous_file(tmp_path):
    path = str(tmp_path / "a.ckpt")
    checkpoint.write_atomic({"x": torch.ones(3)}, path)

    def fail(tmp):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoint.write_atomic({"x": torch.zeros(3)}, path, before_rename=fail)
    assert os.listdir(tmp_path) == ["a.ckpt"]
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.ones(3))


_CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch, ember
    from torch.utils.data import DataLoader, TensorDataset
    from ember.checkpoint import writer as checkpoint
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint import Net, loader

    class KillOnSecondSave(ember.callbacks.Callback):
        def on_train_epoch_end(self, trainer, module):
            if trainer.current_epoch == 1:  # the writer dies after writing, before renaming
                real = checkpoint.write_atomic
                checkpoint.write_atomic = lambda obj, path, before_rename=None: real(
                    obj, path, lambda tmp: os.kill(os.getpid(), signal.SIGKILL))

    t = ember.Trainer(max_epochs=3, enable_progress_bar=False, logger=False,
                      callbacks=[KillOnSecondSave(), ember.callbacks.ModelCheckpoint(dirpath=sys.argv[1])])
    t.fit(Net(), loader())
""")


@pytest.mark.processes
@pytest.mark.timeout(30)
def test_crash_between_write_and_rename_keeps_previous_last(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(_CRASH_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "c"), os.path.dirname(__file__)], capture_output=True, timeout=25
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    names = os.listdir(tmp_path / "c")
    assert "last.ckpt" in names and any(n.endswith(".tmp") for n in names), names
    ckpt = checkpoint.load(str(tmp_path / "c" / "last.ckpt"))
    assert ckpt["progress"]["current_epoch"] == 0 and ckpt["progress"]["epoch_finished"]  # the previous good one
    # A new fit resumes from it despite the stale temporary file beside it.
    t = ember.Trainer(
        max_epochs=2, enable_progress_bar=False, logger=False, callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "c"))]
    )
    t.fit(Net(), loader(), ckpt_path="last")
    assert t.global_step == 8
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path / "c")), "the stale temporary file was not removed"


# ---------------------------------------------------------------------------------------------- bad input
def _fit_from(path: str, module: ember.TrainModule | None = None, tmp_path=None) -> ember.TrainModule:
    module = module or Net()
    t = ember.Trainer(
        max_epochs=3,
        enable_progress_bar=False,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=os.path.dirname(path))],
    )
    t.fit(module, loader(), ckpt_path=path)
    return module


def _bad(tmp_path, ckpt_file: str, make: Any) -> str:
    bad = os.path.join(os.path.dirname(ckpt_file), "bad.ckpt")
    make(bad)
    return bad


def _write_bytes(data: bytes):
    return lambda p: open(p, "wb").write(data)


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("missing", r"No checkpoint file at .*nope.ckpt.*Checkpoints in .*last.ckpt"),
        ("truncated", r"truncated, corrupt"),
        ("empty", r"empty \(0 bytes\)"),
        ("bitflip", r"corrupt: record .* fails its checksum"),
        ("text", r"truncated, corrupt, or not a torch file"),
        ("state_dict", r"not an ember checkpoint.*bare state_dict"),
        ("pickled", r"pickled Python objects.*GLOBAL posix.system"),
        ("other_model", r"does not fit Net: .*missing keys.*net.0.weight.*unexpected keys.*other.weight"),
        ("shape", r"shape mismatches: net.0.weight: checkpoint \(16, 4\) vs module \(8, 4\)"),
        ("newer", r"format version 99, newer than this ember reads"),
    ],
)
def test_bad_checkpoints_give_clear_errors_and_change_nothing(tmp_path, ckpt_file, case, pattern):
    good = open(ckpt_file, "rb").read()
    saved = torch.load(ckpt_file, weights_only=True)
    makers = {
        "missing": lambda p: None,
        "truncated": _write_bytes(good[: len(good) // 2]),
        "empty": _write_bytes(b""),
        "text": _write_bytes(b"hello, not a checkpoint\n"),
        "state_dict": lambda p: torch.save(Net().state_dict(), p),
        "pickled": lambda p: torch.save({**saved, "extra": Evil()}, p),
        "other_model": lambda p: torch.save({**saved, "state_dict": {"other.weight": torch.ones(1)}}, p),
        "shape": lambda p: torch.save({**saved, "state_dict": Net(hidden=16).state_dict()}, p),
        "newer": lambda p: torch.save({**saved, "format_version": 99}, p),
    }
    if case == "bitflip":
        data = bytearray(good)
        data[len(data) // 3] ^= 0xFF
        makers["bitflip"] = _write_bytes(bytes(data))
    path = os.path.join(os.path.dirname(ckpt_file), "nope.ckpt" if case == "missing" else "bad.ckpt")
    makers[case](path)
    before_files = snapshot(os.path.dirname(ckpt_file))
    module = Net()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    expected = CheckpointNotFoundError if case == "missing" else CheckpointError
    with pytest.raises(expected, match=pattern):
        _fit_from(path, module)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items()), "the module was modified"
    assert snapshot(os.path.dirname(ckpt_file)) == before_files, "a file was written or changed"


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_directory_and_optimizer_mismatch_errors(tmp_path, ckpt_file):
    with pytest.raises(CheckpointError, match="is a directory"):
        checkpoint.load(str(tmp_path))

    class TwoGroups(Net):
        def configure_optimizers(self):
            return torch.optim.SGD([{"params": self.net[0].parameters()}, {"params": self.net[2].parameters()}], lr=0.1)

    with pytest.raises(
        CheckpointError,
        match=r"1 optimizer\(s\) and 1 LR scheduler\(s\) but configure_optimizers "
        r"returned 1 and 0",
    ):
        _fit_from(ckpt_file, TwoGroups())


def test_grad_scaler_state_round_trips(tmp_path):
    try:
        torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            torch.ones(2, 2) @ torch.ones(2, 2)
    except Exception:
        pytest.skip("no float16 autocast on this CPU build")
    _, trainer = trained(tmp_path, precision="16-mixed")
    saved = torch.load(tmp_path / "c" / "last.ckpt", weights_only=True)["precision"]
    assert saved["scale"] == trainer._precision.scaler.get_scale() and "_growth_tracker" in saved
    t = ember.Trainer(
        max_epochs=2,
        enable_progress_bar=False,
        logger=False,
        precision="16-mixed",
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "c"))],
    )
    t.fit(Net(), loader(), ckpt_path="last")
    assert t._precision.scaler.get_scale() == saved["scale"]


def test_validation_progress_is_saved_after_the_validation(tmp_path):
    class WithVal(Net):
        def validation_step(self, batch, batch_idx):
            self.log("v", 1.0)

    t = ember.Trainer(
        max_epochs=1,
        enable_progress_bar=False,
        logger=False,
        val_check_interval=0.5,
        num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path), save_top_k=-1)],
    )
    t.fit(WithVal(), loader(), loader())
    mid = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)["progress"]
    assert (mid["batch_in_epoch"], mid["val_checks_in_epoch"]) == (2, 1)


def test_a_missing_file_suggests_only_what_the_caller_accepts(tmp_path):
    missing = str(tmp_path / "nope.ckpt")
    with pytest.raises(CheckpointNotFoundError, match=r"or ckpt_path='last' to resume") as fit:
        _fit_from(missing, Net())

    class Tested(Net):
        def test_step(self, batch: Any, batch_idx: int) -> None:
            pass

    trainer = ember.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    with pytest.raises(CheckpointNotFoundError, match=r"ckpt_path='best' / 'last' for this Trainer's") as test:
        trainer.test(Tested(), loader(), ckpt_path=missing)
    with pytest.raises(CheckpointNotFoundError) as load:
        Net.load_from_checkpoint(missing)
    assert "resume" not in str(test.value) and "ckpt_path" not in str(load.value)
    assert str(load.value).rstrip().endswith("Pass the path of an existing checkpoint.")
    assert "best" not in str(fit.value)
