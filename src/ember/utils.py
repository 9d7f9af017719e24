"""Where the small helpers that lived here went, re-exported so that ``from ember.utils import ...`` keeps working.

Each job has a module of its own now (all leaves, kept import-light: they are on ``import ember``'s path):

- :mod:`ember.batches`: nested batches (``move_to_device``, ``first_tensor``, ``infer_batch_size``)
  and ``sized_len``;
- :mod:`ember.metric_values`: logged values (``to_floats``, ``is_torchmetric``, ``metric_batch_value``);
- :mod:`ember.overrides`: which hooks are overridden (``is_overridden``, ``defines_hook``);
- :mod:`ember.names`: "did you mean" hints (``closest``).

New code imports from those modules.
"""

from __future__ import annotations

from ember.batches import first_tensor, infer_batch_size, move_to_device, sized_len
from ember.metric_values import is_torchmetric, metric_batch_value, to_floats
from ember.names import closest
from ember.overrides import defines_hook, is_overridden

__all__ = [
    "closest",
    "defines_hook",
    "first_tensor",
    "infer_batch_size",
    "is_overridden",
    "is_torchmetric",
    "metric_batch_value",
    "move_to_device",
    "sized_len",
    "to_floats",
]
