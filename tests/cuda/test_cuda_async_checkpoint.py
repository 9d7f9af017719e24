"""Background checkpoints (``ModelCheckpoint(async_save=True)``) on CUDA: the state is copied to
pinned host memory at the save point and written by a thread while training goes on. The files
hold the same values as synchronous saves, and a resume from one continues exactly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ember.callbacks import ModelCheckpoint
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
