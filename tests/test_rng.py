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
