"""``grad_norm``: the norm of each parameter's gradient and of all of them together, for logging."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["grad_norm"]


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """The p-norm of every parameter's gradient, and of all gradients taken as one vector.

    Parameters without a gradient are left out. Typical use is in ``on_before_optimizer_step``:
    ``self.log_dict(grad_norm(self, norm_type=2))``.

    Args:
        module: the module whose parameters' gradients are measured.
        norm_type: the p of the p-norm: a positive number, or ``"inf"`` for the largest absolute value.
            Strings are converted with ``float``.
        group_separator: what joins ``grad_{p}_norm`` and the parameter's name in a key, so that loggers
            that group by ``/`` show the norms in a group of their own.

    Returns:
        ``{"grad_{p}_norm{sep}{name}": norm, ..., "grad_{p}_norm_total": total}`` with 0-dim tensors as
        values and ``p`` written as a float (``2.0``, ``inf``); empty when no parameter has a gradient.

    Raises:
        ValueError: ``norm_type`` is not a positive number.
    """
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {p}")
    norms = {
        f"grad_{p}_norm{group_separator}{name}": torch.linalg.vector_norm(param.grad.detach(), p)
        for name, param in module.named_parameters()
        if param.grad is not None
    }
    if norms:
        # The p-norm of the per-parameter p-norms is the p-norm of all gradients concatenated.
        norms[f"grad_{p}_norm_total"] = torch.linalg.vector_norm(torch.stack(list(norms.values())), p)
    return norms
