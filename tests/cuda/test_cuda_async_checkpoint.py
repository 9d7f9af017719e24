"""Background checkpoints (``ModelCheckpoint(async_save=True)``) on CUDA: the state is copied to
pinned host memory at the save point and written by a thread while training goes on. The files
hold the same values as synchronous saves, and a resume from one continues exactly; a save made while
the GPU is busy returns without waiting for it, and a write into the weights right after it does not
reach the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ember.callbacks import Callback, ModelCheckpoint
from ember.checkpoint import BackgroundSave
from tests.cuda.cuda_helpers import MLP, loader, needs_cuda, trainer

pytestmark = [needs_cuda, pytest.mark.timeout(120)]


def run(root: Path, async_save: bool, epochs: int = 2, ckpt_path: str | None = None) -> tuple[MLP, list[str]]:
    ck = ModelCheckpoint(dirpath=str(root / "ck"), every_n_train_steps=1, save_top_k=-1, async_save=async_save)
    t = trainer(max_epochs=epochs, enable_checkpointing=True, default_root_dir=str(root), callbacks=[ck])
    module = MLP()
    t.fit(module, loader(), ckpt_path=ckpt_path)
    return module, sorted(os.listdir(root / "ck"))


def test_background_saves_on_cuda_hold_what_synchronous_saves_hold_and_resume_exactly(tmp_path):
    sync_module, sync_files = run(tmp_path / "sync", async_save=False)
    async_module, async_files = run(tmp_path / "async", async_save=True)
    assert async_files == sync_files and "epoch=0-step=2.ckpt" in async_files
    for name in sync_files:
        a = torch.load(tmp_path / "sync" / "ck" / name, map_location="cpu", weights_only=True)
        b = torch.load(tmp_path / "async" / "ck" / name, map_location="cpu", weights_only=True)
        assert a["global_step"] == b["global_step"], name
        for k, v in a["state_dict"].items():
            assert torch.equal(v, b["state_dict"][k]), (name, k)
        for (k, s), t in zip(a["optimizer_states"][0]["state"].items(), b["optimizer_states"][0]["state"].values()):
            assert torch.equal(s["momentum_buffer"], t["momentum_buffer"]), (name, k)
    for k, v in sync_module.state_dict().items():
        assert torch.equal(v, async_module.state_dict()[k]), k
    # Resume from a file written in the background, mid-run: the rest of the run is the same.
    resumed, _ = run(
        tmp_path / "async", async_save=True, ckpt_path=str(tmp_path / "async" / "ck" / "epoch=0-step=2.ckpt")
    )
    for k, v in sync_module.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


class Wide(MLP):
    """An MLP with a 64 MiB layer: copying its state to the host takes milliseconds, not microseconds."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = torch.nn.Parameter(torch.zeros(4096, 4096))

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 0.0 * self.wide.sum()


class SaveWhileTheGpuIsBusyThenWrite(Callback):
    """At batch 1's end: queues ~0.2 s of GPU work, saves in the background, then at once writes into the
    weights in place (as an EMA update, weight clipping or a ``.data`` edit in the next hook would). The file
    must hold the weights of the save point: what the copy enqueued before the write read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.expected: dict[str, torch.Tensor] = {}
        self.returned_before_the_copy = False

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx != 1:
            return
        self.expected = {k: v.detach().clone() for k, v in module.state_dict().items()}  # queued: this point
        torch.cuda._sleep(400_000_000)
        trainer.save_checkpoint(self.path, storage_options=BackgroundSave())
        copied = torch.cuda.Event()
        copied.record()
        self.returned_before_the_copy = not copied.query()  # the save did not wait for the GPU
        with torch.no_grad():
            module.wide.data.add_(1.0)
            for p in module.net.parameters():
                p.mul_(-3.0)


def test_a_background_save_holds_the_save_points_weights_when_they_are_written_right_after(tmp_path):
    module, spy = Wide(), SaveWhileTheGpuIsBusyThenWrite(tmp_path / "at_batch_1.ckpt")
    t = trainer(max_epochs=1, enable_checkpointing=False, callbacks=[spy])
    t.fit(module, loader())
    assert spy.returned_before_the_copy, "the background save waited for the GPU"
    saved = torch.load(spy.path, map_location="cpu", weights_only=True)["state_dict"]
    assert spy.expected.keys() == saved.keys()
    for k, v in spy.expected.items():
        assert torch.equal(saved[k], v.cpu()), k
    assert not torch.equal(module.wide.detach().cpu(), saved["wide"])  # the write did happen, after the copy
