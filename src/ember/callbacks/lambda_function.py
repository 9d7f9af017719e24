"""LambdaCallback: a callback made of plain functions, one per hook, as Lightning's.

``LambdaCallback(on_train_epoch_end=lambda trainer, module: ...)`` saves writing a class for a
one-line hook. Each function is kept on the instance; the hook dispatch (``callback.overrides``)
counts an instance's own hook as an override, so only the hooks given here run, and the others
still cost nothing per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ember.callbacks.callback import HOOKS, Callback


class LambdaCallback(Callback):
    """Run the given functions at their hooks; each is called as ``fn(trainer, module, *hook_args)``.

    Args:
        **hooks: hook name (any of ``Callback``'s hooks: ``setup``, ``on_fit_start``,
            ``on_train_batch_end``, ``on_save_checkpoint``, ...) to the function that runs there.

    Raises:
        TypeError: for a name that is not a hook (a misspelt hook would otherwise never run), or a
            value that is not callable.
    """

    def __init__(self, **hooks: Callable[..., Any] | None) -> None:
        unknown = sorted(set(hooks) - set(HOOKS))
        if unknown:
            raise TypeError(
                f"LambdaCallback got {unknown}, which are not callback hooks. The hooks are: {', '.join(HOOKS)}."
            )
        for name, fn in hooks.items():
            if fn is None:  # as Lightning: None means no function at that hook
                continue
            if not callable(fn):
                raise TypeError(f"LambdaCallback({name}=...) must be a function, got {type(fn).__name__}.")
            setattr(self, name, fn)
