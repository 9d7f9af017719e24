"""The fit loop: the whole training schedule, top to bottom (``epoch_loop.py`` runs an epoch's batches, ``step.py``
one batch, ``evaluation.py`` the evaluation loops).

A fit, as in Lightning::

    [a resume: the optimizers, schedulers and progress are restored]
    [sanity check] on_sanity_check_start -> val_dataloader() -> validation -> on_sanity_check_end
    train_dataloader() (and val_dataloader() when no sanity check requested it and the first epoch validates;
        otherwise at the start of the first epoch that does)
    [a resume: the data position and RNG states are restored]
    on_train_start
    per epoch: on_train_epoch_start, per batch (epoch_loop.py):
        on_before_batch_transfer -> transfer_batch_to_device -> on_after_batch_transfer -> on_train_batch_start
        the step (step.py); global_step += 1 when the optimizer stepped
        step-interval schedulers (lr_scheduler_step) whose frequency divides batch_idx + 1; after the epoch's
        last batch, epoch-interval ones
        on_train_batch_end -> step metrics to the loggers every log_every_n_steps
        [validation due] on_validation_model_zero_grad, validation, its epoch metrics to the loggers
        step-interval ReduceLROnPlateau schedulers (after the validation whose metrics they may monitor)
        step boundary: callbacks that save mid-epoch (``on_train_step_boundary``), a pending stop signal
    epoch end: on_train_epoch_end (non-monitoring callbacks, then the module) -> epoch metrics reduced
        (across processes too) -> monitoring callbacks (the progress bar's epoch line, early stopping, then
        checkpointing: checkpoint callbacks run last) -> ReduceLROnPlateau
    on_train_end
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ember.exceptions import PossibleUserWarning
from ember.profilers.base import wrap
from ember.rng import apply_rng, capture_rng
from ember.signatures import takes_dataloader_iter
from ember.trainer.arguments import default_epoch_limits
from ember.trainer.epoch_loop import EpochLoop
from ember.trainer.loaders import set_loader_epoch
from ember.user_frames import user_stacklevel

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ember.checkpoint.restore import Restore
    from ember.trainer.evaluation import EvaluationLoop
    from ember.trainer.hooks import Hooks
    from ember.trainer.loaders import FitData
    from ember.trainer.log_writer import LogWriter
    from ember.trainer.metrics import MetricCollector
    from ember.trainer.optim import OptimizerState
    from ember.trainer.preemption import PreemptionHandler
    from ember.trainer.step import TrainingStep
    from ember.trainer.trainer import Trainer


class FitLoop:
    """Runs a fit: the sanity check, then epochs (each epoch's batches by :class:`EpochLoop`) until a limit or a stop.

    Args:
        trainer: the public state the loop reads and writes (``progress``, ``should_stop``, the
            schedule arguments) and hands to callbacks.
        hooks, metrics, optim: the run's hooks, ``self.log`` collector, optimizers and schedulers.
        data: the fit's loaders.
        logs: writes step and epoch metrics to the loggers.
        evaluation: runs validation and the sanity check.
        step: runs one training batch.
        input_dtype: floating inputs are cast to it (64-true), or None.
    """

    def __init__(
        self,
        trainer: Trainer,
        *,
        hooks: Hooks,
        metrics: MetricCollector,
        optim: OptimizerState,
        data: FitData,
        logs: LogWriter,
        evaluation: EvaluationLoop,
        step: TrainingStep,
        input_dtype: Any,
    ) -> None:
        self.trainer, self.hooks, self.metrics, self.optim = trainer, hooks, metrics, optim
        self.data, self.logs, self.evaluation, self.step = data, logs, evaluation, step
        self.input_dtype = input_dtype
        self.progress = trainer.progress
        #: Each epoch's batches (epoch_loop.py).
        self.epoch_loop = EpochLoop(
            trainer,
            hooks=hooks,
            metrics=metrics,
            optim=optim,
            data=data,
            logs=logs,
            evaluation=evaluation,
            step=step,
            input_dtype=input_dtype,
            can_stop=self.can_stop,
        )
        self._keep_train_stage = False  # the first epoch keeps what on_train_start logged
        self._loaded_at = 0  # the epoch whose loaders are in use (reload_dataloaders_every_n_epochs)
        self._said_continue = False  # the "min_epochs / min_steps not met" line was logged this fit
        #: Whether this run's training_step takes ``dataloader_iter`` (fetches its own batches): decided in ``run``.
        self.fetches_batches = False

    @property
    def writes_step_metrics(self) -> bool:
        """Whether the loop writes step metrics once the current batch is done (decided before
        ``on_train_batch_end``, for callbacks that log beside ``self.log``)."""
        return self.epoch_loop.writes_step_metrics

    @property
    def log_step(self) -> int:
        """The step loggers get (see ``callbacks/logger_writes.logger_step``): the steps taken before the
        current batch's step; at an epoch's end, the index of its last step."""
        return self.epoch_loop.log_step

    # ------------------------------------------------------------------ fit
    def run(self, resume: Restore | None = None, preemption: PreemptionHandler | None = None) -> None:
        """Train until a limit or a stop, completing ``resume`` (if any) on the way, as in Lightning."""
        t, p, data = self.trainer, self.progress, self.data
        self.fetches_batches = takes_dataloader_iter(self.step.module.training_step)
        # Before any stage opens: self.log in training then needs batch_size (as Lightning).
        self.metrics.training_fetches_batches = self.fetches_batches
        if self.fetches_batches and getattr(self.step, "evaluates_loss", False) and t.is_global_zero:
            warnings.warn(
                f"{type(t.optimizers[0]).__name__}.step calls its closure, and so training_step, several times "
                "per step, and a training_step(self, dataloader_iter) fetches new batches each time it runs. "
                "Fetch the step's batches once (keep them for the later calls), or use an optimizer whose step "
                "takes no closure.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        if resume is not None:
            resume.load("training")
        if t.num_sanity_val_steps and data.validates:  # on a resume too, as in Lightning
            self._sanity_check()
        if t.limit_train_batches == 0:  # as Lightning: no training at all, not even its loader or hooks
            return
        data.request_train()
        data.request_val_for_epoch(p.current_epoch)
        self._check_val_interval()
        n, every = data.num_training_batches, t.log_every_n_steps
        if t.loggers and n < every and not t.fast_dev_run and t.is_global_zero:  # as Lightning (rank zero)
            warnings.warn(
                f"The number of training batches ({n}) is smaller than the logging interval "
                f"Trainer(log_every_n_steps={every}). Set a lower value for log_every_n_steps if you want "
                "to see logs for the training epoch.",
                PossibleUserWarning,
                stacklevel=user_stacklevel(),
            )
        if resume is not None:
            resume.load("data")
        # As Lightning (max_epochs=0, max_steps=0, a finished run resumed, a stop requested before training
        # that the minimums allow): no train hooks.
        if self._done() or (t.should_stop and self.can_stop()):
            return
        if (p.batch_in_epoch == 0 and p.steps_in_epoch == 0) or p.epoch_finished:
            # Values logged in on_train_start (per epoch by default) count toward the first epoch run.
            self.metrics.start_stage("train")
            self._keep_train_stage = True
        else:
            self.metrics.resume_stage("train")  # mid-epoch resume: keep the restored accumulations
        self.hooks.call("on_train_start")
        self._loaded_at = p.current_epoch
        # The batch loop of this run, chosen once: a training_step(self, dataloader_iter) fetches its own batches.
        batches = self.epoch_loop.run_iter if self.fetches_batches else self.epoch_loop.run
        run_epoch = wrap(t.profiler, "run_training_epoch", self._run_epoch)  # (itself when not profiling)
        while not self._done():
            if t.should_stop and self.can_stop():  # also a stop requested before the first epoch, as Lightning
                break
            run_epoch(batches, preemption)
        self.hooks.call("on_train_end")

    def _sanity_check(self) -> None:
        """A few validation batches before training; their metrics are thrown away, and the random
        generators are put back as they were (as Lightning), so training draws the same numbers with
        or without a sanity check (a shuffled validation loader or dropout in it would draw from them)."""
        t, metrics = self.trainer, self.metrics
        saved = (dict(metrics.callback_metrics), dict(metrics.progress_bar_metrics))
        rng = capture_rng()
        t.sanity_checking = True
        try:
            self.hooks.call("on_sanity_check_start")
            self.data.request_val()  # requested here, as in Lightning
            limits = [min(n, t.num_sanity_val_steps) for n in self.data.num_val_batches]
            t.num_sanity_val_batches = limits
            for loader in self.data.val_loaders:
                set_loader_epoch(loader, self.progress.current_epoch)
            self.evaluation.run("sanity", self.data.val_loaders, limits)
            metrics.callback_metrics, metrics.progress_bar_metrics = saved
            self.hooks.call("on_sanity_check_end")  # still sanity checking, as in Lightning
        finally:
            t.sanity_checking = False
            metrics.callback_metrics, metrics.progress_bar_metrics = saved
        apply_rng(rng)

    def can_stop(self) -> bool:
        """Whether ``should_stop`` may end training now: ``min_epochs`` epochs finished and ``min_steps``
        steps taken (as Lightning, which says once that training continues otherwise)."""
        t, p = self.trainer, self.progress
        if p.current_epoch >= (t.min_epochs or 0) and (t.min_steps is None or p.global_step >= t.min_steps):
            return True
        if not self._said_continue:
            self._said_continue = True
            log.info(
                "Trainer was signaled to stop but the required min_epochs=%s or min_steps=%s has not been met. "
                "Training will continue...",
                t.min_epochs,
                t.min_steps,
            )
        return False

    def _done(self) -> bool:
        t = self.trainer
        limit = t.max_epochs  # (settled when the fit started)
        return self._max_steps_reached() or (limit is not None and limit != -1 and self.progress.current_epoch >= limit)

    def _max_steps_reached(self) -> bool:
        max_steps = self.trainer.max_steps
        return max_steps != -1 and self.progress.global_step >= max_steps

    def _check_val_interval(self) -> None:
        """The validation interval against the training batches, before the first epoch (validation then
        follows it: ``EpochLoop``)."""
        t, data = self.trainer, self.data
        v, n = t.val_check_interval, data.num_training_batches
        if (
            isinstance(v, int)
            and t.check_val_every_n_epoch is not None
            and data.plans_validation
            and n != math.inf
            and v > n
        ):
            raise ValueError(
                f"val_check_interval={v} is larger than the {int(n)} training batches per epoch, so "
                "validation would never run. Lower it, or set check_val_every_n_epoch=None to count "
                "batches across epochs."
            )
        if isinstance(v, float) and v != 1.0 and data.plans_validation and n == math.inf:
            raise ValueError(
                f"val_check_interval={v} is a fraction of an epoch, but the train dataloader has no "
                "length, so validation would never run mid-epoch. Pass an int number of batches, or an "
                "int limit_train_batches."
            )

    # ------------------------------------------------------------------ one epoch
    def _run_epoch(
        self, batches: Callable[[PreemptionHandler | None], bool], preemption: PreemptionHandler | None
    ) -> None:
        """One epoch: its start, its ``batches`` (which say whether it ran whole), its end."""
        if self._begin_epoch():
            self._end_epoch(whole=batches(preemption))

    def _begin_epoch(self) -> bool:
        """An epoch's start: reload the loaders when due, open the training stage, ``on_train_epoch_start``
        (not on a mid-epoch resume: that epoch already started, as in Lightning). False when the epoch was
        finished already (resumed from a checkpoint written at its end) and only its bookkeeping is left."""
        t, p, data, metrics = self.trainer, self.progress, self.data, self.metrics
        fresh = p.batch_in_epoch == 0 and p.steps_in_epoch == 0  # otherwise resuming mid-epoch
        every = t.reload_dataloaders_every_n_epochs
        if every and p.current_epoch - self._loaded_at >= every and not p.epoch_finished and fresh:
            data.reload()
            self._loaded_at = p.current_epoch
        if p.epoch_finished:
            self._finish_epoch(whole=True)
            return False
        # The first epoch that validates requests the validation loaders, before on_train_epoch_start: the epoch's
        # hooks (and the progress bar's total_val_batches) see them from its start.
        data.request_val_for_epoch(p.current_epoch)
        if fresh and not self._keep_train_stage:
            metrics.start_stage("train")
        else:
            metrics.resume_stage("train")
        self._keep_train_stage = False
        if fresh:
            self.hooks.call("on_train_epoch_start")
        t.strategy.sync_trainable_parameters()  # after on_train_epoch_start, where finetuning unfreezes
        set_loader_epoch(data.train_loader, p.current_epoch)
        return True

    def _end_epoch(self, whole: bool) -> None:
        """An epoch's end; ``whole``: it ran to its last batch (or a hook or the data ended it as if it had)."""
        p = self.progress
        self.epoch_loop.log_step = max(p.global_step - 1, 0)
        self.hooks.call("on_train_epoch_end", monitoring=False)
        self.logs.record_epoch(self.metrics.end_stage())
        # Checkpoints written by the monitoring callbacks resume after this point: with the next epoch, or with
        # this epoch's next batch when max_steps cut it short. Such an epoch is not over (as Lightning, when the
        # resumed run counts steps), so raising max_steps continues the run as one uninterrupted run with that
        # limit would. One should_stop ended is over (as Lightning).
        p.epoch_finished = whole or not self._max_steps_reached()
        self.hooks.call("on_train_epoch_end", monitoring=True)
        self._finish_epoch(whole)

    def _finish_epoch(self, whole: bool) -> None:
        p = self.progress
        p.epoch_finished = False
        p.current_epoch += 1
        p.batch_in_epoch = p.steps_in_epoch = 0
        p.val_checks_in_epoch = 0
        self.epoch_loop.log_step = p.global_step
        if whole and self.optim.schedulers and self.step.automatic:
            # Only ReduceLROnPlateau here: the others stepped after the epoch's last batch.
            self.optim.step_schedulers("epoch", p.current_epoch, self.metrics.callback_metrics, plateau=True)

    def manual_backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
        self.step.manual_backward(loss, *args, **kwargs)


def settle_epoch_limits(trainer: Trainer) -> None:
    """A fit starts: ``max_epochs`` / ``min_epochs`` left None get their values (``default_epoch_limits``), as
    Lightning sets them then, with its warning when that is 1000 epochs."""
    max_epochs, min_epochs = default_epoch_limits(trainer.max_steps, trainer.min_steps, trainer.callbacks)
    if trainer.max_epochs is None:
        if max_epochs != -1 and trainer.is_global_zero:
            warnings.warn(
                "`max_epochs` was not set. Setting it to 1000 epochs. To train without an epoch limit, set "
                "`max_epochs=-1`.",
                PossibleUserWarning,
                stacklevel=user_stacklevel(),
            )
        trainer.max_epochs = max_epochs
    if trainer.min_epochs is None:
        trainer.min_epochs = min_epochs
