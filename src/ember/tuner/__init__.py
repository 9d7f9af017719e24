"""Tools that choose settings before a fit: ``Tuner(trainer).lr_find(model)`` and
``Tuner(trainer).scale_batch_size(model)``, as Lightning's ``Tuner``."""

from ember.tuner.lr_finder import LRFinder
from ember.tuner.tuning import Tuner

__all__ = ["Tuner", "LRFinder"]
