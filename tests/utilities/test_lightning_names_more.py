"""Lightning's utilities names added to ``ember.utilities``: ``LightningEnum``, ``GradClipAlgorithmType``,
``rank_zero_deprecation``, ``disable_possible_user_warnings``, ``suggested_max_num_workers`` and
``is_shared_filesystem``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import ember
from ember.exceptions import PossibleUserWarning
from ember.utilities import (
    GradClipAlgorithmType,
    LightningEnum,
    disable_possible_user_warnings,
    is_shared_filesystem,
    rank_zero_deprecation,
    rank_zero_only,
    suggested_max_num_workers,
)
from ember.utilities import system as system_mod
from tests.helpers.models import BoringModel, regression_loader


def test_enums():
    class Color(LightningEnum):
        RED = "Red"

    assert Color.RED == "red" and Color.from_str("RED") is Color.RED
    assert GradClipAlgorithmType.NORM == "norm" and GradClipAlgorithmType("value") is GradClipAlgorithmType.VALUE
    assert GradClipAlgorithmType.supported_type("norm") and not GradClipAlgorithmType.supported_type("l2")
    assert GradClipAlgorithmType.supported_types() == ["value", "norm"]


def test_rank_zero_deprecation_warns_on_rank_zero_only(monkeypatch):
    with pytest.warns(DeprecationWarning, match="old thing"):
        rank_zero_deprecation("old thing")
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rank_zero_deprecation("not on rank one")


def test_disable_possible_user_warnings_silences_the_logging_interval_hint(tmp_path):
    def fit():
        t = ember.Trainer(max_epochs=1, limit_train_batches=2, num_sanity_val_steps=0, enable_checkpointing=False,
                          enable_progress_bar=False, logger=ember.loggers.CSVLogger(str(tmp_path)),
                          log_every_n_steps=50)  # fmt: skip
        t.fit(BoringModel(), regression_loader())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit()
    assert any(issubclass(w.category, PossibleUserWarning) and "logging interval" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        disable_possible_user_warnings()
        fit()
    assert not any(issubclass(w.category, PossibleUserWarning) for w in caught)
    assert issubclass(PossibleUserWarning, UserWarning)


def test_suggested_max_num_workers(monkeypatch):
    monkeypatch.setattr(system_mod, "_cpus_available", lambda: 16)
    assert [suggested_max_num_workers(n) for n in (1, 2, 4, 8, 16, 32)] == [15, 7, 3, 1, 1, 1]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="local_world_size"):
            suggested_max_num_workers(bad)


class Rank:
    """One rank's view of a two-process job: ``broadcast`` returns what rank zero sent."""

    world_size = 2

    def __init__(self, rank: int, sent: dict) -> None:
        self.global_rank, self.sent = rank, sent

    def broadcast(self, obj, src=0):
        if self.global_rank == 0:
            self.sent.setdefault("objs", []).append(obj)
            return obj
        return self.sent["objs"].pop(0)

    def reduce_boolean_decision(self, decision, all=True):
        return decision


def test_is_shared_filesystem(tmp_path):
    assert is_shared_filesystem(ember.Trainer(logger=False).strategy, tmp_path)  # one process
    assert is_shared_filesystem(Rank(0, {}), "s3://bucket/run")
    sent: dict = {}
    assert is_shared_filesystem(Rank(0, sent), tmp_path)  # rank zero finds its own file, then removes it
    assert list(tmp_path.iterdir()) == []
    # Rank one, told of a probe file it cannot see (rank zero's machine wrote it): not shared.
    sent = {"objs": [tmp_path.resolve(), str(tmp_path / "elsewhere" / ".ember_shared_fs_x")]}
    assert not is_shared_filesystem(Rank(1, sent), tmp_path, timeout=0.2)
    # Rank zero's folder is another path than rank one's: not shared, nothing written.
    sent = {"objs": [Path("/another/folder")]}
    assert not is_shared_filesystem(Rank(1, sent), tmp_path)
