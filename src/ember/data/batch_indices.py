"""The dataset indices of each batch a loader yields: ``batch_indices`` for prediction writers.

``track_batch_indices`` gives a copy of a ``DataLoader`` whose sampler is wrapped in a recorder: the loader
draws indices from it in order (its workers prefetch batches, but the indices of each batch are still drawn
one batch after the other, in the main process), so the recorder's queue holds, in order, the indices of the
batches drawn and not yet taken. ``take()`` after each batch arrives returns that batch's indices.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from ember.data.resumable import _ResumableDataLoader, rebuild_with_sampler

__all__ = ["IndexRecorder", "track_batch_indices"]


class IndexRecorder(Sampler):
    """Yields ``sampler``'s indices, remembering each until ``take`` hands it out with its batch."""

    def __init__(self, sampler: Any, batch_size: int) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self._drawn: deque[int] = deque()

    def __iter__(self) -> Iterator[int]:
        self._drawn.clear()  # a new pass over the data: indices drawn and not taken belong to the last one
        for index in self.sampler:
            self._drawn.append(index)
            yield index

    def __len__(self) -> int:
        return len(self.sampler)

    def take(self) -> list[int]:
        """The indices of the next batch: ``batch_size`` of them, or what is left for the last batch."""
        count = min(self.batch_size, len(self._drawn))
        return [self._drawn.popleft() for _ in range(count)]

    def __getattr__(self, name: str) -> Any:  # set_epoch, the sharded sampler's padding counts, ...
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)


def track_batch_indices(loader: Any) -> tuple[Any, IndexRecorder | None]:
    """``(loader, recorder)``: a copy of ``loader`` whose batches' indices ``recorder.take()`` returns, or
    ``(loader, None)`` for a loader whose indices cannot be followed (not a plain ``DataLoader``, an
    ``IterableDataset``, a custom ``batch_sampler``, ``batch_size=None``)."""
    if type(loader) is not DataLoader and type(loader) is not _ResumableDataLoader:
        return loader, None
    if isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
        return loader, None
    if type(loader.batch_sampler) is not BatchSampler:
        return loader, None
    recorder = IndexRecorder(loader.sampler, loader.batch_size)
    return rebuild_with_sampler(loader, recorder), recorder
