"""What the DDP engine's messages about parameters without a gradient tell the user to change."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UnusedParameterAdvice"]


@dataclass(frozen=True)
class UnusedParameterAdvice:
    """What the engine's messages about parameters without a gradient tell the user to change.

    The defaults speak to someone who constructs :class:`~ember.parallel.DistributedDataParallel`
    themselves. A framework that constructs it for its users (ember's ``ddp`` strategy) gives the
    words those users write instead: they never see the wrapper's constructor.

    Attributes:
        missing: What the error says after "these parameters received no gradient on rank r: [...]."
        all_used: What the warning says after "find_unused_parameters=True, but every parameter
            received a gradient in this iteration."; None: no warning from this process (a framework
            that warns once per job, from one rank).
    """

    missing: str = (
        "Every rank must reduce the same buckets, so each parameter that requires grad has to take part "
        "in computing the loss. Fix: make all forward outputs that depend on them feed the loss, set "
        "requires_grad=False on parameters you do not train, or construct the wrapper with "
        "find_unused_parameters=True (costs an autograd-graph walk per iteration)."
    )
    all_used: str | None = (
        "The autograd-graph walk costs time every step; pass find_unused_parameters=False if your model "
        "always uses all parameters."
    )
