"""Hook dispatch: who runs hook ``name``, in which order, and what ``self.log`` inside it defaults to."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import Callback
from ember.module import TrainModule
from ember.overrides import defines_hook
from ember.profilers.base import wrap

if TYPE_CHECKING:
    from ember.trainer.metrics import MetricCollector
    from ember.trainer.trainer import Trainer


class Hooks:
    """The callables behind each hook of one run: callbacks that override it (in their order), then the module.

    Built once per run (the callbacks may change between runs through ``configure_callbacks``); each
    name is looked up once, so a hook nobody overrides costs nothing inside the loops. With the
    trainer's profiler on, each callable is timed as ``[Callback]<class>.<hook>`` or
    ``[TrainModule]<class>.<hook>``; with it off, the callables are the bound hooks themselves.

    Args:
        trainer: passed to callback hooks as their first argument.
        callbacks: the run's callbacks.
        module: the run's TrainModule (None before a run attaches one).
        metrics: told which hook runs (``fx``), which decides ``self.log``'s on_step/on_epoch defaults.
    """

    def __init__(
        self, trainer: Trainer, callbacks: Sequence[Callback], module: TrainModule | None, metrics: MetricCollector
    ) -> None:
        self._trainer = trainer
        self._callbacks = list(callbacks)
        self._module = module
        self._metrics = metrics
        self._table: dict[tuple[str, bool | None], list[Callable[..., Any]]] = {}

    def get(self, name: str, monitoring: bool | None = None) -> list[Callable[..., Any]]:
        """Bound callables for hook ``name``: overriding callbacks first, then the module.

        ``monitoring`` selects callbacks that watch metrics (``monitors_metrics = True``, e.g.
        checkpointing and early stopping) or the others; they run after the module's epoch-end hook.
        """
        key = (name, monitoring)
        table = self._table.get(key)
        if table is not None:
            return table
        table = []
        profiler = getattr(self._trainer, "profiler", None)
        base = getattr(Callback, name, None)
        for cb in self._callbacks:
            if monitoring is not None and bool(cb.monitors_metrics) != monitoring:
                continue
            if base is not None and defines_hook(name, cb, Callback):
                table.append(
                    wrap(
                        profiler,
                        f"[Callback]{type(cb).__name__}.{name}",
                        functools.partial(getattr(cb, name), self._trainer, self._module),
                    )
                )
        module = self._module
        if (
            module is not None
            and monitoring is not True
            and hasattr(TrainModule, name)
            and defines_hook(name, module, TrainModule)
        ):
            table.append(wrap(profiler, f"[TrainModule]{type(module).__name__}.{name}", getattr(module, name)))
        self._table[key] = table
        return table

    def call(self, name: str, *args: Any, monitoring: bool | None = None, **kwargs: Any) -> None:
        """Run hook ``name`` on everyone that overrides it."""
        hooks = self.get(name, monitoring)
        if hooks:
            self._metrics.fx = name
            for h in hooks:
                h(*args, **kwargs)
