"""Where a TrainModule's ``self.log`` goes when it is not its trainer's metric collector: the copies of a
module that a strategy runs (the replicas ``strategies/dp.py`` makes) log into a sink of their own; and
nowhere under ``Trainer(barebones=True)`` (:func:`logging_off`).

The redirects are kept here, by module ``id`` with a weak reference to the module and the sink, rather
than on the module, so that no attribute name is taken from the user's namespace; an entry goes with its
module. :data:`LOG_REDIRECTS` is a plain dict, not a WeakKeyDictionary: ``self.log`` asks whether it is
empty for every logged value, and a WeakKeyDictionary answers that in Python.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any

from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from torch import nn

#: Module ``id`` -> (a weak reference to the module, its sink). Read-only outside this module.
LOG_REDIRECTS: dict[int, tuple[weakref.ref[nn.Module], Any]] = {}


def redirect_log(module: nn.Module, sink: Any) -> None:
    """Send ``module.log`` calls to ``sink.log(name, value, **options)`` instead of its trainer's metric
    collector (``trainer.fit_state.metrics``): for a copy of the module a strategy runs, such as a DP replica."""
    key = id(module)
    LOG_REDIRECTS[key] = (weakref.ref(module), sink)
    weakref.finalize(module, _forget_redirect, key, LOG_REDIRECTS[key][0])


def _forget_redirect(key: int, ref: weakref.ref[nn.Module]) -> None:
    # Only the entry of the module that died (its id may already name a newer, redirected module).
    if LOG_REDIRECTS.get(key, (None,))[0] is ref:
        del LOG_REDIRECTS[key]


def redirected_sink(module: nn.Module) -> Any:
    """The sink ``redirect_log`` gave ``module``, or None (then its ``self.log`` goes to its trainer)."""
    entry = LOG_REDIRECTS.get(id(module))
    return entry[1] if entry is not None and entry[0]() is module else None


#: The trainers whose ``barebones`` mode was already named by a ``self.log`` call.
_WARNED_BAREBONES: weakref.WeakSet[Any] = weakref.WeakSet()


def logging_off(trainer: Any) -> bool:
    """Whether ``self.log`` / ``self.log_dict`` do nothing: under ``Trainer(barebones=True)``, as in Lightning.
    The first call under a trainer says so (a ``UserWarning``, on global rank zero)."""
    if trainer is None or getattr(trainer, "barebones", False) is not True:
        return False
    if trainer not in _WARNED_BAREBONES:
        _WARNED_BAREBONES.add(trainer)
        if trainer.is_global_zero:
            warnings.warn(
                "self.log() does nothing under Trainer(barebones=True): barebones mode turns logging off so "
                "that it measures the training loop alone (as Lightning). This is said once per Trainer; drop "
                "barebones=True for the values to reach callback_metrics, the progress bar and the loggers.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
    return True
