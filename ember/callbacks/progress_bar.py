"""A tqdm progress bar on global rank zero, showing ``prog_bar`` metrics.

Per-step cost is one counter increment: tqdm redraws at most every ``refresh_rate``-th batch and
the metrics (which live on the device) are converted to numbers only when a redraw happens.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any

from ember.callbacks.callback import Callback
from ember.trainer.metrics import to_floats


def _fmt(value: float) -> str:
    return f"{value:.4g}"


class ProgressBar(Callback):
    """Progress bars for training, validation, testing and prediction.

    Args:
        refresh_rate: redraw every n batches (0 disables the bar).
        leave: keep each epoch's finished bar on screen.
    """

    def __init__(self, refresh_rate: int = 1, leave: bool = True) -> None:
        self.refresh_rate = refresh_rate
        self.leave = leave
        self._train: Any = None
        self._eval: Any = None
        self._enabled = True
        self._last_draw = 0.0

    def _bar(self, total: float, desc: str, leave: bool, position: int = 0) -> Any:
        from tqdm.auto import tqdm

        return tqdm(total=None if total == math.inf else int(total), desc=desc, leave=leave, position=position,
                    dynamic_ncols=True, file=sys.stdout, mininterval=0.1, smoothing=0)

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        self._enabled = self.refresh_rate > 0 and trainer.is_global_zero

    def _postfix(self, trainer: Any) -> dict[str, str]:
        metrics = to_floats(trainer.progress_bar_metrics)
        return {k: _fmt(v) for k, v in metrics.items()}

    # ------------------------------------------------------------------ training
    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if not self._enabled:
            return
        if self._train is not None:
            self._train.close()
        self._train = self._bar(trainer.num_training_batches, f"Epoch {trainer.current_epoch}", self.leave)
        self._train.update(trainer.progress.batch_in_epoch)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        bar = self._train
        if bar is None or (batch_idx + 1) % self.refresh_rate:
            return
        bar.n = batch_idx + 1
        # Redraw at most every `mininterval` seconds; only then are metrics converted to numbers.
        now = time.monotonic()
        if now - self._last_draw >= bar.mininterval:
            self._last_draw = now
            bar.set_postfix(self._postfix(trainer), refresh=False)
            bar.refresh()

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if self._train is not None:
            self._train.n = trainer.progress.batch_in_epoch
            self._train.set_postfix(self._postfix(trainer), refresh=False)
            self._train.refresh()

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self._close()

    # ------------------------------------------------------------------ evaluation
    def _eval_start(self, trainer: Any, desc: str, total: float) -> None:
        if not self._enabled:
            return
        self._eval = self._bar(total, desc, leave=not trainer.training and self.leave,
                               position=1 if trainer.training or trainer.sanity_checking else 0)

    def _eval_step(self, batch_idx: int) -> None:
        if self._eval is not None and (batch_idx + 1) % self.refresh_rate == 0:
            self._eval.update(self.refresh_rate)

    def _eval_end(self, trainer: Any) -> None:
        if self._eval is not None:
            if self._eval.total is not None:
                self._eval.n = self._eval.total  # a finished evaluation shows a full bar
            self._eval.refresh()
            self._eval.close()
            self._eval = None

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        self._eval_start(trainer, "Sanity check" if trainer.sanity_checking else "Validation", trainer._eval_total)

    def on_validation_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step(batch_idx)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        self._eval_end(trainer)

    def on_test_start(self, trainer: Any, module: Any) -> None:
        self._eval_start(trainer, "Testing", trainer._eval_total)

    def on_test_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step(batch_idx)

    def on_test_end(self, trainer: Any, module: Any) -> None:
        self._eval_end(trainer)

    def on_predict_start(self, trainer: Any, module: Any) -> None:
        self._eval_start(trainer, "Predicting", trainer._eval_total)

    def on_predict_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step(batch_idx)

    def on_predict_end(self, trainer: Any, module: Any) -> None:
        self._eval_end(trainer)

    def _close(self) -> None:
        for bar in (self._train, self._eval):
            if bar is not None:
                bar.close()
        self._train = self._eval = None

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: Any, module: Any, stage: str) -> None:
        self._close()
