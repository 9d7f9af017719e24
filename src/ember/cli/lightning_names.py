"""Names Lightning's ``cli`` module can be imported from only because it imports them itself (the Trainer,
the Callback base, ``seed_everything``...), here so that code importing them from there runs with the
import changed: ember's namesakes, and :func:`is_overridden` with Lightning's signature.
"""

from __future__ import annotations

from ember import overrides
from ember.callbacks.callback import Callback
from ember.data import DataModule
from ember.module import TrainModule
from ember.rng import seed_everything
from ember.trainer.trainer import Trainer
from ember.utilities.rank_zero import rank_zero_warn

__all__ = ["Callback", "Trainer", "is_overridden", "rank_zero_warn", "seed_everything"]


def is_overridden(method_name: str, instance: object | None = None, parent: type | None = None) -> bool:
    """Whether ``instance`` overrides ``parent``'s ``method_name`` (``ember.overrides.is_overridden``, with
    Lightning's argument names and defaults).

    Args:
        method_name: the method, e.g. ``"training_step"``.
        instance: the object; None is never overriding.
        parent: the class whose method is the default; None: ``TrainModule``, ``DataModule`` or ``Callback``,
            whichever ``instance`` is.
    """
    if instance is None:
        return False
    if parent is None:
        parent = next((base for base in (TrainModule, DataModule, Callback) if isinstance(instance, base)), None)
        if parent is None:
            raise ValueError(
                f"is_overridden({method_name!r}, {type(instance).__name__} object) needs parent=: the class whose "
                f"{method_name} is the default (the instance is no TrainModule, DataModule or Callback)."
            )
    return overrides.is_overridden(method_name, instance, parent)
