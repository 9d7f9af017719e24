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


def suggestions(name: str, known: list[str]) -> list[str]:
    """The names in ``known`` that ``name`` may be a typo of, closest first: those one slip away for a short
    name, up to a third of its letters for a long one (a wrong, missing, extra or swapped letter counts one, and
    case none: "dpp" is one from both "dp" and "ddp"), or else the most similar by ``difflib``."""
    limit = max(1, len(name) // 3)
    near = sorted((d, n) for n in known if (d := _typo_distance(name.lower(), n.lower())) <= limit)
    if near:
        return [n for _, n in near]
    hint = closest(name, known)
    return [hint] if hint else []


def _typo_distance(a: str, b: str) -> int:
    """The fewest one-letter edits (replace, insert, delete, or swap two neighbours) turning ``a`` into ``b``:
    the optimal string alignment distance, in which a transposition costs one (Levenshtein counts two)."""
    rows = [list(range(len(b) + 1))]
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def get_strategy(name: str, **extra: Any) -> Strategy:
    """Build the strategy registered as ``name``."""
    if name not in _REGISTRY:
        known = available_strategies()
        hints = suggestions(name, known)
        suggestion = f" Did you mean {' or '.join(repr(h) for h in hints)}?" if hints else ""
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
register_strategy(
    "fsdp",
    "ember.strategies.fsdp:FSDPStrategy",
    "one process per device, parameters, gradients and optimizer states sharded (PyTorch's FSDP2)",
)
for _find in (True, False):
    register_strategy(
        f"ddp_find_unused_parameters_{str(_find).lower()}",
        "ember.strategies.ddp:DDPStrategy",
        f"ddp with find_unused_parameters={_find}",
        find_unused_parameters=_find,
    )
    register_strategy(
        f"ddp_spawn_find_unused_parameters_{str(_find).lower()}",
        "ember.strategies.ddp:DDPStrategy",
        f"ddp_spawn with find_unused_parameters={_find}",
        start_method="spawn",
        find_unused_parameters=_find,
    )
del _find
