"""ember: a lean PyTorch trainer in the style of Lightning, with in-house DP and DDP.

The names below are imported on first use (PEP 562), so that ``from ember.parallel import
DistributedDataParallel`` or a DataLoader worker importing a dataset module does not load the
trainer, the callbacks and the loggers as well.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ember.version import __version__

if TYPE_CHECKING:
    from ember import callbacks, profilers, strategies, tuner
    from ember.data import DataModule
    from ember.module import TrainModule
    from ember.seed import seed_everything
    from ember.trainer import Trainer

__all__ = ["Trainer", "TrainModule", "DataModule", "seed_everything", "callbacks", "strategies", "profilers", "tuner",
           "__version__"]

_WHERE = {"Trainer": "ember.trainer", "TrainModule": "ember.module", "DataModule": "ember.data",
          "seed_everything": "ember.seed", "callbacks": "ember.callbacks", "strategies": "ember.strategies",
          "profilers": "ember.profilers", "tuner": "ember.tuner"}


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
