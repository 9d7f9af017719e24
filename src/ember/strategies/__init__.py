"""Strategies: how the Trainer places and parallelises a module. Pick one by name or pass an instance."""

from __future__ import annotations

from typing import Any

from ember.strategies.registry import available_strategies, get_strategy, register_strategy
from ember.strategies.single import SingleDeviceStrategy
from ember.strategies.strategy import Strategy

__all__ = [
    "Strategy",
    "SingleDeviceStrategy",
    "DataParallelStrategy",
    "DDPStrategy",
    "FSDPStrategy",
    "register_strategy",
    "get_strategy",
    "available_strategies",
]


def __getattr__(name: str) -> Any:
    # The parallel strategies pull in threads / torch.distributed machinery: import on first use.
    if name == "DataParallelStrategy":
        from ember.strategies.dp import DataParallelStrategy

        return DataParallelStrategy
    if name == "DDPStrategy":
        from ember.strategies.ddp import DDPStrategy

        return DDPStrategy
    if name == "FSDPStrategy":
        from ember.strategies.fsdp import FSDPStrategy

        return FSDPStrategy
    raise AttributeError(f"module 'ember.strategies' has no attribute {name!r}")
