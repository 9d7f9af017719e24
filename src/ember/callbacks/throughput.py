"""ThroughputMonitor: samples/s, batches/s (and items/s, e.g. tokens), and how much of the time went to
waiting for data."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ember.batches import infer_batch_size
from ember.callbacks.callback import Callback
from ember.callbacks.logger_writes import logger_step, logs_after_this_batch, write_to_loggers

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer


class ThroughputMonitor(Callback):
    """Measure training throughput per process and log it at the Trainer's logging cadence.

    "Data wait" is the time from the end of one training batch to the start of the next (fetching
    and collating the batch, plus the Trainer's own work between batches); "compute" is from batch
    start to batch end (the step: forward, backward, optimizer). Validation time is left out.
    Per batch this costs two clock reads and a look at the batch's first tensor; the numbers are
    only divided out when they are logged.

    Samples are counted when a batch ends, from the batch ``on_train_batch_end`` gets (as Lightning's
    ``ThroughputMonitor``). With a ``training_step(self, dataloader_iter)`` that is the last batch the step
    fetched: a step that fetches one batch is counted exactly, one that fetches several counts as one
    batch of its last batch's size (as in Lightning), and the fetching is part of "compute".

    Logged (with ``prefix``, default "throughput/"): ``samples_per_sec``, ``batches_per_sec``,
    ``data_wait_frac`` (share of the time spent waiting for data), ``data_ms_per_batch`` and
    ``compute_ms_per_batch``, and with ``length_fn`` also ``items_per_sec``, all over the batches since
    the previous write; also at the end of each epoch for the batches not yet reported.

    Args:
        batch_size_fn: ``batch -> int`` samples in a batch; default: the length of the first
            dimension of the batch's first tensor.
        length_fn: ``batch -> int`` items in a batch (Lightning's argument: tokens of a language-model
            batch, say, padding included if the batch holds any); logged as ``items_per_sec``. None:
            items are not counted.
        prefix: put in front of the logged names.
    """

    uses_step_outputs = False  # the loop need not build {"loss": ...} for this callback

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int] | None = None,
        length_fn: Callable[[Any], int] | None = None,
        prefix: str = "throughput/",
    ) -> None:
        for name, fn in (("batch_size_fn", batch_size_fn), ("length_fn", length_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"ThroughputMonitor({name}=...) must be a function of the batch, got {fn!r}.")
        self.batch_size_fn = batch_size_fn or infer_batch_size
        self.length_fn = length_fn
        self.prefix = prefix
        #: The values computed last (also without a logger), for tests and notebooks.
        self.last_metrics: dict[str, float] = {}
        self._reset()
        self._last_end = 0.0
        self._batch_start = 0.0

    def _reset(self) -> None:
        self._samples = 0
        self._items = 0
        self._batches = 0
        self._wait = 0.0
        self._compute = 0.0

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._last_end = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._last_end = time.perf_counter()  # validation is neither data wait nor training compute

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        self._wait += now - self._last_end
        self._batch_start = now

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        self._compute += now - self._batch_start
        # Here, not at the batch's start: a dataloader_iter step has fetched its batch by now (at its start the
        # hooks get the previous step's, None at first), and a batch on_train_batch_start refused never ran.
        self._samples += self.batch_size_fn(batch)
        if self.length_fn is not None:
            self._items += self.length_fn(batch)
        self._batches += 1
        if logs_after_this_batch(trainer):
            self._emit(trainer, logger_step(trainer))
        self._last_end = time.perf_counter()

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._batches:  # the epoch's tail since the last write (all of it in short epochs)
            self._emit(trainer, logger_step(trainer))

    def _emit(self, trainer: Trainer, step: int) -> None:
        total = self._wait + self._compute
        if not self._batches or total <= 0:
            return
        p = self.prefix
        self.last_metrics = {
            f"{p}samples_per_sec": self._samples / total,
            f"{p}batches_per_sec": self._batches / total,
            f"{p}data_wait_frac": self._wait / total,
            f"{p}data_ms_per_batch": 1000.0 * self._wait / self._batches,
            f"{p}compute_ms_per_batch": 1000.0 * self._compute / self._batches,
        }
        if self.length_fn is not None:
            self.last_metrics[f"{p}items_per_sec"] = self._items / total
        self._reset()
        if trainer.loggers:
            write_to_loggers(trainer, self.last_metrics, step)
