"""``measure_flops``: the floating-point operations a forward (and backward) pass performs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["measure_flops"]


def measure_flops(
    model: torch.nn.Module,
    forward_fn: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """Count the FLOPs of one call of ``forward_fn``, and of the loss and backward pass when ``loss_fn`` is given.

    Counted by :class:`torch.utils.flop_counter.FlopCounterMode`, so a model and inputs built on the
    ``meta`` device cost no memory and no compute::

        with torch.device("meta"):
            model = MyModel()
            x = torch.randn(2, 32)
        forward = measure_flops(model, lambda: model(x))
        training = measure_flops(model, lambda: model(x), lambda y: y.sum())

    Args:
        model: the model measured (``forward_fn`` is what runs it).
        forward_fn: runs the model's forward pass and returns its output.
        loss_fn: turns that output into a scalar loss; when given, the loss and its ``backward()`` count too.

    Returns:
        The total number of FLOPs counted.
    """
    counter = FlopCounterMode(display=False)
    with counter:
        output = forward_fn()
        if loss_fn is not None:
            loss_fn(output).backward()
    return counter.get_total_flops()
