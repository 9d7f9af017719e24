"""The names ember's public API takes as strings, as ``Literal`` types.

A type checker then catches ``trainer.fit`` code that passes ``stage="train"`` or
``precision="fp16"``; at run time the values are plain strings, checked where they arrive (with
errors that list the accepted names). A leaf: everyone may import it.
"""
from __future__ import annotations

from typing import Literal, get_args

#: What a run is doing: the ``stage`` given to ``setup`` / ``teardown`` hooks and to
#: ``Strategy.process_dataloader``.
Stage = Literal["fit", "validate", "test", "predict"]

#: ``Trainer.state``: what the Trainer is doing now.
TrainerState = Literal["initializing", "fitting", "validating", "testing", "predicting", "finished"]

#: The precision names ``Trainer(precision=...)`` resolves to (``Trainer.precision``).
PrecisionName = Literal["32-true", "64-true", "bf16-mixed", "16-mixed"]

#: What ``Trainer(precision=...)`` accepts: a name, or one of its short forms.
PrecisionInput = Literal["32-true", "64-true", "bf16-mixed", "16-mixed", "32", "64", "bf16", "16", 32, 64, 16]

#: How values are combined across ranks (``Strategy.reduce``) and over an epoch (``self.log(reduce_fx=...)``).
ReduceOp = Literal["mean", "sum", "min", "max"]

#: The accepted reduce ops, in order, for run-time checks and messages.
REDUCE_OPS: tuple[ReduceOp, ...] = get_args(ReduceOp)
