"""The ``dataloader_iter`` step flavor: ``def training_step(self, dataloader_iter)`` (also ``validation_step``,
``test_step``, ``predict_step``), Lightning's experimental signature for a step that fetches its own batches.

Such a step receives a :class:`DataLoaderIter`; each ``next(dataloader_iter)`` fetches one batch and returns
``(batch, batch_idx, dataloader_idx)``, as in Lightning 2.x, and the step takes as many batches as it wants
(to prefetch, or to train on several at once). The batches are the loader's own: as in Lightning, they are
not moved to the device and the transfer hooks do not run, because the point of the flavor is that the step
decides when and how its data moves.

What the loops do differently for it (``EpochLoop.run_iter``, ``EvaluationLoop``), chosen once per run
from the step's signature, so that the usual ``(batch, batch_idx)`` step pays nothing for it:

- a step is not a batch. ``num_training_batches`` (``limit_train_batches``) bounds both the steps and the
  batches fetched; the validation interval, gradient accumulation and ``max_steps`` count steps; the data
  position of a checkpoint counts batches fetched, so a resume continues with the next batch the step
  would have fetched.
- the batch hooks (``on_train_batch_start`` ...) receive the last batch fetched and its index: before the
  step, the previous step's last (``None`` and 0 at an epoch's start), after it, this step's last.
- the epoch ends when the data has run out (known once the last batch is fetched: by count for a loader
  with a length, by looking one batch ahead for one without), after ``num_training_batches`` steps, or when
  a ``StopIteration`` escapes the step (it asked for a batch past the last one; that step is dropped).
- evaluation hands one iterator over all of its loaders, one after the other (``dataloader_idx`` says
  whose batch it is); a value logged goes under the loader of the batch fetched last, weighted by its size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

#: What ``next(dataloader_iter)`` returns: the batch, its index in its loader's epoch, its loader's index.
Fetched = tuple[Any, int, int]


class DataLoaderIter(Iterator[Fetched]):
    """What a ``dataloader_iter`` step receives: an iterator of ``(batch, batch_idx, dataloader_idx)``.

    It remembers the last batch fetched (:attr:`batch`, :attr:`batch_idx`, :attr:`dataloader_idx`), which
    the loops hand to the batch hooks, counts the batches fetched (:attr:`fetched`) and knows when the last
    one has been (:attr:`done`); from then on ``next()`` raises ``StopIteration``.

    Args:
        stream: ``(entry, is_last)`` pairs: the entries in order, each with whether it is the last one.
        length: how many entries the stream holds, when known (0 makes the iterator done from the start).
        on_fetch: turns each entry into what ``next()`` returns, and may note it (the evaluation loop points
            ``self.log`` at the batch); without it the entries are returned as they are.
    """

    def __init__(
        self,
        stream: Iterable[tuple[Any, bool]],
        length: float | None = None,
        on_fetch: Callable[[Any], Fetched] | None = None,
    ) -> None:
        self._stream = iter(stream)
        self._on_fetch = on_fetch
        #: Batches fetched so far.
        self.fetched = 0
        #: Whether the last batch has been fetched (or the stream ran out).
        self.done = length == 0
        #: The last batch fetched, its index and its loader's index (None, 0, 0 before the first).
        self.batch: Any = None
        self.batch_idx = 0
        self.dataloader_idx = 0

    def __iter__(self) -> DataLoaderIter:
        return self

    def __next__(self) -> Fetched:
        if self.done:
            raise StopIteration
        try:
            entry, self.done = next(self._stream)
        except StopIteration:
            self.done = True
            raise
        self.fetched += 1
        fetched = entry if self._on_fetch is None else self._on_fetch(entry)
        self.batch, self.batch_idx, self.dataloader_idx = fetched
        return fetched

    def __repr__(self) -> str:
        return f"DataLoaderIter(fetched={self.fetched}, done={self.done})"


def last_by_count(entries: Iterable[Any], length: int) -> Iterator[tuple[Any, bool]]:
    """The first ``length`` entries, each with whether it is the ``length``-th (a loader with a length: its
    end is known without fetching past it)."""
    for i, entry in enumerate(itertools.islice(entries, length), 1):
        yield entry, i == length


def last_by_lookahead(entries: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """The entries, each with whether it is the last: one entry is fetched ahead (a loader without a
    length, whose end shows only when it runs out)."""
    it = iter(entries)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True
