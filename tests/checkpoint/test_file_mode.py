"""Checkpoint files get the permissions any other file the job writes gets: 0o666 less the umask, or the
mode of the file they replace (a temporary file's 0o600 would hide them from a team on a shared disk)."""

from __future__ import annotations

import os
import stat

import pytest

import ember
from ember.checkpoint import write_atomic
from tests.helpers.models import BoringModel, regression_loader


@pytest.fixture
def umask():
    def set_mask(mask: int) -> None:
        os.umask(mask)

    old = os.umask(0o022)
    yield set_mask
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_a_new_checkpoint_honours_the_umask(tmp_path, umask, mask, expected):
    umask(mask)
    path = tmp_path / "a.ckpt"
    write_atomic({"x": 1}, str(path))
    assert _mode(path) == expected
    write_atomic({"x": 1}, str(tmp_path / "b.ckpt"), background=True)  # the background writer's path too
    assert _mode(tmp_path / "b.ckpt") == expected


def test_a_replaced_checkpoint_keeps_its_mode(tmp_path, umask):
    path = tmp_path / "last.ckpt"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    write_atomic({"x": 1}, str(path))
    assert _mode(path) == 0o640


def test_the_default_trainers_checkpoints_are_readable_by_the_group(tmp_path, umask):
    umask(0o027)
    trainer = ember.Trainer(max_epochs=1, default_root_dir=tmp_path, accelerator="cpu", enable_progress_bar=False)
    trainer.fit(BoringModel(), regression_loader(), regression_loader())
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".ckpt")]
    assert files and {_mode(f) for f in files} == {0o640}
