"""CombinedLoader: several loaders iterated as one, in Lightning's four modes.

``CombinedLoader({"a": loader_a, "b": loader_b}, mode)`` yields ``(batch, batch_idx, dataloader_idx)``;
``batch`` has the structure of what was given (a dict, list or tuple of loaders, nested or not):

- ``min_size``: one batch of every loader per step, until the shortest ends.
- ``max_size_cycle``: until the longest ends; shorter loaders start again when they run out
  (what ``fit`` does with a dict or list of train loaders).
- ``max_size``: until the longest ends; a loader that ran out gives None.
- ``sequential``: every batch of the first loader, then of the second, ...; ``batch`` is one
  loader's batch and ``dataloader_idx`` says whose (what evaluation does with several loaders).

The Trainer shards each inner loader under ``ddp`` and makes each resumable, so a checkpoint
written mid-epoch continues every inner loader at its own next sample: ``state_dict()`` records, per
inner loader, the batches this pass took from it and its sampler's seed and epoch. Counted here,
not by the samplers, because DataLoader workers fetch ahead of what the loop consumed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

MODES = ("min_size", "max_size_cycle", "max_size", "sequential")


def _primitives(tree: Mapping | list | tuple) -> bool:
    values = tree.values() if isinstance(tree, Mapping) else tree
    return all(isinstance(v, (int, float, str)) for v in values)


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    """The leaves of nested dicts, lists and tuples, and the structure to rebuild. Anything else is a leaf,
    and so is a container of numbers and strings (a list of samples is one iterable, as in Lightning)."""
    if isinstance(tree, (Mapping, list, tuple)) and _primitives(tree):
        return [tree], None
    if isinstance(tree, Mapping):
        leaves: list[Any] = []
        specs = {}
        for k, v in tree.items():
            sub, specs[k] = _flatten(v)
            leaves.extend(sub)
        return leaves, (type(tree), specs)
    if isinstance(tree, (list, tuple)):
        leaves, parts = [], []
        for v in tree:
            sub, spec = _flatten(v)
            leaves.extend(sub)
            parts.append(spec)
        return leaves, (type(tree), parts)
    return [tree], None


def _unflatten(leaves: Iterator[Any], spec: Any) -> Any:
    if spec is None:
        return next(leaves)
    kind, parts = spec
    if isinstance(parts, dict):
        values = {k: _unflatten(leaves, s) for k, s in parts.items()}
        return values if kind is dict else kind(values)
    items = [_unflatten(leaves, s) for s in parts]
    return kind(*items) if hasattr(kind, "_fields") else kind(items)


def _len(iterable: Any) -> int | None:
    try:
        return len(iterable)
    except (TypeError, NotImplementedError):
        return None


def _sampler(loader: Any) -> Any:
    """The resumable sampler of an inner loader (``state_dict``, ``load_state_dict``, ``set_epoch``), or None."""
    for obj in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if obj is not None and all(hasattr(obj, a) for a in ("state_dict", "load_state_dict", "set_epoch")):
            return obj
    return None


class CombinedLoader(Iterable):
    """Iterate several loaders (a dict, list or tuple of them, possibly nested) together.

    Args:
        iterables: the loaders (any iterables).
        mode: ``"min_size"`` (default), ``"max_size_cycle"``, ``"max_size"`` or ``"sequential"``.

    Raises:
        ValueError: for another mode.
    """

    def __init__(self, iterables: Any, mode: str = "min_size") -> None:
        if mode not in MODES:
            raise ValueError(f"Unsupported mode {mode!r}, please select one of: {list(MODES)}.")
        self._iterables = iterables
        self._mode = mode
        self._flattened, self._spec = _flatten(iterables)
        self._epoch: int | None = None
        self._pending: dict[str, Any] | None = None  # a state to continue from, set by load_state_dict
        self._state: _Pass | None = None
        self._limits: list[int | float] | None = None

    @property
    def iterables(self) -> Any:
        """The loaders, in the structure given."""
        return self._iterables

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def flattened(self) -> list[Any]:
        """The loaders as a flat list (the order of ``dataloader_idx``)."""
        return list(self._flattened)

    @flattened.setter
    def flattened(self, loaders: list[Any]) -> None:
        """Replace the loaders (the Trainer puts in sharded, resumable ones); the structure stays."""
        if len(loaders) != len(self._flattened):
            raise ValueError(f"CombinedLoader has {len(self._flattened)} loaders; got {len(loaders)} to replace them.")
        self._flattened = list(loaders)
        self._iterables = _unflatten(iter(loaders), self._spec)

    @property
    def sampler(self) -> Any:
        """Each loader's ``sampler`` (None for one without), in the structure given."""
        return _unflatten(iter([getattr(it, "sampler", None) for it in self._flattened]), self._spec)

    @property
    def batch_sampler(self) -> Any:
        """Each loader's ``batch_sampler`` (None for one without), in the structure given."""
        return _unflatten(iter([getattr(it, "batch_sampler", None) for it in self._flattened]), self._spec)

    @property
    def limits(self) -> list[int | float] | None:
        """At most this many batches of each loader count toward ``len()`` (and, in ``sequential`` mode, are
        iterated), as Lightning's: a number for every loader, or one per loader; None: no limit."""
        return self._limits

    @limits.setter
    def limits(self, limits: int | float | list[int | float] | None) -> None:
        if isinstance(limits, (int, float)):
            limits = [limits] * len(self._flattened)
        elif isinstance(limits, list) and len(limits) != len(self._flattened):
            raise ValueError(
                f"CombinedLoader has {len(self._flattened)} loaders but {len(limits)} limits: give one per loader, "
                "or one number for all."
            )
        self._limits = limits

    def reset(self) -> None:
        """Forget the pass in progress and stop the loaders' worker processes (their next pass starts anew)."""
        self._state = None
        for loader in self._flattened:
            # torch has no public call for this: what a DataLoader iterator's own __del__ does, as Lightning.
            iterator = getattr(loader, "_iterator", None)
            if isinstance(iterator, _MultiProcessingDataLoaderIter):
                iterator._shutdown_workers()  # noqa: SLF001
            if hasattr(loader, "_iterator"):
                loader._iterator = None  # noqa: SLF001

    def __len__(self) -> int:
        """Batches per pass: the shortest loader's (``min_size``), the longest's (``max_size*``), or the sum
        (``sequential``), each loader counted up to its ``limits``. A TypeError when a loader that decides it
        has no length."""
        lengths = [_len(it) for it in self._flattened]
        if not lengths:
            return 0
        limits = self._limits or [float("inf")] * len(lengths)
        capped = [None if n is None else min(n, limit) for n, limit in zip(lengths, limits, strict=True)]
        if self._mode == "min_size":
            known = [n for n in capped if n is not None] + [x for x in limits if x != float("inf")]
            if known:
                return int(min(known))
        if any(n is None for n in capped):
            raise TypeError("CombinedLoader has no length: one of its loaders has none.")
        sized = [int(n) for n in capped if n is not None]
        return sum(sized) if self._mode == "sequential" else max(sized) if self._mode != "min_size" else min(sized)

    def set_epoch(self, epoch: int) -> None:
        """Tell every inner loader's sampler which epoch starts (applied when the next pass starts)."""
        self._epoch = epoch

    def __iter__(self) -> Iterator[tuple[Any, int, int]]:
        pending, self._pending = self._pending, None
        if self._epoch is not None:  # (a restored sampler then gets its saved epoch back)
            for loader in self._flattened:
                sampler = _sampler(loader)
                if sampler is not None:
                    sampler.set_epoch(self._epoch)
                elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
                    loader.sampler.set_epoch(self._epoch)
        self._state = state = _Pass(self._flattened, self._mode, pending, self._limits)
        return state.run(self._spec)

    # ------------------------------------------------------------------ resuming
    def state_dict(self) -> dict[str, Any]:
        """Where the current pass is: per inner loader, the batches taken in its current pass, whether it
        ran out, and its sampler's state; the combined batch index."""
        state = self._state
        if state is None:
            return {"mode": self._mode, "batch_idx": 0, "loaders": []}
        return state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter()``.

        Raises:
            ValueError: if it was written for another mode or number of loaders.
        """
        if state.get("mode") != self._mode or len(state.get("loaders", [])) not in (0, len(self._flattened)):
            raise ValueError(
                f"This CombinedLoader state was written for mode {state.get('mode')!r} with "
                f"{len(state.get('loaders', []))} loaders; this one has mode {self._mode!r} and "
                f"{len(self._flattened)}. Resume with the loaders the checkpoint was written with."
            )
        self._pending = state if state.get("loaders") else None


class _Pass:
    """One pass over the inner loaders: their iterators, and what was taken from each (for ``state_dict``)."""

    def __init__(
        self, loaders: list[Any], mode: str, resume: dict[str, Any] | None, limits: list[int | float] | None = None
    ) -> None:
        self.loaders, self.mode, self.limits = loaders, mode, limits
        n = len(loaders)
        self.taken = [0] * n  # batches taken from each loader in its current pass
        self.ran_out = [False] * n  # each loader ran out once (max_size_cycle, max_size)
        self.batch_idx = 0
        self.current = 0  # sequential: the loader being iterated
        self.iterators: list[Iterator[Any] | None] = [None] * n
        self._skip = [0] * n
        if resume is not None:
            self.batch_idx = int(resume["batch_idx"])
            self.current = int(resume.get("current", 0))
            for i, saved in enumerate(resume["loaders"]):
                self.taken[i], self.ran_out[i] = int(saved["taken"]), bool(saved["ran_out"])
                sampler = _sampler(loaders[i])
                if sampler is not None and saved.get("sampler") is not None and self.taken[i]:
                    batch_size = getattr(loaders[i], "batch_size", None) or 1
                    position = self.taken[i] * batch_size * getattr(sampler, "num_replicas", 1)
                    sampler.load_state_dict({**saved["sampler"], "position": position})
                else:
                    self._skip[i] = self.taken[i]  # no sampler to restore: load and drop what was taken

    def _start(self, i: int) -> Iterator[Any]:
        iterator = iter(self.loaders[i])
        skip, self._skip[i] = self._skip[i], 0
        for _ in range(skip):
            next(iterator)
        return iterator

    def _next(self, i: int) -> Any:
        iterator = self.iterators[i]
        if iterator is None:
            iterator = self.iterators[i] = self._start(i)
        batch = next(iterator)  # StopIteration: the caller decides
        self.taken[i] += 1
        return batch

    def _restart(self, i: int) -> Any:
        self.ran_out[i] = True
        self.taken[i] = 0
        self.iterators[i] = self._start(i)
        return self._next(i)

    def run(self, spec: Any) -> Iterator[tuple[Any, int, int]]:
        if self.mode == "sequential":
            yield from self._sequential()
            return
        n = len(self.loaders)
        while True:
            out: list[Any] = []
            for i in range(n):
                if self.mode == "max_size" and self.ran_out[i]:
                    out.append(None)
                    continue
                try:
                    out.append(self._next(i))
                except StopIteration:
                    if self.mode == "min_size":
                        return
                    if self.mode == "max_size":
                        self.ran_out[i] = True
                        out.append(None)
                        continue
                    if all(self.ran_out[j] or j == i for j in range(n)):  # max_size_cycle: the last one ran out
                        return
                    out.append(self._restart(i))
            if self.mode == "max_size" and all(self.ran_out):
                return
            if self.mode == "max_size_cycle" and all(self.ran_out):
                return
            yield _unflatten(iter(out), spec), self.batch_idx, 0
            self.batch_idx += 1

    def _sequential(self) -> Iterator[tuple[Any, int, int]]:
        for i in range(self.current, len(self.loaders)):
            self.current = i
            limit = self.limits[i] if self.limits is not None else float("inf")
            while self.taken[i] < limit:  # as Lightning: sequential mode moves on at a loader's limit
                try:
                    batch = self._next(i)
                except StopIteration:
                    break
                yield batch, self.taken[i] - 1, i
            self.ran_out[i] = True

    def state_dict(self) -> dict[str, Any]:
        # A sampler keeps its pass's seed and epoch until its next pass starts, and only a restart here
        # starts one (workers prefetch within a pass), so its state now is its current pass's.
        samplers = [_sampler(loader) for loader in self.loaders]
        loaders = [
            {
                "taken": self.taken[i],
                "ran_out": self.ran_out[i],
                "sampler": samplers[i].state_dict() if samplers[i] is not None else None,
            }
            for i in range(len(self.loaders))
        ]
        return {"mode": self.mode, "batch_idx": self.batch_idx, "current": self.current, "loaders": loaders}
