"""The file format holds: a checkpoint written by an earlier ember (``fixtures/mid_epoch_v1.ckpt``, see
``fixture_run.py``) resumes to the weights that ember's own resume ended with, ``load_from_checkpoint``
reads it, and this ember writes the same entries at the same point of the same fit."""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import torch

import ember
from tests.checkpoint.fixture_run import (
    DIR_IN_FIXTURE,
    EXPECTED,
    FIXTURE,
    SAVED_AT,
    FixtureData,
    FixtureNet,
    _relative,
    fit,
)


def expected() -> dict[str, Any]:
    with open(EXPECTED, encoding="utf-8") as fh:
        return json.load(fh)


def resume_from_fixture(tmp_path: Any) -> tuple[FixtureNet, ember.Trainer]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "old.ckpt"
    shutil.copyfile(FIXTURE, path)  # (nothing of the run writes next to the fixture)
    # The fixture's ModelCheckpoint wrote elsewhere: its top-k list is not carried over, with a warning.
    with pytest.warns(UserWarning, match="not carried over"):
        return fit(str(tmp_path / "run"), ckpt_path=str(path))


def test_a_checkpoint_of_the_earlier_format_resumes_to_the_weights_its_own_ember_ended_with(tmp_path):
    module, trainer = resume_from_fixture(tmp_path)
    assert trainer.global_step == 16 and trainer.ckpt_path.endswith("old.ckpt")
    # The fixture's numbers are float32 results of another machine's CPU kernels: equal there bit for bit (the
    # earlier ember checked its resume against an uninterrupted run when it wrote them), here within rounding.
    for name, value in expected()["final_weights"].items():
        torch.testing.assert_close(module.state_dict()[name], torch.tensor(value), rtol=1e-5, atol=1e-6)


def test_the_resume_from_the_earlier_format_continues_exactly(tmp_path):
    # On this machine: resuming the fixture once, or stopping after step 6 and resuming that, ends the same.
    whole, _ = resume_from_fixture(tmp_path / "whole")
    first = tmp_path / "first"
    resume_from_fixture(first)
    again, _ = fit(str(tmp_path / "again"), ckpt_path=str(first / "run" / DIR_IN_FIXTURE / "epoch=0-step=6.ckpt"))
    for name, value in whole.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


def test_load_from_checkpoint_reads_the_earlier_format():
    ckpt = ember.checkpoint.load(FIXTURE)
    module = FixtureNet.load_from_checkpoint(FIXTURE)
    assert module.hparams.lr == 0.05
    for name, value in ckpt["state_dict"].items():
        assert torch.equal(module.state_dict()[name], value), name
    assert FixtureData.load_from_checkpoint(FIXTURE).made == 1


def _same_layout(ours: Any, theirs: Any, where: str = "checkpoint") -> None:
    """The same keys, types and shapes all the way down; the same values, floats within rounding (another
    machine computed the fixture's), versions aside."""
    assert type(ours) is type(theirs), (where, type(ours), type(theirs))
    if isinstance(ours, dict):
        assert set(ours) == set(theirs), (where, set(ours) ^ set(theirs))
        for key in ours:
            if key not in ("ember_version", "torch_version"):
                _same_layout(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same_layout(a, b, f"{where}[{i}]")
    elif isinstance(ours, torch.Tensor):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, where
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=where)
    elif isinstance(ours, float):
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), where
    else:
        assert ours == theirs, where


def test_this_ember_writes_the_entries_of_the_earlier_format_at_the_same_point(tmp_path):
    root = tmp_path / "run"
    fit(str(root))
    ours = torch.load(root / DIR_IN_FIXTURE / f"epoch=0-step={SAVED_AT}.ckpt", weights_only=True)
    ours["callbacks"] = _relative(ours["callbacks"], str(root))
    theirs = torch.load(FIXTURE, weights_only=True)
    assert set(ours) == set(expected()["keys"])
    _same_layout(ours, theirs)
