"""ModelCheckpoint(async_save=True) copies the parameters and optimizer states (what only an optimizer
step changes) on the background thread while the next batch's forward and backward run: every
optimizer's next step waits for those copies, and a tensor changed in place outside a step before it
was copied fails that save loudly instead of writing a torn checkpoint."""
from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from ember.callbacks import Callback, checkpoint_writer
from tests.callbacks.test_async_checkpoint import run, same, writer_threads


class HeldCopies:
    """Holds the background thread's deferred copies until ``release`` (10 s at most)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.original = checkpoint_writer._bytes
        self.released = threading.Event()
        self.held = 0
        monkeypatch.setattr(checkpoint_writer, "_bytes", self.bytes)

    def bytes(self, storage: torch.UntypedStorage) -> torch.Tensor:
        if threading.current_thread().name == "ember-checkpoint-writer" and not self.released.is_set():
            self.held += 1
            assert self.released.wait(10), "never released"
        return self.original(storage)


class ReleaseLater(Callback):
    """Releases the held copies a while after the next step starts (the step must wait for them)."""

    def __init__(self, held: HeldCopies) -> None:
        self.held = held

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        if not self.held.released.is_set():
            threading.Timer(0.3, self.held.released.set).start()


def test_the_next_optimizer_step_waits_for_the_copies_of_the_save_before(tmp_path, monkeypatch):
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    run(sync_dir, False, max_steps=3, epochs=1)
    held = HeldCopies(monkeypatch)
    run(async_dir, True, max_steps=3, epochs=1, extra=[ReleaseLater(held)])
    assert held.held >= 1  # the copies really were held past the save point
    for name in sorted(os.listdir(sync_dir)):
        a = torch.load(os.path.join(async_dir, name), weights_only=True)
        b = torch.load(os.path.join(sync_dir, name), weights_only=True)
        for key in ("state_dict", "optimizer_states", "global_step"):  # before the next step, not after
            assert same(a[key], b[key], async_dir, sync_dir), (name, key)
    assert not writer_threads()


class ChangesWeightsInPlace(Callback):
    """After the first save, changes a weight in place outside the optimizer, then lets the copies go."""

    def __init__(self, held: HeldCopies) -> None:
        self.held = held

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            with torch.no_grad():
                module.net[0].weight.mul_(0.5)
            self.held.released.set()


def test_a_weight_changed_in_place_before_it_was_copied_fails_the_save_not_the_file(tmp_path, monkeypatch):
    held = HeldCopies(monkeypatch)
    with pytest.raises(RuntimeError, match=r"changed in place after the save point, before the background copy "
                                           r"of them was complete, so .*epoch=0-step=1.ckpt was not written"):
        run(str(tmp_path), True, max_steps=3, epochs=1, extra=[ChangesWeightsInPlace(held)])
    assert "epoch=0-step=1.ckpt" not in os.listdir(tmp_path)
    assert not writer_threads()
