"""ModelCheckpoint(async_save=True) writes, at every save, what a synchronous save at the same save point
writes, whatever the user's code does to the tensors right after it: an optimizer step, a ``no_grad``
in-place op, a write through ``.data``, a buffer update, an EMA teacher, weight clipping before the next
forward, an optimizer state reset, from any hook.

The reference for each background file is written in the same fit, at the same moment: ``Reference``
saves the checkpoint with a plain ``torch.save`` in the training thread just before the background
writer is handed it. The two files must hold the same records byte for byte (the pickle, every storage)
and load to equal tensors. Each fit saves at every step, so each case is repeated at every save."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint
from ember.checkpoint.background import BackgroundWriter
from tests.callbacks.test_async_checkpoint import Gate, records, writer_threads


class Reference:
    """At every background save, first writes the same checkpoint synchronously, from the live state, with
    ``torch.save`` (the save point: nothing has run since the checkpoint was made)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: str) -> None:
        self.pairs: list[tuple[str, str]] = []  # (background file, its reference)
        original = BackgroundWriter.submit
        os.makedirs(root)

        def submit(writer: BackgroundWriter, obj: Any, path: str, *args: Any, **kwargs: Any) -> None:
            reference = os.path.join(root, f"{len(self.pairs)}.pt")
            torch.save(obj, reference)
            self.pairs.append((path, reference))
            original(writer, obj, path, *args, **kwargs)

        monkeypatch.setattr(BackgroundWriter, "submit", submit)

    def check(self, saves: int) -> None:
        assert len(self.pairs) >= saves  # (every save point of the fit was compared)
        for path, reference in self.pairs:
            a, b = torch.load(path, weights_only=True), torch.load(reference, weights_only=True)
            assert differences(a, b) == [], os.path.basename(path)
            assert records(path) == records(reference), os.path.basename(path)
        last, reference = self.pairs[-1]
        assert records(os.path.join(os.path.dirname(last), "last.ckpt")) == records(reference)


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two loaded checkpoints differ (tensors bitwise, with dtype, shape and stride)."""
    if isinstance(a, torch.Tensor):
        equal = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
        return [] if equal else [where]
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}/{i}")]
    return [] if type(a) is type(b) and a == b else [where]


class Teacher(ember.TrainModule):
    """A student trained by SGD with momentum, a frozen EMA teacher of it (requires_grad=False, never
    stepped) with a large frozen tensor beside it, and a buffer counting batches. ``touch(where)`` is called
    from every hook below; it changes state in place when ``where`` is the chosen hook."""

    def __init__(self, touch: Callable[[str], None], big: int = 2**20) -> None:
        super().__init__()
        self.student = torch.nn.Linear(16, 16)
        self.teacher = torch.nn.Linear(16, 16)
        self.teacher.requires_grad_(False)
        self.frozen = torch.nn.Parameter(torch.zeros(big), requires_grad=False)
        self.register_buffer("seen", torch.zeros(4))
        self.touch = touch

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.touch("on_train_batch_start")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.touch("training_step")  # before the forward, as manual weight clipping is
        (x,) = batch
        return (self.student(x) - self.teacher(x)).pow(2).mean()

    def on_before_zero_grad(self, optimizer: Any) -> None:
        self.touch("on_before_zero_grad")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.touch("on_before_optimizer_step")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.touch("on_train_batch_end")

    def on_train_epoch_start(self) -> None:
        self.touch("on_train_epoch_start")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.student.parameters(), lr=0.1, momentum=0.9)


def data_writes(m: Teacher) -> None:
    m.frozen.data.add_(1.0)  # .data: no version counter sees it
    m.teacher.weight.data.mul_(0.5)


def no_grad_writes(m: Teacher) -> None:
    with torch.no_grad():
        m.frozen.add_(1.0)
        m.teacher.bias.sub_(1.0)


def buffer_writes(m: Teacher) -> None:
    m.seen.add_(1.0)


def ema(m: Teacher) -> None:
    with torch.no_grad():
        for t, s in zip(m.teacher.parameters(), m.student.parameters()):
            t.lerp_(s, 0.5)


def clipping(m: Teacher) -> None:
    m.student.weight.data.clamp_(-0.01, 0.01)  # a parameter the optimizer steps, changed outside the step


def momentum_reset(m: Teacher) -> None:
    for state in m.trainer.optimizers[0].state.values():
        state["momentum_buffer"].mul_(-1.0)


WAYS = {
    "data": data_writes,
    "no_grad": no_grad_writes,
    "buffer": buffer_writes,
    "ema": ema,
    "clipping": clipping,
    "momentum": momentum_reset,
}


def every_way(m: Teacher) -> None:
    for way in WAYS.values():
        way(m)


class Adversary(Callback):
    """A callback calling ``touch(where)`` from its hooks: "after the save" from its step-boundary hook
    (listed after the checkpoint callback) and its epoch-end hook (a metrics-monitoring callback runs
    after it), right after ModelCheckpoint's save point; "callback on_train_batch_end" from that hook."""

    monitors_metrics = True

    def __init__(self, touch: Callable[[str], None]) -> None:
        self.touch = touch

    def on_train_step_boundary(self, trainer: Any, module: Any) -> None:
        self.touch("after the save")

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.touch("after the save")

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.touch("callback on_train_batch_end")


def fit(
    root: str,
    where: str,
    change: Callable[[Teacher], None],
    steps: int = 6,
    accumulate: int = 1,
    every_n_epochs: bool = False,
    big: int = 2**20,
) -> None:
    def touch(hook: str) -> None:
        if hook == where:
            change(module)

    module = Teacher(touch, big)
    cadence: dict[str, Any] = {"every_n_epochs": 1} if every_n_epochs else {"every_n_train_steps": 1}
    cb = ModelCheckpoint(dirpath=root, save_top_k=-1, async_save=True, **cadence)
    after = Adversary(touch)
    ember.seed_everything(0)
    batches = DataLoader(TensorDataset(torch.randn(8 if every_n_epochs else 2 * steps * accumulate, 16)), batch_size=2)
    trainer = ember.Trainer(
        max_steps=steps,
        max_epochs=-1,
        accumulate_grad_batches=accumulate,
        enable_progress_bar=False,
        default_root_dir=root,
        callbacks=[cb, after],
    )
    trainer.fit(module, batches)


HOOKS = ["after the save", "on_train_batch_start", "training_step", "on_before_zero_grad", "on_before_optimizer_step"]


@pytest.mark.parametrize("where", HOOKS)
def test_every_way_of_changing_tensors_right_after_the_save_point_leaves_the_file_as_a_synchronous_save(
    tmp_path, monkeypatch, where
):
    reference = Reference(monkeypatch, str(tmp_path / "reference"))
    fit(str(tmp_path / "ckpts"), where, every_way)
    reference.check(saves=6)
    assert not writer_threads()


@pytest.mark.parametrize("way", sorted(WAYS))
def test_each_way_of_changing_tensors_in_the_next_step_leaves_the_file_as_a_synchronous_save(
    tmp_path, monkeypatch, way
):
    reference = Reference(monkeypatch, str(tmp_path / "reference"))
    fit(str(tmp_path / "ckpts"), "on_train_batch_start", WAYS[way])
    reference.check(saves=6)


@pytest.mark.parametrize("where", ["on_train_batch_end", "callback on_train_batch_end"])
def test_a_hook_of_a_batch_without_an_optimizer_step_changing_tensors_leaves_the_file_as_a_synchronous_save(
    tmp_path, monkeypatch, where
):
    # With two batches a step, the batch after a save point ends (on_train_batch_end) before any step.
    reference = Reference(monkeypatch, str(tmp_path / "reference"))
    fit(str(tmp_path / "ckpts"), where, every_way, steps=6, accumulate=2)
    reference.check(saves=6)


def test_changes_after_an_epoch_end_save_leave_the_file_as_a_synchronous_save(tmp_path, monkeypatch):
    reference = Reference(monkeypatch, str(tmp_path / "reference"))
    fit(str(tmp_path / "ckpts"), "on_train_epoch_start", every_way, steps=16, every_n_epochs=True)
    reference.check(saves=4)
    reference.pairs.clear()
    fit(str(tmp_path / "more"), "after the save", every_way, steps=16, every_n_epochs=True)
    reference.check(saves=4)


def test_a_32_mb_frozen_tensor_changed_right_after_every_save_point(tmp_path, monkeypatch):
    """The case first reported: a 32 MB parameter the optimizer does not step, changed in place through
    ``.data`` and under ``no_grad`` as soon as the save point returns."""
    reference = Reference(monkeypatch, str(tmp_path / "reference"))
    fit(
        str(tmp_path / "ckpts"), "after the save", lambda m: (data_writes(m), no_grad_writes(m)), steps=4, big=8 * 2**20
    )
    reference.check(saves=4)


def test_the_writer_reads_nothing_of_the_live_state_once_submit_returns(tmp_path, monkeypatch):
    """Every byte is taken before ``submit`` returns: the write is held until the live tensors were
    changed in every way and freed, and the file still holds their state at the submit."""
    gate = Gate(monkeypatch, hold="x.ckpt")
    weight = torch.nn.Parameter(torch.randn(64, 64))
    base = torch.arange(12.0)
    state = {"w": weight, "view": base[2:6].view(2, 2), "base": base, "meta": {"n": 3, "s": [base[:1]]}}
    expected = {"w": weight.detach().clone(), "base": base.clone()}
    writer = BackgroundWriter()
    writer.submit(state, str(tmp_path / "x.ckpt"))
    weight.data.mul_(2)
    with torch.no_grad():
        weight.add_(1)
    base.zero_()
    base.set_(torch.full((12,), 7.0))  # the old storage may be freed and reused
    del state
    gate.released.set()
    writer.close(raise_errors=True)
    loaded = torch.load(tmp_path / "x.ckpt", weights_only=True)
    assert torch.equal(loaded["w"], expected["w"]) and torch.equal(loaded["base"], expected["base"])
    assert torch.equal(loaded["view"], expected["base"][2:6].view(2, 2))
    assert torch.equal(loaded["meta"]["s"][0], expected["base"][:1]) and loaded["meta"]["n"] == 3
