"""Loggers, under the names Lightning users import them by (``lightning.pytorch.loggers``).

A logger is a callback the Trainer feeds with metrics (``ember.callbacks.logger``), so the
TensorBoard and CSV loggers live beside the other callbacks and are re-exported here; the loggers of
optional services (MLflow) live in this package and import their client package
only when a run starts, so ``import ember.loggers`` works without them installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ember.callbacks.logger import Logger

if TYPE_CHECKING:
    from ember.callbacks.csv_logger import CSVLogger
    from ember.callbacks.tensorboard import TensorBoardLogger
    from ember.loggers.mlflow import MLFlowLogger

# name -> module that defines it, imported on first use (tensorboard's writer is not cheap to import).
_LAZY = {
    "CSVLogger": "ember.callbacks.csv_logger",
    "TensorBoardLogger": "ember.callbacks.tensorboard",
    "MLFlowLogger": "ember.loggers.mlflow",
}

__all__ = ["Logger", "CSVLogger", "TensorBoardLogger", "MLFlowLogger"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ember.loggers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
