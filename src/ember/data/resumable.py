"""Making a user's training DataLoader resumable mid-epoch.

``make_resumable(loader)`` rebuilds a plain ``DataLoader`` around a resumable sampler, keeping
the dataset, batch size, workers, collate function, drop_last and every other setting; ember then
skips the batches an interrupted epoch already consumed *at the sampler level*, so no sample is
loaded only to be thrown away. Loaders that cannot be rebuilt safely (DataLoader subclasses,
iterable datasets, custom samplers or batch samplers) are returned unchanged; resuming one of them
mid-epoch falls back to iterating past the consumed batches, with a warning. So is, in one process, a
loader whose sampler has a ``set_epoch`` of its own: the loop calls it each epoch, as Lightning does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.dataloader import _BaseDataLoaderIter, _MultiProcessingDataLoaderIter

from ember.data import fork_safety  # noqa: F401 (registers the before-fork wait for ending feeder threads)
from ember.data.sampler import ShardedSampler


def resumable_sampler_of(loader: Any) -> Any:
    """The sampler of ``loader`` that can be restored (``state_dict``/``load_state_dict``/``set_epoch``), or None."""
    for obj in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if obj is not None and all(hasattr(obj, a) for a in ("state_dict", "load_state_dict", "set_epoch")):
            return obj
    return None


def why_not_swappable(loader: Any) -> str | None:
    """Why ``loader``'s sampler cannot be replaced, or None when it can."""
    if type(loader) is not DataLoader and type(loader) is not _ResumableDataLoader:
        return f"it is a {type(loader).__name__}, not a plain torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return "its dataset is an IterableDataset"
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        return f"it has a custom batch_sampler ({type(loader.batch_sampler).__name__})"
    if loader.batch_size is None:
        return "it has batch_size=None (no automatic batching)"
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler.num_samples != len(cast(Sized, loader.dataset)):
            return "its RandomSampler draws with replacement or a custom num_samples"
    elif type(sampler) is not SequentialSampler:
        return f"it has a custom sampler ({type(sampler).__name__})"
    return None


class _ResumableDataLoader(DataLoader):
    """A DataLoader whose iterator, while continuing a restored epoch, draws nothing from torch's
    global RNG nor from the loader's own generator (a fresh DataLoader iterator draws its workers' base seed
    from it), so that the streams restored from the checkpoint stay exactly where the interrupted run had
    them."""

    def __iter__(self) -> _BaseDataLoaderIter:
        sampler = self.sampler
        if getattr(sampler, "resuming", False) and self.generator is None:
            g = torch.Generator()
            g.manual_seed(int(getattr(sampler, "seed", None) or 0) ^ 0x5DEECE66D)
            self.generator = g
            try:
                return super().__iter__()
            finally:
                self.generator = None
        if getattr(sampler, "resuming", False) and self.generator is not None:
            # The loader's own generator, restored with the sampler (its state after the epoch's draws): the
            # continued epoch's iterator draws its workers' seed from it, which the interrupted run had drawn.
            state = self.generator.get_state()
            try:
                return super().__iter__()
            finally:
                self.generator.set_state(state)
        return super().__iter__()


def shutdown_workers(loader: Any) -> None:
    """Stop the worker processes a ``DataLoader`` keeps between epochs (``persistent_workers=True``) now, and
    forget its iterator: its next iteration starts new workers. The Trainer calls it for every loader a stage
    ran when the stage ends, as Lightning does. Anything but a DataLoader (or ``SkipFirstBatches`` around one)
    is left as it is.

    Left to themselves, the workers live as long as the loader does; and dropping a loader whose iterator is
    in a reference cycle takes about 5 s per worker: the garbage collector closes the iterator's index queues
    before the iterator's ``__del__`` sends the workers their stop message, so torch waits for each worker
    in vain and then terminates it.
    """
    if isinstance(loader, SkipFirstBatches):
        loader = loader.loader
    if not isinstance(loader, DataLoader):
        return
    # torch has no public call for this: the iterator's _shutdown_workers is what its own __del__ calls, and
    # the loader keeps a persistent iterator in _iterator (None otherwise, or before the first epoch).
    iterator = loader._iterator  # noqa: SLF001
    if isinstance(iterator, _MultiProcessingDataLoaderIter):
        iterator._shutdown_workers()  # noqa: SLF001
    loader._iterator = None  # noqa: SLF001


def rebuild_with_sampler(loader: DataLoader, sampler: Sampler) -> DataLoader:
    """A copy of ``loader`` drawing indices from ``sampler``; every other setting is kept."""
    kwargs: dict[str, Any] = dict(
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    return _ResumableDataLoader(loader.dataset, **kwargs)


def has_own_set_epoch(loader: Any) -> bool:
    """Whether ``loader``'s sampler has a ``set_epoch`` (a ``RandomSampler`` subclass or instance given
    one by the user): its per-epoch behaviour is the user's, which a replacement sampler would drop."""
    return callable(getattr(getattr(loader, "sampler", None), "set_epoch", None))


def make_resumable(loader: Any, sampler_factory: Callable[[int, bool, Any], Sampler] | None = None) -> Any:
    """``loader`` with its sampler replaced by a resumable one, or ``loader`` itself when it can't be.

    Without ``sampler_factory`` (one process), a loader whose sampler has its own ``set_epoch`` is kept
    too: the loop calls that ``set_epoch`` each epoch (``loaders.set_loader_epoch``), as Lightning does,
    and a mid-epoch resume skips the consumed batches. With one (``ddp`` sharding) it is replaced as
    before: every rank needs its shard, and Lightning likewise sets the epoch of the
    ``DistributedSampler`` it puts in, not the user's sampler's.

    Args:
        loader: the user's training loader.
        sampler_factory: ``(num_samples, shuffle, user_sampler) -> sampler``; defaults to a
            one-rank :class:`~ember.data.sampler.ShardedSampler`, which draws each epoch's
            permutation from the global RNG exactly as ``RandomSampler`` does.
    """
    if resumable_sampler_of(loader) is not None or why_not_swappable(loader) is not None:
        return loader
    if sampler_factory is None and has_own_set_epoch(loader):
        return loader
    shuffle = isinstance(loader.sampler, RandomSampler)
    if sampler_factory is None:

        def sampler_factory(n: int, shuffle: bool, user_sampler: Any) -> Sampler:
            return ShardedSampler(n, 1, 0, shuffle=shuffle, generator=getattr(user_sampler, "generator", None))

    return rebuild_with_sampler(loader, sampler_factory(len(loader.dataset), shuffle, loader.sampler))


class SkipFirstBatches:
    """Wraps a loader that cannot resume at the sampler level: its next iteration skips ``n``
    batches by loading and discarding them; later iterations are untouched."""

    def __init__(self, loader: Any, n: int) -> None:
        self.loader = loader
        self.skip = n

    def __iter__(self) -> Iterator[Any]:
        n, self.skip = self.skip, 0
        return itertools.islice(iter(self.loader), n, None)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (a copy being built by copy/pickle): no endless lookup
            raise AttributeError(name)
        return getattr(self.loader, name)
