"""Sharded checkpoint directories (``ember/checkpoint/sharded.py``) in one process: the write is atomic, a
damaged directory is refused before anything loads, and nothing but a checkpoint's directory is ever replaced
or removed. (Written and read by 2 ranks: ``tests/strategies/test_fsdp.py``.)"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from ember.checkpoint import sharded
from ember.checkpoint.atomic import rename_over
from ember.checkpoint.files import remove_checkpoint
from ember.checkpoint.format import CheckpointError
from ember.checkpoint.reading import load
from ember.checkpoint.temporaries import remove_stale_temporaries, temporary_prefix

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled")


def checkpoint(value: float) -> dict:
    return {
        "format": "ember.checkpoint",
        "format_version": 1,
        "state_dict": {"w": torch.full((4, 3), value), "b": torch.arange(3.0)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.full((4, 3), value)}}}],
        "progress": {"global_step": 7},
    }


def write(path: str, value: float, before_rename=None) -> None:
    # Every 2-d tensor is a "shard" here: one process plays every rank (DCP writes without a group).
    plain, shards = sharded.split(checkpoint(value), lambda v: isinstance(v, torch.Tensor) and v.dim() == 2)
    temporary = os.path.join(os.path.dirname(path), temporary_prefix(path) + "test.tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded.write(
            plain, shards, path, temporary, is_writer=True, barrier=lambda name: None, before_rename=before_rename
        )


def test_a_written_directory_reads_back_whole_with_its_placeholders_filled(tmp_path):
    path = str(tmp_path / "last.ckpt")
    write(path, 1.5)
    assert sharded.is_sharded(path)
    got = load(path)
    assert torch.equal(got["state_dict"]["w"], torch.full((4, 3), 1.5))
    assert torch.equal(got["state_dict"]["b"], torch.arange(3.0))  # kept in meta.pt, not a shard
    assert torch.equal(got["optimizer_states"][0]["state"][0]["exp_avg"], torch.full((4, 3), 1.5))
    assert got["progress"] == {"global_step": 7}
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []


def test_a_second_write_replaces_the_first_and_a_crash_before_the_rename_keeps_it(tmp_path):
    path = str(tmp_path / "last.ckpt")
    write(path, 1.0)
    write(path, 2.0)
    assert torch.equal(load(path)["state_dict"]["w"], torch.full((4, 3), 2.0))

    def crash(temporary: str) -> None:
        raise KeyboardInterrupt("killed before the rename")

    with pytest.raises(KeyboardInterrupt):
        write(path, 3.0, before_rename=crash)
    assert torch.equal(load(path)["state_dict"]["w"], torch.full((4, 3), 2.0))  # the previous one, whole
    left = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(left) == 1  # the crashed write's directory, named as a temporary of this (live) process
    assert remove_stale_temporaries(str(tmp_path)) == []  # its writer is alive: kept


def test_a_dead_writers_temporary_directory_is_reaped(tmp_path):
    stale = tmp_path / f".last.ckpt~{temporary_prefix('x').split('~')[1]}~999999999~abcd.tmp"
    (stale / "sub").mkdir(parents=True)
    (stale / "meta.pt").write_bytes(b"partial")
    assert remove_stale_temporaries(str(tmp_path)) == [stale.name]
    assert not stale.exists()


def test_a_file_and_a_checkpoint_directory_replace_each_other(tmp_path):
    path = str(tmp_path / "last.ckpt")
    write(path, 1.0)
    other = tmp_path / "file.tmp"
    torch.save({"x": 1}, other)
    rename_over(str(other), path)  # a single-file checkpoint over a sharded one
    assert os.path.isfile(path) and torch.load(path)["x"] == 1
    write(path, 4.0)  # and a sharded one over the file
    assert torch.equal(load(path)["state_dict"]["w"], torch.full((4, 3), 4.0))


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced_nor_removed(tmp_path):
    mine = tmp_path / "last.ckpt"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    source = tmp_path / "new.tmp"
    torch.save({}, source)
    with pytest.raises(IsADirectoryError, match="not a checkpoint"):
        rename_over(str(source), str(mine))
    remove_checkpoint(str(mine), str(tmp_path), set())
    assert (mine / "notes.txt").read_text() == "mine"


def test_rotation_removes_a_checkpoint_directory(tmp_path):
    path = str(tmp_path / "epoch=0.ckpt")
    write(path, 1.0)
    remove_checkpoint(path, str(tmp_path), set())
    assert not os.path.exists(path)


@pytest.mark.parametrize("damage", ["missing shard", "truncated shard", "no metadata", "bad meta"])
def test_a_damaged_directory_is_refused_before_anything_loads(tmp_path, damage):
    path = tmp_path / "last.ckpt"
    write(str(path), 1.0)
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    if damage == "missing shard":
        shard.unlink()
    elif damage == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:10])
    elif damage == "no metadata":
        (path / ".metadata").unlink()
    else:
        (path / "meta.pt").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="sharded checkpoint"):
        load(str(path))


def test_a_plain_directory_is_still_refused_as_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="is a directory"):
        load(str(tmp_path))


def test_consolidate_makes_one_file_that_loads_as_the_directory(tmp_path):
    from ember.checkpoint import consolidate

    path = str(tmp_path / "last.ckpt")
    write(path, 2.5)
    one = consolidate(path, str(tmp_path / "one.ckpt"))
    assert os.path.isfile(one)
    got, want = load(one), load(path)
    assert torch.equal(got["state_dict"]["w"], want["state_dict"]["w"])
    assert torch.equal(got["optimizer_states"][0]["state"][0]["exp_avg"], torch.full((4, 3), 2.5))
    with pytest.raises(CheckpointError, match="not a sharded checkpoint"):
        consolidate(one, str(tmp_path / "two.ckpt"))
    with pytest.raises(ValueError, match="outside the directory"):
        consolidate(path, os.path.join(path, "inside.ckpt"))
