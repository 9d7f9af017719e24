"""Where a warning about the user's code should point: the user's line, not ember's.

A warning raised deep in a fit (``Trainer.fit`` -> the strategy's launch -> the stages -> the loaders...) at a
fixed ``stacklevel`` points at whichever ember frame sits that many levels up, and that depth differs by
strategy (a ddp launcher adds frames). :func:`user_stacklevel` counts instead: the ``stacklevel`` of the first
frame, going out from its caller, whose code is not ember's, so ``warnings.warn(..., stacklevel=user_stacklevel())``
names the user's ``trainer.fit(...)`` line (or their hook that called into ember).

Two kinds of frames that are not ember's are not the user's either:

- torch's and the standard library's plumbing between the user's call and ember's code: ``nn.Module.__call__``
  (the user's ``ddp(x)`` reaches ember's ``forward`` through it), ``Tensor.backward`` and autograd (a gradient
  hook), ``torch.no_grad`` and ``contextlib`` wrappers, lightning-utilities' ``rank_zero_only``. They are
  passed over.
- the start of a thread or of a worker process (``threading``, ``multiprocessing``, ``concurrent.futures``,
  ``runpy`` for ``python -m ember...``): a
  thread ember started, or a ``ddp_spawn`` worker, has no user code below it. Pointing at ``threading.py`` would
  mislead, so the level returned is past the outermost frame: Python then names no file at all
  (``sys:1: UserWarning: ...``), and the warning is still shown once per message.
"""

from __future__ import annotations

import os
import sys

_EMBER = os.path.dirname(os.path.abspath(__file__)) + os.sep

# Files passed over (neither ember's nor the user's), as path endings.
_PLUMBING_FILES = tuple(
    os.sep + os.path.join(*parts)
    for parts in (
        ("torch", "nn", "modules", "module.py"),
        ("torch", "utils", "_contextlib.py"),
        ("torch", "_tensor.py"),
        ("lightning_utilities", "core", "rank_zero.py"),
    )
)
_PLUMBING_DIRS = (os.sep + os.path.join("torch", "autograd") + os.sep,)
# Standard-library modules whose frames are plumbing, and packages whose frames start a thread or a process
# (compared by their file, read from sys.modules: a frame in one of them means it is imported).
_PLUMBING_MODULES = ("contextlib", "functools")
_ENTRY_MODULES = ("threading", "multiprocessing", "concurrent.futures")


def _module_file(name: str) -> str | None:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if path is None:
        return None
    path = os.path.abspath(path)
    # A package: every file in its directory.
    return os.path.dirname(path) + os.sep if os.path.basename(path) == "__init__.py" else path


def _is_plumbing(path: str) -> bool:
    if path.startswith("<frozen importlib"):  # an ``import`` of an ember module that warns when imported
        return True
    if path.endswith(_PLUMBING_FILES) or any(d in path for d in _PLUMBING_DIRS):
        return True
    return any(path == _module_file(name) for name in _PLUMBING_MODULES)


def _is_entry(path: str) -> bool:
    if path == "<frozen runpy>":  # ``python -m ember...``: nothing of the user's below
        return True
    for name in _ENTRY_MODULES:
        where = _module_file(name)
        if where is not None and (path == where or (where.endswith(os.sep) and path.startswith(where))):
            return True
    return False


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called by this function's caller that points at the first frame
    outside ember and torch's plumbing; past the outermost frame (Python then names ``sys``) when there is none,
    as in a thread or a worker process ember started."""
    frame = sys._getframe(1)  # the caller: the function about to warn (stacklevel 1)  # noqa: SLF001
    level = 1
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith("<"):
            path = os.path.abspath(path)
        if _is_entry(path):
            break
        if not path.startswith(_EMBER) and not _is_plumbing(path):
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    while frame is not None:  # no user frame: count the rest, to point past them all
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
