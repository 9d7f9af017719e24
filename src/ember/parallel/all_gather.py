"""A differentiable all-gather: what ``all_gather(tensor, sync_grads=True)`` runs under ``ddp``.

Every rank receives every rank's tensor, stacked along a new first dimension, and may use all of
them in its loss (a contrastive loss over the global batch is the usual reason). So the gradient
that reaches rank ``r``'s input is the sum, over all ranks, of their gradients for slice ``r``: one
all-reduce (sum) of the whole gradient of the stacked result, after which rank ``r`` keeps slice
``r``. A reduce-scatter would move less data, but gloo has none, and this runs on both backends.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather"]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may still hold the incoming buffer
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def all_gather(tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
    """Every rank's ``tensor`` stacked along a new first dimension, on every rank.

    Args:
        tensor: the same shape and dtype on every rank.
        group: the process group (None: all processes).
        sync_grads: let gradients flow back to every rank's ``tensor`` (otherwise the result is detached).
    """
    if sync_grads:
        return _AllGather.apply(tensor, group)
    mine = tensor.detach().contiguous()
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return torch.stack(out)
