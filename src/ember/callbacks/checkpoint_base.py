"""``Checkpoint``: the class every checkpointing callback derives from (Lightning's ``callbacks.Checkpoint``).

It adds no hook and no state. It is a marker: code that asks "does this run write checkpoints?" tests
``isinstance(cb, Checkpoint)``, so a checkpointing callback of the user's own is recognised beside
``ModelCheckpoint`` and ``OnExceptionCheckpoint``.
"""

from __future__ import annotations

from ember.callbacks.callback import Callback


class Checkpoint(Callback):
    """Base class of the callbacks that write checkpoints; subclass it for a checkpointing callback of your own."""
