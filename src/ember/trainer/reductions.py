"""One logged key of the :class:`~ember.trainer.metrics.MetricCollector` and the reductions of its values:
over an epoch on this process (:meth:`MetricEntry.accumulate`, in place) and across processes
(:func:`reduce_across_processes`, one collective per epoch).

As in ``metrics.py``, nothing here waits for a device per step: only the epoch's cross-process reduction
reads a value back (whether every rank logged the same names).
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import torch

from ember.types import ReduceOp

if TYPE_CHECKING:
    from ember.strategies.strategy import Strategy

# What a rank that has no value of a key contributes to its cross-rank reduction (with weight 0).
IDENTITY: dict[str, float] = {"mean": 0.0, "sum": 0.0, "max": -float("inf"), "min": float("inf")}
#: The fields a checkpoint saves of an entry, in ``MetricEntry``'s argument order.
ENTRY_FIELDS = ("name", "prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "sync_dist")


class MetricEntry:
    """One logged key of a stage: its ``self.log`` options and its running epoch total."""

    __slots__ = (
        "name",
        "prog_bar",
        "logger",
        "on_step",
        "on_epoch",
        "reduce_fx",
        "sync_dist",
        "total",
        "weight",
        "step_key",
        "epoch_key",
        "loader",
        "metric",
    )

    def __init__(
        self,
        name: str,
        prog_bar: bool,
        logger: bool,
        on_step: bool,
        on_epoch: bool,
        reduce_fx: ReduceOp,
        sync_dist: bool,
        suffix: str = "",
        loader: str = "",
    ) -> None:
        #: The key (the logged name, and ``/dataloader_idx_i`` when several evaluation loaders log it).
        self.name = name + suffix
        self.prog_bar, self.logger = prog_bar, logger
        self.on_step, self.on_epoch, self.reduce_fx, self.sync_dist = on_step, on_epoch, reduce_fx, sync_dist
        self.total: Any = None
        self.weight: Any = 0
        #: Where the per-step and the epoch values appear (``name_step`` / ``name_epoch`` when both are kept).
        both = on_step and on_epoch
        self.step_key = f"{name}_step{suffix}" if both else self.name
        self.epoch_key = f"{name}_epoch{suffix}" if both else self.name
        #: The evaluation loader (its key suffix) that logged it first.
        self.loader = loader
        #: The ``torchmetrics.Metric`` logged under this name (None for numbers and tensors).
        self.metric: Any = None

    def accumulate(self, value: torch.Tensor, batch_size: int) -> None:
        """Fold one step's ``value`` (weighted by ``batch_size`` for a mean) into the running epoch total."""
        total, fx = self.total, self.reduce_fx
        if total is None:
            # A tensor of our own, never the logged one, so that later values can be added into it in place.
            self.total = value * batch_size if fx == "mean" else value.clone()
            self.weight = batch_size
            return
        # In place (one kernel, no allocation: this runs for every logged value of every step) whenever that
        # gives what the out-of-place sum would: same dtype and device, and no autograd graph kept. A float64
        # value into a float32 total promotes it, as ``+`` does; after that it is in place again.
        in_place = (
            isinstance(total, torch.Tensor)
            and value.dtype is total.dtype
            and value.device == total.device
            and not (value.requires_grad or total.requires_grad)
        )
        if fx == "mean":
            if in_place:
                total.add_(value, alpha=batch_size)
            else:
                self.total = total + value * batch_size
            self.weight += batch_size
        elif fx == "sum":
            if in_place:
                total.add_(value)
            else:
                self.total = total + value
        elif fx == "max":
            self.total = torch.maximum(total, value)
        else:
            self.total = torch.minimum(total, value)


def reduce_across_processes(strategy: Strategy, rows: list[tuple[str, ReduceOp, Any, Any]]) -> list[Any]:
    """Reduce ``(name, reduce_fx, total, weight)`` rows: a weighted mean, or a sum / max / min."""
    if strategy.world_size == 1:
        return [epoch_value(fx, total, weight) for _, fx, total, weight in rows]
    # One collective per epoch: gather (total, weight) of every key from every rank, reduce here.
    device = strategy.root_device
    names_hash = float(zlib.crc32("\0".join(name for name, *_ in rows).encode()))
    flat = [torch.tensor(names_hash, dtype=torch.float64, device=device)]
    for _, _, total, weight in rows:
        flat.append(torch.as_tensor(total, dtype=torch.float64, device=device).reshape(()))
        flat.append(torch.as_tensor(weight, dtype=torch.float64, device=device).reshape(()))
    gathered = strategy.gather_per_rank(torch.stack(flat))  # [world, 1 + 2k]
    if not bool((gathered[:, 0] == gathered[0, 0]).all()):
        raise RuntimeError(
            "Processes logged different metric names at epoch end, so their values cannot be reduced together. "
            f"This process logged {[name for name, *_ in rows]}. Log the same names on every rank."
        )
    results = []
    for i, (_, fx, _, _) in enumerate(rows):
        totals, weights = gathered[:, 1 + 2 * i], gathered[:, 2 + 2 * i]
        if fx == "mean":
            v = totals.sum() / weights.sum()
        elif fx == "sum":
            v = totals.sum()
        elif fx == "max":
            v = totals.max()
        else:
            v = totals.min()
        results.append(v.float())
    return results


def epoch_value(fx: ReduceOp, total: Any, weight: Any) -> Any:
    """One process's epoch value from its running ``total``: never the total itself when later values are added
    into it in place (a sum), so that a published value, once read, stays what it was."""
    if fx == "mean":
        return total / weight
    return total.clone() if fx == "sum" and isinstance(total, torch.Tensor) else total
