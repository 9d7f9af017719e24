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
    "OnExceptionCheckpoint": "ember.callbacks.on_exception_checkpoint",
    "TQDMProgressBar": "ember.callbacks.tqdm_progress",
    "RichProgressBar": "ember.callbacks.rich_progress",
    "RichProgressBarTheme": "ember.callbacks.rich_progress",
    "LambdaCallback": "ember.callbacks.lambda_function",
    "GradientAccumulationScheduler": "ember.callbacks.gradient_accumulation",
    "BaseFinetuning": "ember.callbacks.finetuning",
    "BackboneFinetuning": "ember.callbacks.backbone_finetuning",
    "DeviceStatsMonitor": "ember.callbacks.device_stats",
    "StochasticWeightAveraging": "ember.callbacks.swa",
    "Checkpoint": "ember.callbacks.checkpoint_base",
    "BasePredictionWriter": "ember.callbacks.prediction_writer",
    "WeightAveraging": "ember.callbacks.weight_averaging",
    "EMAWeightAveraging": "ember.callbacks.weight_averaging",
    "RichModelSummary": "ember.callbacks.rich_model_summary",
    "SpikeDetection": "ember.callbacks.spike_detection",
}

# The loggers lived here before they moved to ember.loggers (where Lightning keeps them). Code written
# against the old path keeps working: these names are plain re-exports of ember.loggers' classes, loaded
# on first use (by module name, so this package does not import the loggers' layer at import time).
_MOVED_TO_LOGGERS = {
    "Logger": "ember.loggers.logger",
    "CSVLogger": "ember.loggers.csv_logger",
    "TensorBoardLogger": "ember.loggers.tensorboard",
}

__all__ = ["Callback", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name) or _MOVED_TO_LOGGERS.get(name)
    if module is None:
        raise AttributeError(f"module 'ember.callbacks' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module:
            raise
        raise AttributeError(f"ember.callbacks.{name} is not available in this build ({module} is missing)") from err
    return getattr(loaded, name)
