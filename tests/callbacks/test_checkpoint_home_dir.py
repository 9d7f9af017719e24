"""``~`` in a checkpoint callback's ``dirpath`` is the user's home folder (Lightning's ModelCheckpoint expands it;
ember's OnExceptionCheckpoint does too, where Lightning's would make a folder named ``~``)."""

from __future__ import annotations

import os

from ember.callbacks import ModelCheckpoint, OnExceptionCheckpoint


def test_tilde_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ModelCheckpoint(dirpath="~/runs/ckpts").dirpath == os.path.join(str(tmp_path), "runs", "ckpts")
    exc = OnExceptionCheckpoint(dirpath="~/crash", filename="boom")
    assert exc.ckpt_path == os.path.join(str(tmp_path), "crash", "boom.ckpt")
