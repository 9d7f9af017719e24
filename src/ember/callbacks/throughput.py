"""ThroughputMonitor: batches, samples, items and FLOPs per second of each stage, under Lightning's names.

Each stage (training, validation inside a fit or on its own, test, predict; never the sanity check) feeds a
:class:`~ember.utilities.throughput.Throughput` one update per batch: the time since the stage started and the
running totals of batches, samples and items. Rates are differences over the window of the last
``window_size`` updates, so the per-batch cost is a clock read (after a ``torch.cuda.synchronize()`` on a
GPU, without which the clock would time the launch of the work, not the work), the batch-size function and
a few appends; the divisions happen only when a write is due.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ember.batches import infer_batch_size
from ember.callbacks.callback import Callback
from ember.callbacks.logger_writes import logger_step, logs_after_this_batch, write_to_loggers
from ember.user_frames import user_stacklevel
from ember.utilities.throughput import Metrics, Throughput, check_window_arguments, get_available_flops

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer

# The setup hook's stage -> the running stages it measures (a fit validates too).
_STAGES = {"fit": ("train", "validate"), "validate": ("validate",), "test": ("test",), "predict": ("predict",)}
# The dtype the matmuls run in, by ``trainer.precision``: what the device's peak FLOP/s are looked up for.
_COMPUTE_DTYPES = {"64-true": torch.float64, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ThroughputMonitor(Callback):
    """Log the throughput of training, validation, test and predict, as Lightning's ``ThroughputMonitor``.

    Logged, each name prefixed with the stage (``train``, ``validate``, ``test``, ``predict``) and
    ``separator``: the stage's running ``time`` (seconds), ``batches``, ``samples`` and, with ``length_fn``,
    ``lengths``; once ``window_size`` batches are in, the rates over the last ``window_size`` of them:
    ``device/batches_per_sec``, ``device/samples_per_sec``, ``device/items_per_sec`` (with ``length_fn``),
    ``device/flops_per_sec`` (when the module has ``flops_per_batch``) and ``device/mfu`` (that over the
    device's peak, when known: see :func:`~ember.utilities.throughput.get_available_flops`; never on the CPU);
    on several processes also the rates of all of them (without ``device/``: this process's times the world
    size). Everything is measured and written on global rank zero only, to the loggers (unlike Lightning's,
    not into ``trainer.logged_metrics``).

    When: training after a batch that ends an accumulation window, on the steps the Trainer writes its own
    step metrics (every ``log_every_n_steps``), at the same step, with ``epoch``; an evaluation after every
    ``log_every_n_steps``-th batch of a run, at the stage's batch count as the step (for validation inside a
    fit, counted from the training epoch's start), as Lightning. A fit's validation time is left out of the
    training time. A fit restarts the counts; a standalone stage run again with the same callback carries them on.

    FLOPs: ``module.flops_per_batch`` (an attribute or property, read at each batch: see
    :func:`~ember.utilities.measure_flops`) is the work of one batch; without it a warning says so once and
    no FLOP rate is logged.

    ember's addition: ``train/data_wait_frac``, the share of the window's training time spent between
    batches, from one batch's end to the next one's start (fetching and collating the batch, moving it to the
    device, the Trainer's and callbacks' work in between; validation left out). A ``training_step(self,
    dataloader_iter)`` fetches inside its step, which then counts as the step's.

    Args:
        batch_size_fn: ``batch -> int``, the samples in a batch; default: the length of the first dimension of
            the batch's first tensor.
        length_fn: ``batch -> int``, the items in a batch (tokens, say, padding included if any); None: no
            ``lengths`` or ``items_per_sec``.
        window_size: how many of the latest batches the rates span (at least 2).
        separator: joins the parts of the names.
    """

    uses_step_outputs = False  # the loop need not build {"loss": ...} for this callback

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int] | None = None,
        length_fn: Callable[[Any], int] | None = None,
        *,
        window_size: int = 100,
        separator: str = "/",
    ) -> None:
        for name, fn in (("batch_size_fn", batch_size_fn), ("length_fn", length_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"ThroughputMonitor({name}=...) must be a function of the batch, got {fn!r}.")
        check_window_arguments("ThroughputMonitor", window_size, separator)
        self.batch_size_fn = batch_size_fn or infer_batch_size
        self.length_fn = length_fn
        self.window_size = window_size
        self.separator = separator
        #: The device's peak FLOP/s in the run's precision (set at setup; None when unknown, as on the CPU).
        self.available_flops: int | None = None
        self._throughputs: dict[str, Throughput] = {}
        self._t0: dict[str, float] = {}  # the clock at the stage's start (training's moved on past validations)
        self._batches: dict[str, int] = {}
        self._samples: dict[str, int] = {}
        self._lengths: dict[str, int] = {}
        # The step an evaluation writes at, by stage; a fit's validations have their own count, under "fit".
        self._eval_steps: dict[str, int] = {}
        self._steps_key = ""  # that of the evaluation running now
        self._run_batches = 0  # its batches so far: the write cadence counts these
        self._has_flops: bool | None = None  # looked up (and warned about) once
        self._rank_zero = True
        self._world_size = 1
        self._cuda: torch.device | None = None  # synchronized before each clock read
        # ember's data wait: seconds between batches so far, since when, and (time, wait) over the window.
        self._wait = 0.0
        self._wait_from = 0.0
        self._waits: deque[tuple[float, float]] = deque(maxlen=window_size)

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._rank_zero = trainer.is_global_zero
        self._world_size = trainer.world_size
        device = trainer.strategy.root_device
        self._cuda = device if device.type == "cuda" else None
        self.available_flops = get_available_flops(device, _COMPUTE_DTYPES.get(trainer.precision, torch.float32))
        for s in _STAGES.get(str(stage), ()):  # fresh windows for each run; the counts go on as _start says
            self._throughputs.pop(s, None)

    def _start(self, trainer: Trainer, stage: str) -> None:
        if not self._rank_zero:
            return
        if stage not in self._throughputs:
            self._throughputs[stage] = Throughput(
                available_flops=self.available_flops,
                world_size=self._world_size,
                window_size=self.window_size,
                separator=self.separator,
            )
        fitting = trainer.state.fn == "fit"
        if fitting or stage not in self._batches:
            self._throughputs[stage].reset()
            self._batches[stage] = self._samples[stage] = self._lengths[stage] = 0
        self._steps_key = "fit" if fitting else stage
        self._run_batches = 0
        self._t0[stage] = time.perf_counter()

    def _now(self) -> float:
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)  # the clock then reads when the device's work is done
        return time.perf_counter()

    def _update(self, stage: str, module: TrainModule, batch: Any, now: float) -> float:
        """Count ``batch`` into ``stage``'s totals and window; returns the stage's time."""
        elapsed = now - self._t0[stage]
        lengths = None
        if self.length_fn is not None:
            lengths = self._lengths[stage] = self._lengths[stage] + int(self.length_fn(batch))
        samples = self._samples[stage] = self._samples[stage] + int(self.batch_size_fn(batch))
        batches = self._batches[stage] = self._batches[stage] + 1
        flops = self._flops_per_batch(module)
        self._throughputs[stage].update(time=elapsed, batches=batches, samples=samples, lengths=lengths, flops=flops)
        return elapsed

    def _flops_per_batch(self, module: TrainModule) -> float | None:
        if self._has_flops is None:
            self._has_flops = hasattr(module, "flops_per_batch")
            if not self._has_flops:
                warnings.warn(
                    f"ThroughputMonitor: {type(module).__name__} has no `flops_per_batch` attribute or property, so "
                    "no FLOP/s or MFU is logged. Set it to the FLOPs of one batch (ember.utilities.measure_flops "
                    "counts them) to log them.",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
        return getattr(module, "flops_per_batch", None) if self._has_flops else None

    def _compute(self, stage: str) -> Metrics:
        sep = self.separator
        return {f"{stage}{sep}{k}": v for k, v in self._throughputs[stage].compute().items()}

    # Training.

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._start(trainer, "train")
        if self._rank_zero:
            self._wait, self._wait_from = 0.0, self._t0["train"]
            self._waits.clear()

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._eval_steps["fit"] = 0  # as Lightning: a fit's validation steps count from each training epoch's start

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        if self._rank_zero:
            self._wait += time.perf_counter() - self._wait_from

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._rank_zero:
            return
        now = self._now()
        self._waits.append((self._update("train", module, batch, now), self._wait))
        self._wait_from = now
        if not logs_after_this_batch(trainer):  # a window's end, at the Trainer's cadence
            return
        metrics = self._compute("train")
        if len(self._waits) == self.window_size:  # over the same window as the rates
            (t_first, w_first), (t_last, w_last) = self._waits[0], self._waits[-1]
            metrics[f"train{self.separator}data_wait_frac"] = (w_last - w_first) / (t_last - t_first)
        metrics["epoch"] = trainer.current_epoch  # as Lightning's writes of training throughput
        write_to_loggers(trainer, metrics, logger_step(trainer))

    # Evaluation.

    def _eval_batch_end(self, trainer: Trainer, module: TrainModule, stage: str, batch: Any) -> None:
        self._update(stage, module, batch, self._now())
        key = self._steps_key
        step = self._eval_steps[key] = self._eval_steps.get(key, 0) + 1
        self._run_batches += 1
        every = trainer.log_every_n_steps
        if trainer.loggers and every and (self._run_batches % every == 0 or trainer.should_stop):
            write_to_loggers(trainer, self._compute(stage), step)

    def on_validation_start(self, trainer: Trainer, module: TrainModule) -> None:
        if not trainer.sanity_checking:
            self._start(trainer, "validate")

    def on_validation_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._rank_zero and not trainer.sanity_checking:
            self._eval_batch_end(trainer, module, "validate", batch)

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        if not self._rank_zero or trainer.sanity_checking or trainer.state.fn != "fit" or "train" not in self._t0:
            return
        spent = time.perf_counter() - self._t0["validate"]
        self._t0["train"] += spent  # the training time (and its data wait) leaves the validation out
        self._wait_from += spent

    def on_test_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._start(trainer, "test")

    def on_test_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._rank_zero:
            self._eval_batch_end(trainer, module, "test", batch)

    def on_predict_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._start(trainer, "predict")

    def on_predict_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._rank_zero:
            self._eval_batch_end(trainer, module, "predict", batch)
