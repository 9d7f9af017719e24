"""Callbacks: progress, monitoring, checkpointing. One callback per file; imported on first use.

Loggers are callbacks too, but live in :mod:`ember.loggers`, where Lightning keeps them.
"""

from __future__ import annotations

import importlib
from typing import Any

from ember.callbacks.callback import Callback

# name -> module that defines it; loaded lazily so `import ember` does not pay for what a run does not use.
_LAZY = {
    "ProgressBar": "ember.callbacks.progress_bar",
    "ModelSummary": "ember.callbacks.model_summary",
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

# The loggers lived here before they moved to ember.loggers (as Lightning's); say where they are now.
_MOVED_TO_LOGGERS = ("Logger", "CSVLogger", "TensorBoardLogger")

__all__ = ["Callback", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if name in _MOVED_TO_LOGGERS:
            # ImportError, not AttributeError: `from ember.callbacks import CSVLogger` would swallow the
            # latter's message into a bare "cannot import name".
            raise ImportError(
                f"ember.callbacks has no {name}: loggers live in ember.loggers, as in Lightning "
                f"(lightning.pytorch.loggers). Use ember.loggers.{name} (from ember.loggers import {name})."
            )
        raise AttributeError(f"module 'ember.callbacks' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module:
            raise
        raise AttributeError(f"ember.callbacks.{name} is not available in this build ({module} is missing)") from err
    return getattr(loaded, name)
