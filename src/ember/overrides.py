"""Whether a module, datamodule or callback overrides a hook: as Lightning decides it (:func:`is_overridden`),
and whether the Trainer must call it (:func:`defines_hook`).

A leaf, kept import-light: it is on ``import ember``'s path.
"""

from __future__ import annotations

import functools
from typing import Any

from lightning_utilities.core.overrides import is_overridden as _lightning_is_overridden


def is_overridden(name: str, obj: Any, base: type) -> bool:
    """Whether ``obj`` overrides ``base``'s ``name``, as Lightning decides it (lightning-utilities'
    ``is_overridden``): for what a run does (does fit validate, whose batch-transfer hook runs, is
    ``prepare_data`` called). ``None`` on the instance is not overridden; a wrapper (``functools.wraps``,
    ``Mock(wraps=...)``, ``functools.partial``) is looked through, so a wrapper of the default is not.

    Which hooks the Trainer *calls* is :func:`defines_hook`'s answer: a wrapper of the default must run.

    Args:
        name: the hook or method name, e.g. ``"validation_step"``.
        obj: the module, datamodule or callback, or None (then nothing is overridden).
        base: the class whose implementation is the default (``TrainModule``, ``DataModule``, ``Callback``).
    """
    return _lightning_is_overridden(name, obj, base)


def defines_hook(name: str, obj: Any, base: type) -> bool:
    """Whether the Trainer must call ``obj``'s hook ``name``: the attribute (looked up on the object, so one
    set on the instance counts) is neither None nor ``base``'s own default. The Trainer skips the hooks
    that are not, so an unused hook costs nothing per step.

    Unlike :func:`is_overridden` (a decision, as Lightning's), a wrapper of the default
    (``functools.wraps``, a ``Mock``) counts: Lightning calls every hook, so skipping a wrapper would skip
    what it does. A ``functools.partial`` is looked through to its function.

    Args:
        name: the hook name, e.g. ``"on_train_start"``.
        obj: the module, datamodule or callback, or None.
        base: the class whose implementation is the default.
    """
    attr = getattr(obj, name, None)
    if attr is None:
        return False
    if isinstance(attr, functools.partial):
        attr = attr.func
    code = getattr(attr, "__code__", None)
    return code is None or code is not getattr(getattr(base, name, None), "__code__", None)
