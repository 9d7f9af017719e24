"""A resumable, rank-sharded sampler: every rank a disjoint shard of one global order per epoch.

Each epoch has one global order of the dataset: ``0..n-1``, or a permutation seeded the same on
every rank. Rank ``r`` of ``W`` takes positions ``r, r + W, r + 2W, ...`` of it, so batch ``k`` of
all ranks together covers positions ``[k*b*W, (k+1)*b*W)``: exactly what one process with batch
``W*b`` sees in its batch ``k``. That makes ``ddp`` on ``W`` ranks with batch ``b`` equal to
``single`` with batch ``W*b`` and makes a position in the global order meaningful on any number
of ranks (a checkpoint resumes "from the next unseen sample" even with a different world size).

The uneven tail (``n`` not a multiple of ``W``):

- **training** (``even=True``): the order is padded to a multiple of ``W`` with its own first
  samples, as ``DistributedSampler`` does, so every rank runs the same number of steps (a rank with
  one step fewer would leave the others waiting in the gradient all-reduce). At most ``W - 1``
  samples are seen twice per epoch; nothing is dropped.
- **evaluation** (``even=False``): shards differ by at most one sample and nothing is repeated
  inside a real batch, so the epoch metric, reduced once and weighted by each rank's sample
  count, equals the single-process value on the same data. Ranks must still run the same number
  of steps: a step may hold a collective (``self.log(..., sync_dist=True)`` on a step value, an
  all-gather), and a rank that stopped one batch early would leave the others waiting in it. So
  when the loader's ``batch_size`` and ``drop_last`` are given and a shard would yield a batch
  fewer than the longest, it is padded with the order's first sample: one whole *padding batch*
  of one sample, shaped like the longest shards' last batch (with ``drop_last``, the padding
  sample completes the short batch ``drop_last`` would have dropped). ``real_batches`` says
  where the padding starts; the evaluation loop runs the padding batch and counts it toward no
  epoch value.

Shuffling needs no ``set_epoch``: with a fixed ``seed`` epoch ``e`` uses ``seed + e``; with
``seed=None`` each epoch's seed is drawn when its iteration starts (from ``generator``, else
torch's global generator, exactly like ``RandomSampler`` and the single-process sampler) and
rank 0's draw is shared with ``agree``. Iterating again without ``set_epoch`` starts the next
epoch. ``state_dict()`` is ``{"seed", "epoch", "position"}`` where ``position`` counts samples of
the epoch's (padded) global order already handed out over all ranks; loaders prefetch, so the
Trainer stores the number of samples its loop consumed instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = ["ShardedSampler"]


class ShardedSampler(Sampler[int]):
    """This rank's shard of one global (optionally shuffled) order per epoch; resumable.

    Args:
        num_samples: Length of the dataset.
        num_replicas: Number of ranks sharing it.
        rank: This rank, in ``[0, num_replicas)``.
        shuffle: A fresh permutation every epoch, or ``0..n-1`` in order.
        seed: A fixed base seed (epoch ``e`` uses ``seed + e``), or None to draw one per epoch.
        generator: Where per-epoch seeds are drawn from when ``seed`` is None (default: torch's
            global generator).
        even: Pad the order so every rank gets the same number of samples (training), or not
            (evaluation: no duplicates inside a real batch).
        agree: Makes all ranks use rank 0's drawn seed, e.g. ``lambda s: strategy.broadcast(s)``;
            needed when ``seed`` is None and ranks' generators may differ. Called by every rank
            at the start of every shuffled epoch.
        batch_size: With ``even=False``: the batch size of the loader this sampler feeds, so that
            a shard that would yield a batch fewer than the longest gets a padding batch. None:
            no padding.
        drop_last: With ``batch_size``: whether that loader drops its last partial batch.

    Raises:
        ValueError: If ``rank`` is outside ``[0, num_replicas)``.
    """

    def __init__(
        self,
        num_samples: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        even: bool = True,
        agree: Callable[[int], int] | None = None,
        batch_size: int | None = None,
        drop_last: bool = False,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"ShardedSampler got rank={rank} with num_replicas={num_replicas}; rank must be in [0, {num_replicas})."
            )
        self.num_samples = int(num_samples)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = shuffle
        self.base_seed = seed
        self.generator = generator
        self.even = even
        self.agree = agree
        #: Samples appended to this rank's evaluation shard (0 or 1), and how many batches come before
        #: them (None: no padding).
        self.padding, self.real_batches = _eval_padding(
            self.num_samples, self.num_replicas, self.rank, None if even else batch_size, drop_last
        )
        self.epoch = 0
        self.seed: int | None = None  # this epoch's seed, once drawn
        self._start = 0  # global position the next iteration starts from (a resume)
        self._handed_out = 0  # global positions handed out in this epoch
        self._iterated = False  # an iteration of this epoch has started

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch to iterate next (optional: iterating again advances it)."""
        if epoch != self.epoch:
            self.seed, self._start = None, 0
        self.epoch = int(epoch)
        self._iterated = False

    def _total(self) -> int:
        n, w = self.num_samples, self.num_replicas
        return -(-n // w) * w if self.even and n else n

    def global_order(self) -> list[int]:
        """The epoch's full order over all ranks (padded when ``even``)."""
        n = self.num_samples
        if self.shuffle:
            if self.seed is None:
                self.seed = self._draw_seed()
            g = torch.Generator()
            g.manual_seed(self.seed)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        total = self._total()
        while len(order) < total:  # pad with the order's own first samples
            order += order[: total - len(order)]
        return order

    def _draw_seed(self) -> int:
        if self.base_seed is not None:
            return self.base_seed + self.epoch
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
        return int(self.agree(seed)) if self.agree is not None else seed

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        if start == 0:  # a fresh epoch (a resume keeps the restored seed)
            if self._iterated:
                self.epoch += 1  # iterating again without set_epoch: the next epoch
            self.seed = None
        self._iterated = True
        order = self.global_order()
        end = self._end(start)
        while len(order) < end:  # a resume on another number of ranks: pad what is left, see _end
            order += order[: end - len(order)]
        self._handed_out = start
        return self._shard(order, start, end)

    def _end(self, start: int) -> int:
        """Where an iteration starting at global position ``start`` ends.

        In training, the samples left after ``start`` are padded to a multiple of the ranks: a
        checkpoint written on another number of ranks can resume at any position, and every rank
        must still take the same number of steps (one step fewer on one rank would leave the
        others waiting in the gradient all-reduce). At most ``W - 1`` samples repeat. On the
        number of ranks that wrote the checkpoint this is the epoch's own padded end.
        """
        n = self.num_samples
        if not self.even:
            return max(n, start)
        if start >= n:  # every sample of the epoch was handed out (the rest was padding)
            return start
        return start + -(-(n - start) // self.num_replicas) * self.num_replicas

    def _shard(self, order: list[int], start: int, end: int) -> Iterator[int]:
        for position in range(start + self.rank, end, self.num_replicas):
            self._handed_out = position - self.rank + self.num_replicas
            yield order[position]
        if start == 0:
            yield from order[: self.padding]

    def __len__(self) -> int:
        remaining = self._end(self._start) - self._start
        padding = self.padding if self._start == 0 else 0
        return max(0, -(-(remaining - self.rank) // self.num_replicas)) + padding

    # ------------------------------------------------------------------ resuming
    @property
    def resuming(self) -> bool:
        """True until the iteration that continues a restored epoch has started."""
        return self._start > 0

    def state_dict(self) -> dict[str, Any]:
        """``{"seed", "epoch", "position"}``: enough to continue this epoch on any world size; and, where the
        epochs' seeds are drawn from a ``generator`` of the loader's, its state (``"generator"``), so that the
        epochs after a resumed one shuffle as they would have."""
        position = min(self._handed_out, self._total())
        state: dict[str, Any] = {"seed": self.seed, "epoch": self.epoch, "position": position}
        if self.generator is not None and self.base_seed is None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues epoch ``state["epoch"]`` from global position ``state["position"]``."""
        self.epoch = int(state["epoch"])
        self.seed = None if state.get("seed") is None else int(state["seed"])
        self._start = int(state.get("position", 0))
        self._handed_out = self._start
        self._iterated = False
        saved = state.get("generator")
        if saved is not None and self.generator is not None and self.base_seed is None:
            self.generator.set_state(saved)


def _eval_padding(n: int, world: int, rank: int, batch_size: int | None, drop_last: bool) -> tuple[int, int | None]:
    """``(padding samples, batches before them)`` for rank ``rank``'s evaluation shard of ``n`` samples.

    Shards hold ``ceil((n - rank) / world)`` samples, so they differ by at most one. With
    ``drop_last=False`` a shard one sample short yields a batch fewer exactly when it is a multiple
    of ``batch_size`` (the longest shards' last batch holds one sample); with ``drop_last=True``,
    exactly when the longest is (the short shard's last, partial batch is dropped). One padding
    sample closes the gap in both cases and lands in a batch of its own (the partial batch
    ``drop_last`` would have dropped, completed). No batch count differs otherwise.
    """
    if batch_size is None or n == 0:
        return 0, None
    own, longest = -(-(n - rank) // world), -(-n // world)

    def batches(samples: int) -> int:
        return samples // batch_size if drop_last else -(-samples // batch_size)

    if batches(own) < batches(longest):
        return longest - own, batches(own)
    return 0, None
