"""The names ember's public API takes as strings, as ``Literal`` types.

A type checker then catches ``trainer.fit`` code that passes ``stage="train"`` or
``precision="fp16"``; at run time the values are plain strings, checked where they arrive (with
errors that list the accepted names). A leaf: everyone may import it.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

#: What a run is doing: the ``stage`` given to ``setup`` / ``teardown`` hooks and to
#: ``Strategy.process_dataloader``.
Stage = Literal["fit", "validate", "test", "predict"]

#: The precision names ``Trainer(precision=...)`` resolves to (``Trainer.precision``).
PrecisionName = Literal["32-true", "64-true", "bf16-mixed", "16-mixed"]

#: What ``Trainer(precision=...)`` accepts: a name, or one of its short forms.
PrecisionInput = Literal["32-true", "64-true", "bf16-mixed", "16-mixed", "32", "64", "bf16", "16", 32, 64, 16]

#: How values are combined across ranks (``Strategy.reduce``) and over an epoch (``self.log(reduce_fx=...)``).
ReduceOp = Literal["mean", "sum", "min", "max"]

#: The accepted reduce ops, in order, for run-time checks and messages.
REDUCE_OPS: tuple[ReduceOp, ...] = get_args(ReduceOp)

#: What ``self.log(reduce_fx=...)`` accepts, as Lightning does: one of ``REDUCE_OPS`` in any case, ``"avg"``
#: for ``"mean"``, or the function itself (``torch.mean``, ``torch.sum`` / ``sum``, ``torch.max`` / ``max``,
#: ``torch.min`` / ``min``).
ReduceFx = str | Callable[..., Any]

# The functions reduce_fx may name, as Lightning accepts them.
_REDUCE_FUNCTIONS: dict[Callable[..., Any], ReduceOp] = {
    torch.mean: "mean",
    torch.sum: "sum",
    builtins.sum: "sum",
    torch.max: "max",
    builtins.max: "max",
    torch.min: "min",
    builtins.min: "min",
}


def parse_reduce_fx(name: str, reduce_fx: ReduceFx) -> ReduceOp:
    """``reduce_fx`` as one of ``REDUCE_OPS``: a name in any case (``"avg"`` is ``"mean"``) or the function.

    Raises:
        ValueError: for anything else (a custom reduction), saying what is accepted.
    """
    if isinstance(reduce_fx, str):
        op = reduce_fx.lower()
        op = "mean" if op == "avg" else op
        if op in REDUCE_OPS:
            return op
    else:
        try:
            return _REDUCE_FUNCTIONS[reduce_fx]
        except (KeyError, TypeError):  # TypeError: an unhashable object
            pass
    raise ValueError(
        f"self.log({name!r}, reduce_fx={reduce_fx!r}): reduce_fx must be one of {REDUCE_OPS} (any case, or "
        "'avg' for 'mean') or one of torch.mean, torch.sum, torch.max, torch.min, sum, max, min. For another "
        "reduction, keep the values yourself and log the result in an epoch-end hook."
    )


@dataclass
class SchedulerConfig:
    """One LR scheduler and when to step it (Lightning's ``LRSchedulerConfig``; ``trainer.lr_scheduler_configs``
    holds these, and a callback that swaps a scheduler in, as ``StochasticWeightAveraging`` does, builds one).

    ``reduce_on_plateau``: step it with the ``monitor``-ed metric (default: whether it is a
    ``ReduceLROnPlateau``); ``monitor`` is read for such schedulers only, as in Lightning.
    """

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None
    reduce_on_plateau: bool | None = None

    def __post_init__(self) -> None:
        if self.reduce_on_plateau is None:
            self.reduce_on_plateau = isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    @property
    def is_plateau(self) -> bool:
        return bool(self.reduce_on_plateau)
