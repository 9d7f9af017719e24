"""The CPU stand-in for tests/cuda/test_cuda_sync.py: a step that is not a logging step reads no tensor value
on the host.

On CUDA such a read (``item``, ``tolist``, ``bool``, ``float``, a copy to the CPU) makes the host wait for
the device. The CUDA suite checks the synchronisations themselves, on a machine with a GPU; this checks the
same steady state here, on every run: the trainer's code paths do not depend on the device (``self.log``
keeps values as tensors and accumulates them in place), so a read added to them shows on the CPU too. A
``TorchFunctionMode`` sees every tensor method call, the trainer's included, from ``on_train_batch_start``
to ``on_train_batch_end`` (the bar, which may read when it redraws, runs after it).
"""

from __future__ import annotations

import io
import traceback
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import ember
import ember.checkpoint.contents as contents
from ember.callbacks import Callback, ModelCheckpoint, ProgressBar
from ember.loggers import TensorBoardLogger
from tests.cuda.cuda_helpers import MLP, SYNC_MODULES, loader
from tests.cuda.cuda_helpers import SYNC_LOG_EVERY as LOG_EVERY

#: What makes the host wait for a CUDA device: the value is read, or copied to the CPU (``.to("cpu")`` is left
#: out: here every tensor is on the CPU already, and the module's ``y.to(out.device)`` is no copy).
HOST_READS = frozenset(
    {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.numpy,
        torch.Tensor.cpu,
        torch.Tensor.__bool__,
        torch.Tensor.__float__,
        torch.Tensor.__int__,
        torch.Tensor.__index__,
        torch.Tensor.__format__,
        torch.Tensor.__repr__,
    }
)


class RecordHostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in HOST_READS:
            where = "".join(traceback.format_stack(limit=4)[:-1])
            self.reads.append(f"{getattr(func, '__name__', func)} at\n{where}")
        return func(*args, **(kwargs or {}))


class WatchSteps(Callback):
    """Records the host reads of every step but each epoch's first (which may create state) and the logging
    steps, and counts the logging steps' reads apart. A step is watched from ``on_train_batch_start`` to
    ``on_train_batch_end`` or (``to_next``) to the next batch's start: the loop's work after the hooks, the
    logger's writes included (the last batch of an epoch, followed by the epoch's end, is then left out)."""

    def __init__(self, to_next: bool = False) -> None:
        self.to_next = to_next
        self.mode: RecordHostReads | None = None
        self.logging = False
        self.watched_steps = 0
        self.reads: list[str] = []  # in watched steps
        self.logging_step_reads = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._close()
        self.logging = (trainer.global_step + 1) % LOG_EVERY == 0
        if batch_idx > 0:
            self.mode = RecordHostReads()
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        # Listed before the progress bar, which the Trainer appends after the user's callbacks.
        if not self.to_next:
            self._close()

    def on_train_epoch_end(self, trainer, module):
        self._close(count=False)

    def on_exception(self, trainer, module, exception):
        self._close(count=False)

    def _close(self, count: bool = True) -> None:
        if self.mode is None:
            return
        self.mode.__exit__(None, None, None)
        if count and self.logging:
            self.logging_step_reads += len(self.mode.reads)
        elif count:
            self.watched_steps += 1
            self.reads += self.mode.reads
        self.mode = None


def fit(tmp_path, module: ember.TrainModule, precision: str = "32-true", bar: bool = True) -> WatchSteps:
    watch = WatchSteps(to_next=not bar)
    trainer = ember.Trainer(
        accelerator="cpu",
        max_epochs=2,
        precision=precision,
        log_every_n_steps=LOG_EVERY,
        default_root_dir=tmp_path,
        logger=TensorBoardLogger(save_dir=tmp_path),
        enable_progress_bar=bar,
        callbacks=[watch, ProgressBar(mode="bar", stream=io.StringIO())] if bar else [watch],
        num_sanity_val_steps=0,
    )
    trainer.fit(module, loader(n=256))
    assert trainer.global_step == 32
    return watch


@pytest.mark.parametrize("module", SYNC_MODULES)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_steps_other_than_logging_steps_read_no_tensor_on_the_host(tmp_path, precision, module):
    watch = fit(tmp_path, SYNC_MODULES[module](), precision)
    assert watch.watched_steps >= 20
    assert not watch.reads, "\n".join(watch.reads[:3])


@pytest.mark.parametrize("module", SYNC_MODULES)
def test_the_loop_after_the_hooks_reads_only_to_write_the_logs(tmp_path, module):
    watch = fit(tmp_path, SYNC_MODULES[module](), bar=False)
    assert watch.watched_steps >= 20
    assert not watch.reads, "\n".join(watch.reads[:3])
    # The recorder sees the trainer's own reads: a logging step copies the logged values for the logger.
    assert watch.logging_step_reads > 0


class ReadsItsLoss(MLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.last = loss.item()
        return loss


def test_the_recorder_sees_a_read_in_user_code(tmp_path):
    watch = fit(tmp_path, ReadsItsLoss())
    assert len(watch.reads) == watch.watched_steps
    assert all(r.startswith("item at") and "self.last = loss.item()" in r for r in watch.reads)


class RecordHostReadsAndCopies(RecordHostReads):
    """Also records ``.to(...)`` towards the CPU: on CUDA a copy that makes the host wait for the device."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.to and any(_names_the_cpu(a) for a in (*args[1:], *(kwargs or {}).values())):
            self.reads.append("to(cpu) at\n" + "".join(traceback.format_stack(limit=4)[:-1]))
        return super().__torch_function__(func, types, args, kwargs)


def _names_the_cpu(arg: Any) -> bool:
    return arg == "cpu" or isinstance(arg, torch.device) and arg.type == "cpu"


@pytest.mark.parametrize("module", SYNC_MODULES)
def test_a_background_save_reads_no_tensor_on_the_host(tmp_path, monkeypatch, module):
    # ModelCheckpoint(async_save=True) exists so that a save costs the step a copy and no more: on CUDA a read
    # of a value (or a copy to the CPU) anywhere in the save would make the host wait for the GPU at every save.
    saves: list[list[str]] = []
    save = contents.save

    def watched_save(*args: Any, **kwargs: Any) -> str:
        with RecordHostReadsAndCopies() as mode:
            path = save(*args, **kwargs)
        saves.append(mode.reads)
        return path

    monkeypatch.setattr(contents, "save", watched_save)
    every_step = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, async_save=True)
    trainer = ember.Trainer(
        accelerator="cpu",
        max_epochs=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        callbacks=[every_step],
        num_sanity_val_steps=0,
    )
    trainer.fit(SYNC_MODULES[module](), loader(n=64))
    assert len(saves) == trainer.global_step == 4
    reads = [r for reads in saves for r in reads]
    assert not reads, "\n".join(reads[:3])
