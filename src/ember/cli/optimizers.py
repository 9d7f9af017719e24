"""Optimizers and LR schedulers chosen in a config: the types a module's parameters take them by, the
scheduler that names the metric it reads, and how EmberCLI gives a module the ones the command line chose.

A module that takes its optimizer as an argument types it :data:`OptimizerCallable` (and its scheduler
:data:`LRSchedulerCallable`): the config names the class and its arguments, the module calls it on its
parameters. A module that does not can leave both to the CLI: ``--optimizer Adam --optimizer.lr 0.01
--lr_scheduler ReduceLROnPlateau --lr_scheduler.monitor val/loss`` (``auto_configure_optimizers``, on
by default). The CLI builds them on the module's parameters before the run, and the module's
``configure_optimizers`` returns them (:func:`give_module`, whose return value
``EmberCLI.configure_optimizers`` shapes). torch's ``ReduceLROnPlateau`` knows no metric name, so a
config picks this package's :class:`ReduceLROnPlateau`, which takes ``monitor``.

Imports no jsonargparse: these names are importable without the ``cli`` extra.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable
from typing import Any, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ember.cli.instantiate import instantiate_class
from ember.module import TrainModule
from ember.overrides import is_overridden
from ember.user_frames import user_stacklevel
from ember.utilities.rank_zero import rank_zero_warn

__all__ = [
    "LRSchedulerCallable",
    "LRSchedulerType",
    "LRSchedulerTypeTuple",
    "LRSchedulerTypeUnion",
    "OptimizerCallable",
    "ReduceLROnPlateau",
    "give_module",
]

#: The ``link_to`` of an optimizer or scheduler group that the CLI hands to the module itself.
AUTOMATIC = "AUTOMATIC"


class ReduceLROnPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """torch's ``ReduceLROnPlateau`` that also names the logged metric it reads, so that a config can choose
    it: ``--lr_scheduler ReduceLROnPlateau --lr_scheduler.monitor val/loss``.

    Args:
        optimizer: the optimizer whose learning rates it lowers.
        monitor: the logged metric (a key of ``trainer.callback_metrics``) it steps on.
        *args, **kwargs: torch's ``ReduceLROnPlateau`` arguments (``mode``, ``factor``, ``patience``...).
    """

    def __init__(self, optimizer: Optimizer, monitor: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **kwargs)
        self.monitor = monitor


#: The scheduler classes a config may name for ``--lr_scheduler`` (torch's plateau class has no ``monitor``).
LRSchedulerTypeTuple = (LRScheduler, ReduceLROnPlateau)
LRSchedulerTypeUnion = Union[LRScheduler, ReduceLROnPlateau]  # noqa: UP007  (Lightning's alias, as a Union)
LRSchedulerType = Union[type[LRScheduler], type[ReduceLROnPlateau]]  # noqa: UP007
#: A module parameter's type for an optimizer the config chooses: called with the parameters to optimize.
OptimizerCallable = Callable[[Iterable], Optimizer]
#: A module parameter's type for a scheduler the config chooses: called with the optimizer.
LRSchedulerCallable = Callable[[Optimizer], Union[LRScheduler, ReduceLROnPlateau]]  # noqa: UP007


def automatic_keys(groups: dict[str, tuple[Any, str]], base: type | tuple[type, ...]) -> list[str]:
    """The keys of the groups (``{key: (class or classes, link_to)}``) whose classes derive from ``base`` and
    that the CLI hands to the module itself (``link_to`` is ``"AUTOMATIC"``)."""
    keys = []
    for key, (classes, link_to) in groups.items():
        classes = classes if isinstance(classes, tuple) else (classes,)
        if link_to == AUTOMATIC and any(issubclass(c, base) for c in classes):
            keys.append(key)
    return keys


def class_spec(cls: type | tuple[type, ...], value: Any) -> dict[str, Any] | None:
    """``{"class_path": ..., "init_args": ...}`` for a group's parsed value: a group of one class holds only its
    arguments, a group of several the spec itself. None when the config chose nothing."""
    if value is None:
        return None
    as_dict = value.as_dict() if hasattr(value, "as_dict") else dict(value)
    if isinstance(cls, tuple):
        return as_dict or None
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": as_dict}


def give_module(
    cli_name: str,
    module: TrainModule,
    optimizer_spec: dict[str, Any],
    scheduler_spec: dict[str, Any] | None,
    shape: Callable[..., Any],
) -> None:
    """Build the chosen optimizer on ``module``'s parameters (and the scheduler on it), and make the module's
    ``configure_optimizers`` return what ``shape(module, optimizer=..., lr_scheduler=...)`` makes of them.

    The module's own ``configure_optimizers``, if it has one, is replaced, with a warning: the command line
    chose the optimizer. The replacement is set on this module object only.
    """
    if is_overridden("configure_optimizers", module, TrainModule):
        rank_zero_warn(
            f"{type(module).__name__}.configure_optimizers is replaced by {cli_name}.configure_optimizers: the "
            "config chose the optimizer. Pass auto_configure_optimizers=False to keep the module's own.",
            stacklevel=user_stacklevel() + 3,
        )
    optimizer = instantiate_class(module.parameters(), optimizer_spec)
    scheduler = instantiate_class(optimizer, scheduler_spec) if scheduler_spec else None
    returns = functools.partial(shape, optimizer=optimizer, lr_scheduler=scheduler)
    functools.update_wrapper(returns, shape)  # (named as the CLI's method, so it reads as overridden)
    module.configure_optimizers = types.MethodType(returns, module)  # type: ignore[method-assign]
