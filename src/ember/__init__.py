"""ember: a lean PyTorch trainer in the style of Lightning, with in-house DP and DDP.

The names below are imported on first use (PEP 562), so that ``from ember.parallel import
DistributedDataParallel`` or a DataLoader worker importing a dataset module does not load the
trainer, the callbacks and the loggers as well.

ember's messages (``EarlyStopping(verbose=True)``, the checkpoint a resume restored, ...) go to the
``ember`` logger at INFO, as Lightning's go to its own: a program that configured no logging sees them
on stderr (global rank zero only), and one that did gets them through its own handlers instead.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import TYPE_CHECKING, Any

from ember.version import __version__


class _UnconfiguredHandler(logging.StreamHandler):
    """Prints ember's records while the root logger has no handler; once the program configures logging,
    the records reach its handlers by propagation and this one stays quiet (nothing is printed twice)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers or os.environ.get("RANK", "0") != "0":
            return
        super().emit(record)


_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
_logger.addHandler(_UnconfiguredHandler())

if TYPE_CHECKING:
    from ember import callbacks, loggers, profilers, strategies, tuner
    from ember.callbacks import Callback
    from ember.checkpoint import load_lightning_checkpoint
    from ember.data import DataModule
    from ember.module import TrainModule
    from ember.rng import seed_everything
    from ember.trainer import Trainer
    from ember.trainer.optim import TrainerOptimizer

__all__ = [
    "Trainer",
    "TrainerOptimizer",
    "TrainModule",
    "DataModule",
    "seed_everything",
    "Callback",
    "callbacks",
    "strategies",
    "loggers",
    "profilers",
    "tuner",
    "load_lightning_checkpoint",
    "__version__",
]

_WHERE = {
    "Trainer": "ember.trainer",
    "TrainerOptimizer": "ember.trainer.optim",
    "TrainModule": "ember.module",
    "DataModule": "ember.data",
    "seed_everything": "ember.rng",
    "Callback": "ember.callbacks",
    "callbacks": "ember.callbacks",
    "strategies": "ember.strategies",
    "loggers": "ember.loggers",
    "profilers": "ember.profilers",
    "tuner": "ember.tuner",
    "load_lightning_checkpoint": "ember.checkpoint",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    module = importlib.import_module(where)
    value = module if where == f"ember.{name}" else getattr(module, name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
