"""The profiler protocol: ``start(action)`` / ``stop(action)`` around named actions, a ``summary()``,
and where the report goes, with Lightning's ``Profiler`` API so a custom Lightning profiler ports over.

The Trainer calls ``setup`` when a run starts, names actions on the step path (hooks, the step,
backward, the optimizer step, the next batch) and calls ``describe`` when the run ends: the report
goes to ``dirpath/<stage>-<filename>[-<rank>].txt`` when a ``filename`` is given (one file per rank
under ddp, opened for appending, so a second fit adds to it and nothing is overwritten), else it is
printed on global rank zero.

Why "off costs nothing": the Trainer never calls a profiler per step when there is none. It asks
``wrap(profiler, action, fn)`` once per run for each callable it will call per step, and with the
``PassThroughProfiler`` (the default) gets ``fn`` itself back, so the step path is the same objects
as without this module. A real profiler gets a wrapper that times each call.
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO, TypeVar

T = TypeVar("T")


class Profiler(ABC):
    """Records named actions and reports on them; subclass it for a custom profiler.

    Args:
        dirpath: the folder of the report file (default: the trainer's ``log_dir``, else its
            ``default_root_dir``).
        filename: write the report to ``<stage>-<filename>[-<rank>].txt`` in ``dirpath`` instead of
            printing it (the ``.txt`` is added).
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str | None = None) -> None:
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.filename = filename
        self._output_file: TextIO | None = None
        self._stage: str | None = None
        self._rank: int | None = None

    @abstractmethod
    def start(self, action_name: str) -> None:
        """Start recording ``action_name``."""

    @abstractmethod
    def stop(self, action_name: str) -> None:
        """Stop recording ``action_name`` (started before)."""

    def summary(self) -> str:
        """The report, as text ("" for none)."""
        return ""

    @contextmanager
    def profile(self, action_name: str) -> Iterator[str]:
        """``with profiler.profile("load data"): ...`` records the block as one call of the action."""
        self.start(action_name)
        try:
            yield action_name
        finally:
            self.stop(action_name)

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        """Called by the Trainer when a run starts. ``local_rank`` is the process's rank when there are
        several (None for one), which goes into the report's file name."""
        self._stage = stage
        self._rank = local_rank
        self.dirpath = self.dirpath or log_dir

    def teardown(self, stage: str | None = None) -> None:
        """Called when a run ends: closes the report file."""
        if self._output_file is not None:
            self._output_file.close()
            self._output_file = None

    @property
    def local_rank(self) -> int:
        return 0 if self._rank is None else self._rank

    def report_path(self, action_name: str | None = None, extension: str = ".txt") -> str | None:
        """Where the report (or an action's file) goes: None when it is printed instead."""
        if not self.filename or not self.dirpath:
            return None
        parts = [p for p in (self._stage, self.filename) if p]
        if self._rank is not None:
            parts.append(str(self._rank))
        if action_name is not None:
            parts.append(action_name)
        base = re.sub(r"_+", "_", re.sub(r"[\\/:*?\"<>|\s]", "_", "-".join(parts))).strip() or "profile"
        return os.path.join(self.dirpath, base + extension)

    def describe(self) -> None:
        """Write the report to its file, or print it on rank zero; then tear down."""
        text = self.summary()
        path = self.report_path()
        if text and path is not None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._output_file = open(path, "a")  # appending: a second run adds its report
            self._output_file.write(text)
            self._output_file.flush()
        elif text and self.local_rank == 0:
            print(text)
        self.teardown(self._stage)

    def _stats_to_str(self, stats: dict[str, str]) -> str:
        stage = f"{self._stage.upper()} " if self._stage is not None else ""
        lines = [stage + "Profiler Report"]
        for action, value in stats.items():
            rank = f" rank: {self._rank}" if self._rank is not None else ""
            lines += [f"Profile stats for: {action}{rank}", value]
        return os.linesep.join(lines)


class PassThroughProfiler(Profiler):
    """No profiling: the default. ``wrap`` returns callables unchanged, so the step path is untouched."""

    def start(self, action_name: str) -> None:
        pass

    def stop(self, action_name: str) -> None:
        pass


def is_active(profiler: Profiler | None) -> bool:
    return profiler is not None and not isinstance(profiler, PassThroughProfiler)


class _Timed:
    """``fn`` called inside ``profiler.start(action)`` / ``stop(action)``. Keeps ``func`` (what the
    wrapped callable stands for) so code that looks at a hook's owner still finds it."""

    __slots__ = ("_fn", "_action", "_start", "_stop", "func")

    def __init__(self, profiler: Profiler, action: str, fn: Callable[..., Any]) -> None:
        self._fn, self._action = fn, action
        self._start, self._stop = profiler.start, profiler.stop
        self.func = getattr(fn, "func", fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._start(self._action)
        try:
            return self._fn(*args, **kwargs)
        finally:
            self._stop(self._action)

    def __getattr__(self, name: str) -> Any:  # attributes of the wrapped callable (e.g. a step's state)
        return getattr(self._fn, name)


def wrap(profiler: Profiler | None, action: str, fn: T) -> T:
    """``fn`` timed as ``action`` by ``profiler``; ``fn`` itself when there is no active profiler."""
    if not is_active(profiler):
        return fn
    assert profiler is not None
    return _Timed(profiler, action, fn)  # type: ignore[arg-type, return-value]


def iterate(profiler: Profiler | None, action: str, iterable: Iterable[T]) -> Iterable[T]:
    """``iterable`` with each ``next`` timed as ``action``; ``iterable`` itself without a profiler."""
    if not is_active(profiler):
        return iterable
    assert profiler is not None
    return _timed_iter(profiler, action, iterable)


def _timed_iter(profiler: Profiler, action: str, iterable: Iterable[T]) -> Iterator[T]:
    it = iter(iterable)
    while True:
        profiler.start(action)
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            profiler.stop(action)
        yield item
