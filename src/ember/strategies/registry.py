"""Strategy names -> factories. Third-party strategies register here too.

Factories are stored as ``"module:attr"`` strings so that naming a strategy imports only that
strategy (``import ember`` stays cheap, and ``ddp``'s launcher is not loaded for ``single``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ember.strategies.strategy import Strategy
from ember.utils import closest

_Factory = str | Callable[..., Strategy]
_REGISTRY: dict[str, tuple[_Factory, dict[str, Any], str]] = {}


def register_strategy(
    name: str, factory: _Factory, description: str = "", override: bool = False, **init_params: Any
) -> None:
    """Register ``factory`` (a Strategy class, a callable or a ``"module:attr"`` string) as ``name``.

    Args:
        name: the string users pass as ``Trainer(strategy=name)``.
        factory: what builds the strategy; called with ``init_params`` as keyword arguments.
        description: one line shown by ``available_strategies``.
        override: replace an existing registration instead of raising.
        **init_params: keyword arguments bound to this name (``"ddp_spawn"`` = ddp with spawn).
    """
    if name in _REGISTRY and not override:
        raise ValueError(f"A strategy named {name!r} is already registered. Pass override=True to replace it.")
    _REGISTRY[name] = (factory, init_params, description)


def available_strategies() -> list[str]:
    """Every registered strategy name, sorted."""
    return sorted(_REGISTRY)


def get_strategy(name: str, **extra: Any) -> Strategy:
    """Build the strategy registered as ``name``."""
    if name not in _REGISTRY:
        known = available_strategies()
        hint = closest(name, known)
        suggestion = f" Did you mean {hint!r}?" if hint else ""
        raise ValueError(
            f"Unknown strategy {name!r}.{suggestion} Registered strategies: {', '.join(known)}. "
            "Pass one of these names, a Strategy instance, or register your own with "
            "ember.strategies.register_strategy(name, factory)."
        )
    factory, params, _ = _REGISTRY[name]
    if isinstance(factory, str):
        mod, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(mod), attr)
    strategy = factory(**{**params, **extra})
    strategy.strategy_name = name
    return strategy


register_strategy("single", "ember.strategies.single:SingleDeviceStrategy", "one process, one device")
register_strategy("dp", "ember.strategies.dp:DataParallelStrategy", "one process, N replicas in threads")
register_strategy("ddp", "ember.strategies.ddp:DDPStrategy", "one process per device; script re-run or torchrun")
register_strategy(
    "ddp_spawn",
    "ember.strategies.ddp:DDPStrategy",
    "ddp, workers started with multiprocessing spawn",
    start_method="spawn",
)
