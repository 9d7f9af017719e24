"""``AttributeDict`` and ``is_picklable`` under Lightning's names and signatures (both live in ``ember.hparams``)."""

from __future__ import annotations

from ember import hparams
from ember.hparams import AttributeDict

__all__ = ["AttributeDict", "is_picklable"]


def is_picklable(obj: object) -> bool:
    """Whether ``pickle.dumps(obj)`` succeeds (what ``save_hyperparameters`` keeps).

    Args:
        obj: the object to try.

    Returns:
        ``False`` when pickling raises a pickling, attribute, runtime or type error; ``True`` otherwise.
    """
    return hparams.is_picklable(obj)
