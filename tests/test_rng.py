"""ember.rng: generator states as plain data and as the flat tensor ranks exchange."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ember import rng
from ember.rng import capture_rng, rng_from_tensor, rng_to_tensor


def with_gpus(state: dict, seed: int, count: int = 2) -> dict:
    """``state`` with ``count`` synthetic CUDA generator states (what get_rng_state_all returns)."""
    g = torch.Generator().manual_seed(seed)
    return {**state, "cuda": [torch.randint(0, 256, (16,), dtype=torch.uint8, generator=g) for _ in range(count)]}


def test_cuda_states_survive_the_flat_form():
    state = with_gpus(capture_rng(), seed=1)
    back = rng_from_tensor(rng_to_tensor(state), state)
    assert len(back["cuda"]) == 2
    for a, b in zip(back["cuda"], state["cuda"]):
        assert a.dtype == torch.uint8 and torch.equal(a, b)
    assert torch.equal(back["torch"], state["torch"])
    assert rng_from_tensor(rng_to_tensor(capture_rng()), capture_rng())["cuda"] == []  # no GPU: none


def test_a_multi_rank_checkpoint_keeps_every_ranks_cuda_states(monkeypatch):
    # What a 2-rank job on GPUs writes: each rank's own CUDA states, gathered as flat tensors.
    mine = with_gpus(capture_rng(), seed=1)
    other = with_gpus(capture_rng(), seed=2)
    monkeypatch.setattr(rng, "capture_rng", lambda: mine)
    strategy = SimpleNamespace(
        world_size=2, root_device=torch.device("cpu"), gather_per_rank=lambda t: torch.stack([t, rng_to_tensor(other)])
    )
    saved = rng.gather_rng(strategy)
    assert saved["world_size"] == 2
    for rank, expected in enumerate((mine, other)):
        got = saved["per_rank"][rank]["cuda"]
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, expected["cuda"]))


# ---------------------------------------------------------------------- seed_everything(verbose=...)
def seed_messages(caplog, monkeypatch, *args, env: dict | None = None, **kwargs) -> tuple[list[str], list[str]]:
    """What ``seed_everything(*args, **kwargs)`` logs (ember.rng, INFO) and warns, with only ``env`` of the
    seed and rank variables set."""
    import warnings

    for name in ("EMBER_GLOBAL_SEED", "RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    caplog.clear()
    with caplog.at_level("INFO", logger="ember.rng"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rng.seed_everything(*args, **kwargs)
    return [r.getMessage() for r in caplog.records if r.name == "ember.rng"], [str(w.message) for w in caught]


def test_seed_everything_says_the_seed_unless_not_verbose(caplog, monkeypatch):
    """Lightning 2.6.6 (PL_GLOBAL_SEED for EMBER_GLOBAL_SEED): "Seed set to 42"; nothing with verbose=False;
    "[rank: 1] Seed set to 44" under a launcher's RANK=1; a warning when no seed is given nor set."""
    assert seed_messages(caplog, monkeypatch, 42) == (["Seed set to 42"], [])
    assert seed_messages(caplog, monkeypatch, 43, verbose=False) == ([], [])
    assert seed_messages(caplog, monkeypatch, 44, env={"RANK": "1"}) == (["[rank: 1] Seed set to 44"], [])
    assert seed_messages(caplog, monkeypatch, 45, env={"LOCAL_RANK": "0"}) == (["[rank: 0] Seed set to 45"], [])
    assert seed_messages(caplog, monkeypatch) == (["Seed set to 0"], ["No seed found, seed set to 0"])
    assert seed_messages(caplog, monkeypatch, verbose=False) == ([], [])
    assert seed_messages(caplog, monkeypatch, env={"EMBER_GLOBAL_SEED": "7"}) == (["Seed set to 7"], [])
    # The warning is rank zero's only (Lightning's rank_zero_warn); the message is every rank's.
    assert seed_messages(caplog, monkeypatch, env={"RANK": "1"}) == (["[rank: 1] Seed set to 0"], [])


def test_seed_everything_seeds_the_same_whether_verbose_or_not(monkeypatch):
    monkeypatch.delenv("EMBER_GLOBAL_SEED", raising=False)
    assert rng.seed_everything(3, workers=True, verbose=False) == 3
    first = torch.rand(2)
    rng.seed_everything(3, verbose=True)
    assert torch.equal(torch.rand(2), first)
    import os

    assert os.environ["EMBER_GLOBAL_SEED"] == "3" and os.environ["EMBER_SEED_WORKERS"] == "0"
