"""Numeric precision: 32-true, 64-true, bf16-mixed (autocast) and 16-mixed (autocast + GradScaler)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ember.types import PrecisionName

if TYPE_CHECKING:
    from ember.strategies.strategy import Strategy

_ALIASES: dict[str | int, PrecisionName] = {
    "32": "32-true",
    32: "32-true",
    "32-true": "32-true",
    "64": "64-true",
    64: "64-true",
    "64-true": "64-true",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "16": "16-mixed",
    16: "16-mixed",
    "16-mixed": "16-mixed",
}


def normalize_precision(value: Any) -> PrecisionName:
    if value is None:  # as Lightning: the default
        return "32-true"
    if value not in _ALIASES:
        raise ValueError(f"Unknown precision {value!r}. Use one of '32-true', '64-true', 'bf16-mixed', '16-mixed'.")
    return _ALIASES[value]


class Precision:
    """Applies one precision setting to the module, the batch, forward and the optimizer step.

    Args:
        precision: one of "32-true", "64-true", "bf16-mixed", "16-mixed" (or their aliases).
        device_type: "cpu" or "cuda", for autocast and the GradScaler.
        in_module: the strategy also applies the mixed precision to the module itself (fsdp's
            ``MixedPrecisionPolicy``, under the same autocast, as Lightning's fsdp): a 16-mixed GradScaler
            whose inf checks agree across the ranks of sharded gradients.
    """

    def __init__(self, precision: Any, device_type: str, in_module: bool = False) -> None:
        self.precision = normalize_precision(precision)
        self.device_type = device_type
        self.scaler: torch.amp.GradScaler | None = None
        if self.precision == "16-mixed":
            if in_module:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(device_type)
            else:
                self.scaler = torch.amp.GradScaler(device_type)
        self.autocast_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.precision)

    @property
    def input_dtype(self) -> torch.dtype | None:
        """Floating inputs are cast to this dtype (only for 64-true)."""
        return torch.float64 if self.precision == "64-true" else None

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.double() if self.precision == "64-true" else module

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale before clipping or inspection."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        strategy: Strategy,
        closure: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Step ``optimizer`` through the strategy, or the scaler when there is one (after the closure, whose
        gradients it must see); ``kwargs`` go on to the optimizer's ``step``."""
        if self.scaler is None:
            return strategy.optimizer_step(optimizer, closure, **kwargs)
        if closure is not None:
            closure()
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
