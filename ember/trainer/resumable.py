"""A single-process sampler that can stop mid-epoch and continue from the next unseen sample.

Stand-in until ``ember.strategies.sampler`` (the rank-sharded one) exists; its ``state_dict`` has
the same shape: ``{"seed", "epoch", "position"}``, ``position`` counting samples of the epoch's
order already consumed (globally, over all ranks).

With ``seed=None`` it draws each epoch's seed from torch's global generator when the epoch's
iteration starts, exactly as ``torch.utils.data.RandomSampler`` does, so swapping it into a plain
``DataLoader(shuffle=True)`` keeps the same order and the same global RNG consumption as a
hand-written loop. The drawn seed is part of the state, so a resumed epoch replays the same order
without drawing again.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Sequential or shuffled indices of ``num_samples`` items, resumable at any position.

    Args:
        num_samples: length of the dataset.
        shuffle: a random permutation per epoch, or ``0..n-1`` in order.
        seed: a fixed seed (each epoch's permutation is seeded with ``seed + epoch``), or None to
            draw one per epoch from ``generator`` (torch's global generator when that is None).
        generator: where per-epoch seeds are drawn from when ``seed`` is None.
    """

    def __init__(self, num_samples: int, shuffle: bool, seed: int | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.num_samples = int(num_samples)
        self.shuffle = shuffle
        self.base_seed = seed
        self.generator = generator
        self.epoch = 0
        self.seed: int | None = None  # the current epoch's seed, once drawn
        self._resume: int = 0  # samples of this epoch to skip on the next iteration

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.seed = None
            self._resume = 0
        self.epoch = epoch

    def _epoch_seed(self) -> int:
        if self.base_seed is not None:
            return self.base_seed + self.epoch
        return int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())

    def __iter__(self) -> Iterator[int]:
        start, self._resume = self._resume, 0
        n = self.num_samples
        if not self.shuffle:
            return iter(range(min(start, n), n))
        if self.seed is None or start == 0:
            self.seed = self._epoch_seed()
        g = torch.Generator()
        g.manual_seed(self.seed)
        return iter(torch.randperm(n, generator=g)[start:].tolist())

    def __len__(self) -> int:
        return self.num_samples

    @property
    def resuming(self) -> bool:
        """True until the iteration that continues a restored epoch has started."""
        return self._resume > 0

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.seed = None if state.get("seed") is None else int(state["seed"])
        self._resume = int(state.get("position", 0))
