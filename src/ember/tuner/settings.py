"""What the tuner borrows from the user's Trainer for a sweep, and gives back after it.

A sweep is a short ``trainer.fit`` on the user's own Trainer (so it runs on the same strategy,
devices and precision, and under ddp in every rank, as the real fit will), with a few settings
swapped: only the sweep's callback (no checkpoints, loggers or progress bar), a step limit, no
validation, no profiling. Everything swapped, and the counters and metrics a fit leaves behind, are put back
afterwards, whether the sweep succeeded or raised. The module's weights are copied before and
loaded back after, in memory: nothing is written to disk.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ember.profilers import PassThroughProfiler

if TYPE_CHECKING:
    from ember.callbacks.callback import Callback
    from ember.data import DataModule
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer

#: Trainer attributes a sweep may change; they are restored to the user's values after it.
_KEPT = (
    "callbacks",
    "profiler",
    "max_steps",
    "max_epochs",
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
    "num_sanity_val_steps",
    "should_stop",
    "history",
    "state",
    "ckpt_path",
    "val_check_interval",
)


@contextmanager
def borrowed(trainer: Trainer, module: TrainModule, callback: Callback | None, **settings: Any) -> Iterator[None]:
    """Run the block with ``trainer`` set up for a sweep (``callback`` its only callback, ``settings``
    applied) and give everything back after it: the Trainer's settings, counters and metrics, and the
    module's weights."""
    kept = {name: getattr(trainer, name) for name in _KEPT}
    kept["state"] = copy.copy(trainer.state)  # a live object the sweep's fit moves on: its values now
    progress = trainer.fit_state.progress  # a sweep's fit starts counters of its own
    kept["callbacks"] = list(trainer.callbacks)
    loggers = list(trainer.loggers)
    metrics = (dict(trainer.callback_metrics), dict(trainer.logged_metrics))
    weights = copy.deepcopy(module.state_dict())
    try:
        trainer.loggers = []
        trainer.callbacks = [callback] if callback is not None else []
        trainer.profiler = PassThroughProfiler()  # a profiler reports on the user's runs, not on the sweeps
        for name, value in settings.items():
            setattr(trainer, name, value)
        yield
    finally:
        for name, value in kept.items():
            setattr(trainer, name, value)
        trainer.fit_state.progress = progress
        trainer.loggers = loggers
        trainer.callback_metrics, trainer.logged_metrics = metrics
        module.load_state_dict(weights)


def holders(module: TrainModule, datamodule: DataModule | None, name: str) -> list[Any]:
    """Where attribute ``name`` lives, as Lightning looks: the module, its ``hparams``, the datamodule
    and its ``hparams`` (all of them: setting a value sets it everywhere, so they cannot disagree)."""
    found: list[Any] = []
    for owner in (module, datamodule):
        if owner is None:
            continue
        if name in type(owner).__dict__ or name in owner.__dict__ or _plain_attr(owner, name):
            found.append(owner)
        hparams = getattr(owner, "hparams", None)
        if isinstance(hparams, dict) and name in hparams:
            found.append(hparams)
    return found


def _plain_attr(owner: Any, name: str) -> bool:
    try:
        getattr(owner, name)
    except AttributeError:
        return False
    return True


def get_attr(places: list[Any], name: str) -> Any:
    first = places[0]
    return first[name] if isinstance(first, dict) else getattr(first, name)


def set_attr(places: list[Any], name: str, value: Any) -> None:
    for place in places:
        if isinstance(place, dict):
            place[name] = value
        else:
            setattr(place, name, value)
