"""The Logger base class: a callback the Trainer feeds with metrics at its logging cadence.

The Trainer converts collected tensors to floats once per logging event and calls
``log_metrics`` on every logger; loggers only write (on global rank zero).
"""
from __future__ import annotations

from typing import Any

from ember.callbacks.callback import Callback


class Logger(Callback):
    """Base class of metric loggers (TensorBoard, CSV, ...)."""

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def version(self) -> int | str | None:
        return None

    @property
    def log_dir(self) -> str | None:
        """Directory this logger writes into (checkpoints go beside it by default)."""
        return None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at ``step`` (the global step)."""

    def log_hyperparams(self, params: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        """Record the run's hyper-parameters (and, optionally, final metrics beside them)."""

    def save(self) -> None:
        """Flush what is buffered."""

    def finalize(self, status: str) -> None:
        """Called once when a run ends: ``"success"``, ``"failed"`` or ``"interrupted"``."""
        self.save()
