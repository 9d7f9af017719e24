"""Reading the parameters of a module's steps and hooks, as Lightning does: whether ``training_step`` (or
another step) takes ``batch_idx``, or is Lightning's ``dataloader_iter`` flavor. The call sites ask once
per run, never per step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def hook_parameters(hook: Any) -> tuple[list[str], bool, int] | None:
    """A bound hook's (or step's) parameters after ``self``: their names, whether it takes ``*args``, and how
    many of them have no default; None when they cannot be read (a builtin or otherwise opaque callable)."""
    fn = getattr(hook, "__wrapped__", hook)  # a decorated hook: read the function it wraps
    try:
        spec = inspect.getfullargspec(fn)
    except TypeError:
        return None
    # A bound method's first argument is self; so is that of a bound method that a wrapper (torch.compile's) wraps.
    args = spec.args[1:] if inspect.ismethod(hook) or inspect.ismethod(fn) else spec.args
    return args, spec.varargs is not None, len(args) - len(spec.defaults or ())


def takes_batch_idx(step: Callable[..., Any]) -> bool:
    """Whether a bound step method (``module.training_step``...) is to receive ``batch_idx``.

    As Lightning: yes when a parameter after ``batch`` is named ``batch_idx``, when it takes
    ``*args``, or when it has at least two parameters (the second one, whatever its name, is the
    index); ``def training_step(self, batch)`` gets the batch alone. The call sites ask once per run.
    """
    params = hook_parameters(step)
    if params is None:
        raise TypeError(f"cannot read the parameters of {step!r}")
    args, varargs, _ = params
    return "batch_idx" in args or varargs or len(args) >= 2


def takes_dataloader_iter(step: Any) -> bool:
    """Whether a bound step method is Lightning's ``dataloader_iter`` flavor, ``def training_step(self,
    dataloader_iter)``: a parameter of that name, declared (as Lightning asks). Such a step receives an
    iterator and fetches its own batches from it (``trainer/dataloader_iter.py``); it gets nothing else,
    no ``batch_idx``. The call sites ask once per run."""
    params = hook_parameters(step) if callable(step) else None
    return params is not None and "dataloader_iter" in params[0]
