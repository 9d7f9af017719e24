"""Keeping ranks in step over loaders without a length (an ``IterableDataset`` per rank).

Under ``ddp`` every training step ends in a gradient all-reduce that every rank must join. Sized
loaders are sharded by ember with padding, so every rank takes the same number of steps and needs
no agreement. A stream that each rank produces itself (an ``IterableDataset`` sharded by rank) can
run out on one rank first; that rank would go on to the epoch's end while the others wait in an
all-reduce it never joins, which hangs the job (or pairs unrelated collectives). So, for loaders
without a length only, the ranks agree before each step that every one of them has a batch: one
all-reduce of a one-element tensor per batch. At the first position where some rank has none,
the epoch ends on every rank; the batch a longer rank had already fetched there is not used.

Evaluation makes the same agreement over loaders without a length, but goes on while any rank
has a batch (a rank that ran out runs padding batches, see evaluation.py): no sample is left out
of a metric.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ember.strategies.strategy import Strategy

# A longer rank counts its remaining batches for the warning for at most this long (other ranks
# wait for the count meanwhile); past it, the warning gives the count reached as a lower bound.
COUNT_REST_SECONDS = 5.0

_END = object()


class Lockstep:
    """Yields ``(batch, is_last)`` like a one-batch lookahead, ending together on every rank.

    Iterating it is a collective: every rank must iterate its own ``Lockstep`` in the same loop.

    Args:
        batches: this rank's batches (a loader without a length, already limited to
            ``limit_train_batches``).
        strategy: supplies ``world_size`` and ``reduce``.
    """

    def __init__(self, batches: Iterable[Any], strategy: Strategy) -> None:
        self._it = iter(batches)
        self._strategy = strategy
        #: Batches this rank took from its loader (the last one fetched may not have been used).
        self.fetched = 0
        #: Whether this rank's loader ran out.
        self.ended = False
        #: Whether, at the last position the ranks agreed on, some had a batch and others had none
        #: (known before the step of the last batch runs, so a loop that stops there still sees it).
        self.uneven = False

    def __iter__(self) -> Iterator[tuple[Any, bool]]:
        world = self._strategy.world_size
        item = self._next()
        holders = self._holders(item)
        while holders == world:
            batch = item
            item = self._next()
            holders = self._holders(item)  # before the step: is this batch the epoch's last everywhere?
            yield batch, holders < world

    def _next(self) -> Any:
        item = next(self._it, _END)
        if item is _END:
            self.ended = True
        else:
            self.fetched += 1
        return item

    def _holders(self, item: Any) -> int:
        """How many ranks hold a batch at this position (one all-reduce)."""
        count = int(self._strategy.reduce(torch.tensor(0 if item is _END else 1), "sum"))
        self.uneven = 0 < count < self._strategy.world_size
        return count

    def batches_per_rank(self, first: int) -> list[tuple[int, bool]]:
        """Every rank's ``(batches its loader had this epoch, exact)``: a collective, once ``uneven``.

        A rank that still had batches counts the rest of its stream, for up to ``COUNT_REST_SECONDS``
        (a stream may be endless); ``exact`` is False where it stopped counting first.

        Args:
            first: batches of this epoch consumed before this iterator started (a mid-epoch resume).
        """
        count, exact = first + self.fetched, True
        if not self.ended:
            deadline = time.monotonic() + COUNT_REST_SECONDS
            for _ in self._it:
                count += 1
                if time.monotonic() > deadline:
                    exact = False
                    break
        rows = self._strategy.gather_per_rank(torch.tensor([count, int(exact)]))
        return [(int(n), bool(e)) for n, e in rows.tolist()]


def uneven_message(counts: list[tuple[int, bool]], used: int, epoch: int) -> str:
    """What to tell the user when ranks' loaders yielded different numbers of batches.

    Args:
        counts: every rank's ``(batches, exact)`` from ``Lockstep.batches_per_rank``.
        used: batches every rank ran this epoch.
        epoch: the epoch's index.
    """
    per_rank = ", ".join(
        f"rank {r}: {n}" if exact else f"rank {r}: at least {n}" for r, (n, exact) in enumerate(counts)
    )
    fix = (
        "Make each rank's IterableDataset yield the same number of batches (split the data evenly by "
        "trainer.global_rank and trainer.world_size, dropping the remainder)"
    )
    if used == 0:
        return (
            f"The train dataloader yielded no batch on some ranks in epoch {epoch} ({per_rank}), so no rank "
            f"can train: every rank must take the same steps. {fix}."
        )
    return (
        f"The train dataloader yielded a different number of batches on each rank in epoch {epoch} "
        f"({per_rank}). Every rank must take the same steps, so the epoch ended after {used} batches on "
        f"every rank, where the shortest ran out, and the other ranks' remaining batches were not used. "
        f"{fix}, or set an int limit_train_batches no larger than the shortest rank's count."
    )
