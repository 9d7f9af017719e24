"""No host-device synchronisation in the steady state of a CUDA fit.

With the progress bar, a per-step ``self.log(..., prog_bar=True)`` and the TensorBoard logger on,
a training step that is not a logging step must not wait for the GPU: the values stay on the
device until something is printed or written. Logging steps and the bar's redraws may
synchronise, at most once each (``ember.utils.to_floats`` copies all values in one go).

Two checks: the step itself (``on_train_batch_start`` up to the callbacks' ``on_train_batch_end``)
runs under ``torch.cuda.set_sync_debug_mode("error")``, so a synchronising call raises where it
happens; and a whole fit under ``"warn"`` counts the synchronisations between two batch starts
(transfer of the batch, step, bar, step-metric writes), step by step. ``16-mixed`` is left out:
torch's GradScaler reads its inf/NaN flag on the host in every ``step`` (by design, in Lightning too).
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from ember.callbacks import Callback, ProgressBar
from ember.loggers import TensorBoardLogger
from tests.cuda.cuda_helpers import SYNC_LOG_EVERY as LOG_EVERY
from tests.cuda.cuda_helpers import SYNC_MODULES as MODULES
from tests.cuda.cuda_helpers import loader, needs_cuda, trainer

pytestmark = [needs_cuda, pytest.mark.timeout(120)]
SYNC_WARNING = "called a synchronizing CUDA operation"


def _restore_sync_mode():
    torch.cuda.set_sync_debug_mode("default")


class StrictSteps(Callback):
    """Steps other than logging steps (and the first, which creates state) run under "error"."""

    def __init__(self) -> None:
        self.strict_steps = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        logging_step = (trainer.global_step + 1) % LOG_EVERY == 0
        if batch_idx > 0 and not logging_step:
            self.strict_steps += 1
            torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        # Listed before the progress bar, which the Trainer appends after the user's callbacks: the
        # bar's redraw (allowed to synchronise) runs after this.
        _restore_sync_mode()

    def on_exception(self, trainer, module, exception):
        _restore_sync_mode()


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_non_logging_steps_do_not_synchronise(tmp_path, precision, module):
    guard = StrictSteps()
    stream = io.StringIO()
    t = trainer(
        max_epochs=2,
        precision=precision,
        log_every_n_steps=LOG_EVERY,
        default_root_dir=tmp_path,
        logger=TensorBoardLogger(save_dir=tmp_path),
        enable_progress_bar=True,
        callbacks=[guard, ProgressBar(mode="bar", stream=stream)],
    )
    try:
        t.fit(MODULES[module](), loader(n=256))
    finally:
        _restore_sync_mode()
    assert t.global_step == 32 and guard.strict_steps >= 20
    assert "loss=" in stream.getvalue()  # the bar did show the logged value
    if module == "many values":
        assert "m5_step=" in stream.getvalue()
        assert t.callback_metrics["m19_epoch"].device.type == "cuda"  # accumulated on the device


class CountSyncs(Callback):
    """Counts the synchronisation warnings between two batch starts, and whether the bar redrew."""

    def __init__(self, caught: list, stream: io.StringIO) -> None:
        self.caught, self.stream = caught, stream
        self.marks: list[tuple[int, int, int]] = []  # (global step before the batch, warnings so far, output size)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.marks.append((trainer.global_step, len(self._syncs()), len(self.stream.getvalue())))

    def _syncs(self) -> list:
        return [w for w in self.caught if SYNC_WARNING in str(w.message)]


@pytest.mark.parametrize("module", MODULES)
def test_each_step_synchronises_at_most_once_per_log_write_and_per_redraw(tmp_path, module):
    stream = io.StringIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counter = CountSyncs(caught, stream)
        t = trainer(
            max_epochs=1,
            log_every_n_steps=LOG_EVERY,
            default_root_dir=tmp_path,
            enable_checkpointing=True,
            logger=TensorBoardLogger(save_dir=tmp_path),
            enable_progress_bar=True,
            callbacks=[counter, ProgressBar(mode="bar", stream=stream)],
        )
        torch.cuda.set_sync_debug_mode("warn")
        try:
            t.fit(MODULES[module](), loader(n=256))
        finally:
            _restore_sync_mode()
    marks = counter.marks
    assert len(marks) == 16
    report = []
    for (step, syncs, size), (_, next_syncs, next_size) in zip(marks[1:], marks[2:]):
        # From this batch's start to the next one's: the step, the bar, the step-metric write, and the
        # transfer of the next batch.
        allowed = int((step + 1) % LOG_EVERY == 0) + int(next_size != size)
        report.append((step + 1, next_syncs - syncs, allowed))
    too_many = [r for r in report if r[1] > r[2]]
    assert not too_many, f"(step, synchronisations, allowed) where a step synchronised too often: {too_many}"
