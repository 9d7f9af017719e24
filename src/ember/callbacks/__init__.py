"""Callbacks: progress, logging, checkpointing. One callback per file; imported on first use."""

from __future__ import annotations

import importlib
from typing import Any

from ember.callbacks.callback import Callback
from ember.callbacks.logger import Logger

# name -> module that defines it; loaded lazily so `import ember` does not pay for tensorboard etc.
_LAZY = {
    "ProgressBar": "ember.callbacks.progress_bar",
    "ModelSummary": "ember.callbacks.model_summary",
    "TensorBoardLogger": "ember.callbacks.tensorboard",
    "default_logger": "ember.callbacks.tensorboard",
    "CSVLogger": "ember.callbacks.csv_logger",
    "EarlyStopping": "ember.callbacks.early_stopping",
    "LearningRateMonitor": "ember.callbacks.lr_monitor",
    "ThroughputMonitor": "ember.callbacks.throughput",
    "Timer": "ember.callbacks.timer",
    "ModelCheckpoint": "ember.callbacks.model_checkpoint",
    "OnExceptionCheckpoint": "ember.callbacks.checkpoint_files",
    "TQDMProgressBar": "ember.callbacks.tqdm_progress",
    "LambdaCallback": "ember.callbacks.lambda_function",
    "GradientAccumulationScheduler": "ember.callbacks.gradient_accumulation",
    "BaseFinetuning": "ember.callbacks.finetuning",
    "BackboneFinetuning": "ember.callbacks.backbone_finetuning",
    "DeviceStatsMonitor": "ember.callbacks.device_stats",
}

__all__ = ["Callback", "Logger", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ember.callbacks' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module:
            raise
        raise AttributeError(f"ember.callbacks.{name} is not available in this build ({module} is missing)") from err
    return getattr(loaded, name)
