"""BasePredictionWriter: write ``trainer.predict``'s outputs as they come, per batch or per run (Lightning's).

Subclass it and override ``write_on_batch_end`` (called after each ``predict_step``) and/or
``write_on_epoch_end`` (called once, after the last batch, with every output); ``write_interval`` says
which of them run. Pair a per-batch writer with ``trainer.predict(..., return_predictions=False)`` so the
outputs are written out rather than also held in memory for the return value.

Under ``ddp`` every process runs the callback on its own shard of the data: each writes its own outputs
(name its files by ``trainer.global_rank``), and ``batch_indices`` are the dataset indices this process's
sampler gave for the batch. Predict shards are not padded: across the processes every sample is written
once, and one process may run a batch fewer than another.

The outputs and indices are the Trainer's ``trainer.predict_loop`` (``current_batch_indices``,
``epoch_batch_indices``, ``predictions``), as Lightning's: the Trainer keeps every output while a writer
writes per run, even with ``return_predictions=False``. Indices are known for plain ``DataLoader``s; for
other loaders (an ``IterableDataset``, a custom ``batch_sampler``) they are empty lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from ember.callbacks.callback import Callback
from ember.signatures import takes_dataloader_iter
from ember.utilities.enums import LightningEnum

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer
    from ember.types import Stage


class WriteInterval(LightningEnum):
    """When a prediction writer writes (Lightning's enum; its members equal their strings)."""

    BATCH = "batch"
    EPOCH = "epoch"
    BATCH_AND_EPOCH = "batch_and_epoch"

    @property
    def on_batch(self) -> bool:
        """Whether ``write_on_batch_end`` runs."""
        return self in (WriteInterval.BATCH, WriteInterval.BATCH_AND_EPOCH)

    @property
    def on_epoch(self) -> bool:
        """Whether ``write_on_epoch_end`` runs."""
        return self in (WriteInterval.EPOCH, WriteInterval.BATCH_AND_EPOCH)


class BasePredictionWriter(Callback):
    """Base class of callbacks that write predictions; override ``write_on_batch_end`` / ``write_on_epoch_end``.

    Args:
        write_interval: ``"batch"`` (``write_on_batch_end`` after each batch), ``"epoch"``
            (``write_on_epoch_end`` once with every output) or ``"batch_and_epoch"`` (both).

    Raises:
        ValueError: for any other ``write_interval``.
    """

    def __init__(self, write_interval: Literal["batch", "epoch", "batch_and_epoch"] = "batch") -> None:
        valid = [i.value for i in WriteInterval]
        if write_interval not in valid:
            raise ValueError(
                f"BasePredictionWriter(write_interval={write_interval!r}): expected one of {valid} ('batch' "
                "writes after each predict_step, 'epoch' once with every output, 'batch_and_epoch' both)."
            )
        self._interval = WriteInterval(write_interval)

    @property
    def interval(self) -> WriteInterval:
        """When this writer writes: ``WriteInterval.BATCH``, ``EPOCH`` or ``BATCH_AND_EPOCH`` (equal to
        ``"batch"``, ``"epoch"``, ``"batch_and_epoch"``), with ``.on_batch`` and ``.on_epoch``."""
        return self._interval

    def setup(self, trainer: Trainer, module: TrainModule, stage: Stage) -> None:
        if stage == "predict" and takes_dataloader_iter(module.predict_step):
            raise NotImplementedError(
                f"{type(self).__name__} cannot write the outputs of a predict_step(self, dataloader_iter): a step "
                "that fetches its own batches has no single batch (nor batch indices) to write them with. "
                "Take (batch, batch_idx) in predict_step, or write the outputs from the step itself."
            )

    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: TrainModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write the output of one batch (override with ``write_interval="batch"`` or ``"batch_and_epoch"``).

        Args:
            trainer: the Trainer.
            pl_module: the module.
            prediction: what ``predict_step`` returned for the batch.
            batch_indices: the dataset indices of the batch's samples (empty where they cannot be known).
            batch: the batch.
            batch_idx: the batch's index in its loader.
            dataloader_idx: the loader's index.
        """
        raise NotImplementedError(
            f"{type(self).__name__} writes per batch (write_interval={self._interval.value!r}) but does not "
            "override write_on_batch_end."
        )

    def write_on_epoch_end(
        self,
        trainer: Trainer,
        pl_module: TrainModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        """Write every output of the run (override with ``write_interval="epoch"`` or ``"batch_and_epoch"``).

        Args:
            trainer: the Trainer.
            pl_module: the module.
            predictions: the outputs, one per batch (with several loaders: a list per loader), as
                ``predict_step`` returned them.
            batch_indices: per loader, per batch, the dataset indices of its samples (empty where not known).
        """
        raise NotImplementedError(
            f"{type(self).__name__} writes per run (write_interval={self._interval.value!r}) but does not "
            "override write_on_epoch_end."
        )

    # ------------------------------------------------------------------ the hooks
    def on_predict_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._interval.on_batch:
            indices = trainer.predict_loop.current_batch_indices
            self.write_on_batch_end(trainer, module, outputs, indices, batch, batch_idx, dataloader_idx)

    def on_predict_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._interval.on_epoch:
            loop = trainer.predict_loop
            self.write_on_epoch_end(trainer, module, loop.predictions, loop.epoch_batch_indices)
