"""``trainer.predict_loop``: what a ``trainer.predict`` run has produced so far, under Lightning's names.

``predictions`` (the kept outputs: one list, or one list per loader with several), ``epoch_batch_indices``
(per loader, per batch, the dataset indices of its samples) and ``current_batch_indices`` (the batch being
predicted, set before its hooks run). Prediction writers (``BasePredictionWriter``) read them. Indices are
known for plain ``DataLoader``s (``ember/data/batch_indices.py``); elsewhere they are empty lists.
"""

from __future__ import annotations

from typing import Any

from ember.data.batch_indices import IndexRecorder

__all__ = ["PredictionRecord"]


class PredictionRecord:
    """A predict run's outputs and batch indices (reset when the next predict starts)."""

    def __init__(self) -> None:
        self._outputs: list[list[Any]] = []
        self.epoch_batch_indices: list[list[list[int]]] = []
        self.current_batch_indices: list[int] = []

    @property
    def predictions(self) -> list[Any]:
        """The outputs kept (none with ``return_predictions=False``): a list per loader, or the one list."""
        return self._outputs[0] if len(self._outputs) == 1 else self._outputs

    def start(self, outputs: list[list[Any]], loaders: int) -> None:
        """A predict run begins over ``loaders`` loaders; ``outputs`` are the lists its outputs go into."""
        self._outputs = outputs
        self.epoch_batch_indices = [[] for _ in range(loaders)]
        self.current_batch_indices = []

    def batch(self, recorder: IndexRecorder | None, dl_idx: int, padding: bool) -> None:
        """A batch of loader ``dl_idx`` arrived: its indices become current (kept unless it is padding)."""
        self.current_batch_indices = recorder.take() if recorder is not None else []
        if not padding:
            self.epoch_batch_indices[dl_idx].append(self.current_batch_indices)
