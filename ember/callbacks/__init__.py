"""Callbacks: progress, logging, checkpointing. One callback per file; imported on first use."""
from __future__ import annotations

import importlib
from typing import Any

from ember.callbacks.callback import Callback
from ember.callbacks.logger import Logger

# name -> module that defines it; loaded lazily so `import ember` does not pay for tensorboard etc.
_LAZY = {
    "ProgressBar": "ember.callbacks.progress_bar",
}

__all__ = ["Callback", "Logger", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ember.callbacks' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
