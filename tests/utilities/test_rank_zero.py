"""rank_zero_only / rank_zero_info / rank_zero_warn: the rank read from the launcher's environment at import,
and what runs on rank zero and elsewhere (expected values from Lightning 2.6.6's same calls)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest
from lightning_utilities.core import rank_zero as lightning_utilities_rank_zero

from ember.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from ember.utilities.rank_zero import rank_from_environment

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID")


def test_the_decorator_is_lightning_utilities_one():
    """One rank for Lightning's helpers and ember's in one process."""
    assert rank_zero_only is lightning_utilities_rank_zero.rank_zero_only
    assert rank_zero_warn is lightning_utilities_rank_zero.rank_zero_warn


@pytest.mark.parametrize(
    "env, rank",
    [
        ({}, None),
        ({"RANK": "1"}, 1),
        ({"LOCAL_RANK": "2"}, 2),
        ({"SLURM_PROCID": "3"}, 3),
        ({"RANK": "0", "SLURM_PROCID": "3"}, 0),  # RANK first
        ({"LOCAL_RANK": "1", "SLURM_PROCID": "0"}, 1),  # LOCAL_RANK before SLURM_PROCID
    ],
)
def test_rank_from_environment(monkeypatch, env, rank):
    for name in _RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert rank_from_environment() == rank


_PROBE = """
import warnings
from ember.utilities import rank_zero_only, rank_zero_warn
@rank_zero_only
def double(x):
    return 2 * x
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    rank_zero_warn("careful")
print(rank_zero_only.rank, double(3), rank_zero_only(lambda: 1, default="skip")(), len(caught))
"""


@pytest.mark.processes
@pytest.mark.parametrize(
    "env, expected",
    [
        # Lightning 2.6.6 in the same environments: rank, the decorated call, one with a default, warnings.
        ({}, "0 6 1 1"),
        ({"RANK": "1"}, "1 None skip 0"),
        ({"SLURM_PROCID": "3"}, "3 None skip 0"),
        ({"LOCAL_RANK": "1", "SLURM_PROCID": "0"}, "1 None skip 0"),
    ],
)
def test_rank_is_set_at_import_from_the_environment(env, expected):
    clean = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**clean, **env}, capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split("\n")[-2] == expected


@pytest.mark.processes
def test_a_rank_set_before_import_is_kept():
    """A rank set already (by Lightning's import, or a strategy) wins over the environment."""
    probe = (
        "from lightning_utilities.core.rank_zero import rank_zero_only\n"
        "rank_zero_only.rank = 5\n"
        "import ember.utilities\n"
        "print(rank_zero_only.rank)"
    )
    env = {**os.environ, "RANK": "1"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "5"


@pytest.fixture
def rank(monkeypatch):
    def set_rank(value: int) -> None:
        monkeypatch.setattr(rank_zero_only, "rank", value)

    return set_rank


def _caller_logs_and_warns() -> list[warnings.WarningMessage]:
    rank_zero_info("hello %s", "w")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rank_zero_warn("careful")
        rank_zero_warn("dep", category=DeprecationWarning)
    return caught


def test_info_and_warnings_on_rank_zero_name_the_caller(rank, caplog):
    rank(0)
    with caplog.at_level(logging.INFO, logger="ember"):
        caught = _caller_logs_and_warns()
    # Lightning: one INFO record "hello w" from this file's caller; UserWarning and DeprecationWarning from it.
    [record] = [r for r in caplog.records if r.getMessage() == "hello w"]
    assert record.levelname == "INFO" and record.name.startswith("ember.")
    assert (record.filename, record.funcName) == (os.path.basename(__file__), "_caller_logs_and_warns")
    assert [(w.category, str(w.message), w.filename) for w in caught] == [
        (UserWarning, "careful", __file__),
        (DeprecationWarning, "dep", __file__),
    ]


def test_other_ranks_stay_quiet(rank, caplog):
    rank(1)
    with caplog.at_level(logging.INFO, logger="ember"):
        caught = _caller_logs_and_warns()
    assert not [r for r in caplog.records if r.getMessage() == "hello w"]
    assert caught == []


def _rank_after_joining(rank: int, world: int) -> int:
    from ember.strategies.ddp import DDPStrategy
    from tests.helpers.dist import join_as_rank

    join_as_rank(rank, world)
    rank_zero_only.rank = 0  # what a spawned worker read at import, before its rank was in the environment
    strategy = DDPStrategy(accelerator="cpu")
    strategy.setup_environment()
    try:
        return rank_zero_only.rank
    finally:
        strategy.teardown()


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_ddp_rank_sets_the_rank_zero_helpers_rank_when_it_joins():
    from tests.helpers.dist import run_ranks

    assert run_ranks(_rank_after_joining, 2, timeout=50) == [0, 1]
