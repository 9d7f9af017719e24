"""Loggers, under the names Lightning users import them by (``lightning.pytorch.loggers``).

A logger is a callback the Trainer feeds with metrics: :class:`~ember.loggers.logger.Logger` is the
base, ``file_logger.py`` what the loggers that write under ``save_dir/name/version_N`` share, then
one logger per file (TensorBoard, CSV, MLflow). Each is imported on first use; the loggers of
optional services (MLflow) import their client package only when a run starts, so
``import ember.loggers`` works without them installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ember.loggers.logger import Logger

if TYPE_CHECKING:
    from ember.loggers.csv_logger import CSVLogger
    from ember.loggers.mlflow import MLFlowLogger
    from ember.loggers.tensorboard import TensorBoardLogger

# name -> module that defines it, imported on first use (tensorboard's writer is not cheap to import).
_LAZY = {
    "CSVLogger": "ember.loggers.csv_logger",
    "TensorBoardLogger": "ember.loggers.tensorboard",
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
