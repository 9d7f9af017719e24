"""The fit loop: the whole training schedule, top to bottom (``step.py`` runs one batch, ``evaluation.py``
the evaluation loops).

A fit, as in Lightning::

    [a resume: the optimizers, schedulers and progress are restored]
    [sanity check] on_sanity_check_start -> val_dataloader() -> validation -> on_sanity_check_end
    train_dataloader() (and val_dataloader() when no sanity check requested it)
    [a resume: the data position and RNG states are restored]
    on_train_start
    per epoch: on_train_epoch_start, per batch:
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

import itertools
import logging
import math
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from ember.module import takes_dataloader_iter
from ember.profilers.base import iterate, wrap
from ember.rng import apply_rng, capture_rng
from ember.trainer.dataloader_iter import DataLoaderIter, last_by_count, last_by_lookahead
from ember.trainer.loader_checks import warn_if_short
from ember.trainer.loaders import batch_transfer, set_loader_epoch
from ember.trainer.lockstep import Lockstep, uneven_message
from ember.trainer.step import as_output_dict
from ember.utils import sized_len

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


def _has_len(loader: Any) -> bool:
    return sized_len(loader) is not None


class _EpochParts(NamedTuple):
    """What an epoch's batch loop needs, looked up once per epoch: a hook nobody overrides costs nothing per batch."""

    batch_start: list[Callable[..., Any]]  # on_train_batch_start
    batch_end: list[Callable[..., Any]]  # on_train_batch_end
    wants_outputs: bool  # whether on_train_batch_end's hooks may read Lightning's {"loss": detached}
    boundary: list[Callable[..., Any]]  # callbacks that watch the step boundary
    preemption_polls: bool  # whether every boundary polls the other ranks for a stop signal
    schedulers: list[Any]  # the schedulers the loop steps (none in manual optimization)
    epoch_schedulers: bool  # whether some non-plateau scheduler steps per epoch
    log_every: int  # log_every_n_steps, or 0 without loggers


class FitLoop:
    """Runs epochs of training with validation interleaved; owns when each part of the schedule is due.

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
        #: Whether the loop writes step metrics once the current batch is done (decided before
        #: ``on_train_batch_end``, for callbacks that log beside ``self.log``).
        self.writes_step_metrics = False
        #: The step loggers get (see ``callbacks/logger_writes.logger_step``): the steps taken before the
        #: current batch's step; at an epoch's end, the index of its last step.
        self.log_step = 0
        self._keep_train_stage = False  # the first epoch keeps what on_train_start logged
        self._warned_uneven = False  # ranks' unsized loaders yielded different numbers of batches
        self._warned_empty = False  # an unsized train loader yielded no batch in an epoch
        self._loaded_at = 0  # the epoch whose loaders are in use (reload_dataloaders_every_n_epochs)
        self._said_continue = False  # the "min_epochs / min_steps not met" line was logged this fit
        self._warned_frequency = False  # a step scheduler's frequency is no multiple of accumulate_grad_batches
        #: Whether this run's training_step takes ``dataloader_iter`` (fetches its own batches): decided in ``run``.
        self.fetches_batches = False

    # ------------------------------------------------------------------ fit
    def run(self, resume: Restore | None = None, preemption: PreemptionHandler | None = None) -> None:
        """Train until a limit or a stop, completing ``resume`` (if any) on the way, as in Lightning."""
        t, p, data = self.trainer, self.progress, self.data
        self._warned_uneven = False
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
                stacklevel=2,
            )
        if resume is not None:
            resume.load("training")
        if t.num_sanity_val_steps and data.validates:  # on a resume too, as in Lightning
            self._sanity_check()
        if t.limit_train_batches == 0:  # as Lightning: no training at all, not even its loader or hooks
            return
        data.request_train()
        data.request_val()
        self._check_val_interval()
        n, every = data.num_training_batches, t.log_every_n_steps
        if t.loggers and n < every and not t.fast_dev_run and t.is_global_zero:  # as Lightning (rank zero)
            warnings.warn(
                f"The number of training batches ({n}) is smaller than the logging interval "
                f"Trainer(log_every_n_steps={every}). Set a lower value for log_every_n_steps if you want "
                "to see logs for the training epoch.",
                UserWarning,
                stacklevel=2,
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
        # The epoch loop of this run, chosen once: a training_step(self, dataloader_iter) fetches its own batches.
        epoch = self.run_iter_epoch if self.fetches_batches else self.run_epoch
        run_epoch = wrap(t.profiler, "run_training_epoch", epoch)  # (itself when not profiling)
        while not self._done():
            if t.should_stop and self.can_stop():  # also a stop requested before the first epoch, as Lightning
                break
            run_epoch(preemption)
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
        finally:
            t.sanity_checking = False
            metrics.callback_metrics, metrics.progress_bar_metrics = saved
        self.hooks.call("on_sanity_check_end")
        apply_rng(rng)

    def can_stop(self) -> bool:
        """Whether ``should_stop`` may end training now: ``min_epochs`` epochs finished and ``min_steps``
        steps taken (as Lightning, which says once that training continues otherwise)."""
        t, p = self.trainer, self.progress
        if p.current_epoch >= t.min_epochs and (t.min_steps is None or p.global_step >= t.min_steps):
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
        t, p = self.trainer, self.progress
        if t.max_steps != -1 and p.global_step >= t.max_steps:
            return True
        return t.max_epochs != -1 and p.current_epoch >= t.max_epochs

    # ------------------------------------------------------------------ validation schedule
    def _check_val_interval(self) -> None:
        t, data = self.trainer, self.data
        v, n = t.val_check_interval, data.num_training_batches
        if (
            isinstance(v, int)
            and t.check_val_every_n_epoch is not None
            and data.val_loaders
            and n != math.inf
            and v > n
        ):
            raise ValueError(
                f"val_check_interval={v} is larger than the {int(n)} training batches per epoch, so "
                "validation would never run. Lower it, or set check_val_every_n_epoch=None to count "
                "batches across epochs."
            )
        if isinstance(v, float) and v != 1.0 and data.val_loaders and n == math.inf:
            raise ValueError(
                f"val_check_interval={v} is a fraction of an epoch, but the train dataloader has no "
                "length, so validation would never run mid-epoch. Pass an int number of batches, or an "
                "int limit_train_batches."
            )

    def _val_due(self, batch_idx: int, is_last: bool) -> bool:
        t, p = self.trainer, self.progress
        if not self.data.will_validate:
            return False
        if t.check_val_every_n_epoch is not None and (p.current_epoch + 1) % t.check_val_every_n_epoch:
            return False
        v, n = t.val_check_interval, self.data.num_training_batches
        if isinstance(v, float):
            if n == math.inf:
                return is_last and v == 1.0
            every = max(1, int(n * v))
            return (batch_idx + 1) % every == 0 or (is_last and v == 1.0)
        if t.check_val_every_n_epoch is None:
            return p.total_batches % v == 0
        return (batch_idx + 1) % v == 0

    def _val_due_at_epoch_end(self) -> bool:
        """Whether this epoch validates at its end (used when training stops before the end)."""
        t = self.trainer
        if not self.data.will_validate or not isinstance(t.val_check_interval, float):
            return False
        n = t.check_val_every_n_epoch
        return n is not None and (self.progress.current_epoch + 1) % n == 0

    def _validate(self, zero_grad: bool = True) -> None:
        """A validation inside fit: its epoch metrics go to the loggers; training's accumulations continue."""
        if zero_grad:
            self.step.module.on_validation_model_zero_grad()  # frees the gradients during validation (Lightning)
        self.data.reload_val_if_due()
        for loader in self.data.val_loaders:
            set_loader_epoch(loader, self.progress.current_epoch)
        self.evaluation.run("validate", self.data.val_loaders, self.data.num_val_batches)
        self.progress.val_checks_in_epoch += 1
        self.logs.epoch_metrics(self.metrics.callback_metrics)
        self.metrics.resume_stage("train")

    # ------------------------------------------------------------------ one epoch
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

    def _epoch_parts(self, preemption: PreemptionHandler | None) -> _EpochParts:
        """What the batch loop needs, looked up once per epoch, after ``on_train_epoch_start``."""
        t, step = self.trainer, self.step
        batch_end = self.hooks.get("on_train_batch_end")
        step.k = t.accumulate_grad_batches  # read once per epoch (GradientAccumulationScheduler sets it)
        schedulers = self.optim.schedulers if step.automatic else []  # manual optimization steps its own
        if step.k > 1 and not self._warned_frequency:
            self._check_frequencies(schedulers, step.k)
        return _EpochParts(
            batch_start=self.hooks.get("on_train_batch_start"),
            batch_end=batch_end,
            # Building Lightning's {"loss": detached} outputs costs a detach and a dict per step: only
            # when a hook may read them (the module's own, or a callback that does not opt out).
            wants_outputs=step.automatic
            and any(
                getattr(getattr(getattr(h, "func", h), "__self__", None), "uses_step_outputs", True) for h in batch_end
            ),
            # After a batch's bookkeeping and any validation: where checkpoints resume exactly (checkpoint/contents.py).
            boundary=[cb.on_train_step_boundary for cb in t.callbacks if hasattr(cb, "on_train_step_boundary")],
            # One process only needs to look when a signal arrived; several agree periodically (preemption.py).
            preemption_polls=preemption is not None and t.strategy.world_size > 1,
            schedulers=schedulers,
            # As Lightning: step-interval schedulers step before on_train_batch_end, and epoch-interval ones
            # (except ReduceLROnPlateau, which waits for the epoch's metrics) after the epoch's last batch.
            epoch_schedulers=any(c.interval == "epoch" and not c.is_plateau for c in schedulers),
            log_every=t.log_every_n_steps if t.loggers else 0,
        )

    def _check_frequencies(self, schedulers: list[Any], k: int) -> None:
        """Say once per fit when a step-interval scheduler's ``frequency`` is no multiple of ``k``
        (``accumulate_grad_batches``): as in Lightning it counts the epoch's batches and is checked only on
        batches where the optimizer steps, so it is met every lcm(frequency, k) batches, not every frequency."""
        odd = [c for c in schedulers if c.interval == "step" and c.frequency > 1 and c.frequency % k]
        if not odd:
            return
        self._warned_frequency = True
        if not self.trainer.is_global_zero:
            return
        f = odd[0].frequency
        every = math.lcm(f, k)
        warnings.warn(
            f"A step-interval LR scheduler ({type(odd[0].scheduler).__name__}) has frequency={f}, which is no "
            f"multiple of accumulate_grad_batches={k}. As in Lightning, the frequency counts the epoch's batches "
            f"(batch_idx + 1) and is checked only on batches where the optimizer steps, so the scheduler steps "
            f"every {every} batches ({every // k} optimizer steps), counted again from each epoch's start: never in "
            f"an epoch of fewer batches, except on its last one when the frequency divides its number. For a step "
            f"every N optimizer steps, set frequency=N*{k}.",
            UserWarning,
            stacklevel=4,
        )

    def run_epoch(self, preemption: PreemptionHandler | None = None) -> None:
        t, p, data, metrics, step = self.trainer, self.progress, self.data, self.metrics, self.step
        if not self._begin_epoch():
            return
        start = p.batch_in_epoch  # > 0 only when resuming mid-epoch
        loader, n_batches = data.train_loader, data.num_training_batches
        # Everything the batch loop needs, as locals.
        batch_start, batch_end, wants_outputs, boundary, preemption_polls, schedulers, epoch_schedulers, log_every = (
            self._epoch_parts(preemption)
        )
        may_validate = data.will_validate
        max_steps, k = t.max_steps, step.k
        last_idx = n_batches - 1 if n_batches != math.inf else -1
        to_device = batch_transfer(t, 0, self.input_dtype)
        step.num_batches, step.sized = n_batches, _has_len(loader)
        lockstep = None
        if step.sized:
            # (zip and repeat are C iterators: no Python frame per batch, unlike a generator expression)
            stream: Iterable[tuple[Any, bool]] = zip(loader, itertools.repeat(False))
        else:
            # Without a length, the stream may end before an int limit does: look ahead to find its last
            # batch. Several ranks agree on it, or one that runs out first would leave the others waiting.
            batches = loader if n_batches == math.inf else itertools.islice(loader, int(n_batches) - start)
            if t.strategy.world_size > 1:
                stream = lockstep = Lockstep(batches, t.strategy)
            else:
                stream = last_by_lookahead(batches)
        # With a profiler: each next batch and each batch's step timed (without: the same objects).
        stream = iterate(t.profiler, "[FitLoop].train_dataloader_next", stream)
        run_step = wrap(t.profiler, "run_training_batch", step.runner())
        batch_idx = start - 1
        is_last = exhausted = refused = cut = False
        for batch, is_last in stream:
            batch_idx += 1
            if batch_idx >= n_batches:
                break
            is_last = is_last or batch_idx == last_idx
            p.is_last_batch = is_last
            if to_device is not None:
                batch = to_device(batch)
            self.log_step = p.global_step
            metrics.batch = batch
            metrics.batch_size = None
            if batch_start:
                metrics.fx = "on_train_batch_start"
                if any(h(batch, batch_idx) == -1 for h in batch_start):
                    # As Lightning: the rest of the epoch is skipped, and the epoch ends as after its last
                    # batch (trainer.is_last_batch, the epoch-interval schedulers step).
                    p.is_last_batch = refused = True
                    if epoch_schedulers:
                        self.optim.step_schedulers(
                            "epoch", p.current_epoch + 1, metrics.callback_metrics, plateau=False
                        )
                    break
            metrics.fx = "training_step"
            outputs, steps = run_step(batch, batch_idx, is_last)
            p.batch_in_epoch = batch_idx + 1
            p.total_batches += 1
            if steps:
                p.global_step += 1  # before on_train_batch_end, as in Lightning
            if schedulers:
                if steps:  # as Lightning: a frequency counts the epoch's batches, not optimizer steps
                    self.optim.step_schedulers("step", batch_idx + 1, metrics.callback_metrics, plateau=False)
                if is_last and epoch_schedulers:
                    self.optim.step_schedulers("epoch", p.current_epoch + 1, metrics.callback_metrics, plateau=False)
            # As Lightning: every log_every_n_steps, and every step once a stop is requested.
            self.writes_step_metrics = bool(steps and log_every) and (p.global_step % log_every == 0 or t.should_stop)
            if batch_end:
                metrics.fx = "on_train_batch_end"
                if wants_outputs:  # as Lightning: hooks see a dict with a detached "loss"
                    outputs = as_output_dict(outputs)
                for h in batch_end:
                    h(outputs, batch, batch_idx)
            if self.writes_step_metrics or (t.should_stop and steps and log_every):  # (a stop requested just now)
                self.writes_step_metrics = False
                self.logs.step_metrics()
            if may_validate and self._val_due(batch_idx, is_last):
                # Inside an accumulation window the gradients are kept for the window's step.
                self._validate(zero_grad=not step.automatic or k == 1 or (batch_idx + 1) % k == 0 or is_last)
            if steps and schedulers:  # after the validation whose metrics they may monitor (as Lightning)
                self.optim.step_schedulers("step", batch_idx + 1, metrics.callback_metrics, plateau=True)
            for h in boundary:
                h(t, t.module)
            if preemption is not None and (preemption_polls or preemption.received is not None):
                preemption.check()  # on a stop signal (any rank): saves, then raises ember.exceptions.Preempted
            # current_epoch counts finished epochs: before min_epochs, finish this one whole.
            cut = max_steps != -1 and p.global_step >= max_steps
            if cut or (t.should_stop and self.can_stop()):
                # Stopping mid-epoch: run the epoch-end validation that would otherwise be skipped,
                # so monitored metrics (checkpointing, early stopping) reflect the final weights.
                if not is_last and self._val_due_at_epoch_end() and p.val_checks_in_epoch == 0:
                    self._validate()
                break
        else:
            exhausted = True
        if lockstep is not None and lockstep.uneven:
            self._report_uneven(lockstep, start, p.batch_in_epoch)
        if batch_idx < start and start == 0:  # the loader yielded nothing
            self._no_batch(step.sized)
        elif exhausted and step.sized:  # its batches ran out: before its len() said they would?
            ends = " What follows an epoch's last batch (its validation, epoch-interval LR schedulers) did not run."
            warn_if_short(loader, batch_idx + 1, n_batches, "train dataloader", ends)
        # Whether the epoch ran to its last batch: a stop mid-epoch (max_steps, should_stop) leaves
        # the epoch-end schedulers unstepped, as Lightning does.
        ran_last = is_last and p.batch_in_epoch == batch_idx + 1  # (not a batch refused by on_train_batch_start)
        whole = exhausted or ran_last or refused or p.batch_in_epoch >= n_batches
        # An epoch max_steps cut short is not over: a checkpoint written at its end resumes with its next
        # batch (as Lightning, when the resumed run counts steps), so raising max_steps continues the run
        # as one uninterrupted run with that limit would. One should_stop ended is over (as Lightning).
        self._end_epoch(whole, unfinished=cut and not whole)

    def run_iter_epoch(self, preemption: PreemptionHandler | None = None) -> None:
        """One epoch of a ``training_step(self, dataloader_iter)``, which fetches its own batches from a
        :class:`~ember.trainer.dataloader_iter.DataLoaderIter` (the rules: ``trainer/dataloader_iter.py``).

        Steps and batches are counted apart: ``steps_in_epoch`` against ``num_training_batches``, the validation
        interval and accumulation windows; ``batch_in_epoch`` for the data position. What follows each step is
        :meth:`run_epoch`'s; it is written out in both so that the usual loop pays nothing per batch for this
        one (a change to either is due in the other).
        """
        t, p, data, metrics, step, optim = self.trainer, self.progress, self.data, self.metrics, self.step, self.optim
        if not self._begin_epoch():
            return
        parts = self._epoch_parts(preemption)
        batch_start, batch_end = parts.batch_start, parts.batch_end
        schedulers, log_every = parts.schedulers, parts.log_every
        loader, n_batches = data.train_loader, data.num_training_batches
        start, first_step = p.batch_in_epoch, p.steps_in_epoch  # > 0 when resuming mid-epoch
        may_validate, max_steps, k = data.will_validate, t.max_steps, step.k
        # A short last accumulation window is one of steps, cut by num_training_batches.
        step.num_batches, step.sized = n_batches, n_batches != math.inf
        numbered = ((batch, batch_idx, 0) for batch_idx, batch in enumerate(loader, start))
        lockstep = None
        length: float | None = None
        if n_batches != math.inf and _has_len(loader):
            length = n_batches - start  # its end is known by count, without fetching past it
            stream: Iterable[tuple[Any, bool]] = last_by_count(numbered, int(length))
        else:
            batches = numbered if n_batches == math.inf else itertools.islice(numbered, int(n_batches) - start)
            # Several ranks agree on the last batch, as for the usual step (lockstep.py), so that they end the
            # epoch together as long as their steps fetch alike.
            if t.strategy.world_size > 1:
                stream = lockstep = Lockstep(batches, t.strategy)
            else:
                stream = last_by_lookahead(batches)
        fetcher = DataLoaderIter(iterate(t.profiler, "[FitLoop].train_dataloader_next", stream), length)
        run_step = wrap(t.profiler, "run_training_batch", step.runner())
        metrics.batch = None  # no batch is the step's own: self.log in training says its batch_size
        step_idx = first_step
        is_last = refused = cut = stopped = validated = False
        while step_idx < n_batches and not fetcher.done:
            p.is_last_batch = False
            self.log_step = p.global_step
            if batch_start:  # as Lightning: the last batch fetched, before this step fetches (None at first)
                metrics.fx = "on_train_batch_start"
                if any(h(fetcher.batch, fetcher.batch_idx) == -1 for h in batch_start):
                    p.is_last_batch = refused = True
                    if parts.epoch_schedulers:
                        optim.step_schedulers("epoch", p.current_epoch + 1, metrics.callback_metrics, plateau=False)
                    break
            metrics.fx = "training_step"
            taken = optim.steps_taken
            try:
                outputs, steps = run_step(fetcher, step_idx, step_idx + 1 == n_batches)
            except StopIteration:  # it asked for a batch past the last: the step is dropped, the epoch ends
                stopped = True
                if optim.steps_taken != taken:  # (manual optimization stepped before it ran out)
                    p.global_step += 1
                break
            step_idx += 1
            p.steps_in_epoch = step_idx
            p.batch_in_epoch = start + fetcher.fetched
            p.total_batches += 1
            is_last = fetcher.done or step_idx == n_batches
            p.is_last_batch = is_last
            if steps:
                p.global_step += 1
            if schedulers:
                if steps:  # (the epoch's steps counted: Lightning's batch_idx for this flavor)
                    optim.step_schedulers("step", step_idx, metrics.callback_metrics, plateau=False)
                if is_last and parts.epoch_schedulers:
                    optim.step_schedulers("epoch", p.current_epoch + 1, metrics.callback_metrics, plateau=False)
            self.writes_step_metrics = bool(steps and log_every) and (p.global_step % log_every == 0 or t.should_stop)
            if batch_end:  # as Lightning: the last batch this step fetched
                metrics.fx = "on_train_batch_end"
                if parts.wants_outputs:
                    outputs = as_output_dict(outputs)
                for h in batch_end:
                    h(outputs, fetcher.batch, fetcher.batch_idx)
            if self.writes_step_metrics or (t.should_stop and steps and log_every):
                self.writes_step_metrics = False
                self.logs.step_metrics()
            validated = may_validate and self._iter_val_due(step_idx - 1, is_last)
            if validated:
                self._validate(zero_grad=not step.automatic or k == 1 or step_idx % k == 0 or is_last)
            if steps and schedulers:
                optim.step_schedulers("step", step_idx, metrics.callback_metrics, plateau=True)
            for h in parts.boundary:
                h(t, t.module)
            if preemption is not None and (parts.preemption_polls or preemption.received is not None):
                preemption.check()
            cut = max_steps != -1 and p.global_step >= max_steps
            if cut or (t.should_stop and self.can_stop()):
                if not is_last and self._val_due_at_epoch_end() and p.val_checks_in_epoch == 0:
                    self._validate()
                break
        if stopped:
            # The data ran out inside a step: the epoch ends as after its last batch (Lightning skips the
            # epoch-interval schedulers and the epoch's validation then: README, differences).
            p.batch_in_epoch = start + fetcher.fetched
            p.is_last_batch = True
            if parts.epoch_schedulers:
                optim.step_schedulers("epoch", p.current_epoch + 1, metrics.callback_metrics, plateau=False)
            if step_idx > first_step and not validated and may_validate and self._iter_val_due(step_idx, True):
                self._validate()
        if lockstep is not None and lockstep.uneven:
            self._report_uneven(lockstep, start, p.batch_in_epoch)
        if not (refused or start or first_step or step_idx or fetcher.fetched):  # the loader yielded nothing
            self._no_batch(length is not None)
        whole = fetcher.done or stopped or refused or step_idx >= n_batches
        self._end_epoch(whole, unfinished=cut and not whole)

    def _iter_val_due(self, step_idx: int, is_last: bool) -> bool:
        """Whether validation is due after step ``step_idx`` of a ``dataloader_iter`` epoch: as for the usual
        step, and also (as Lightning for this flavor) at every epoch's end whatever the interval, since
        the end shows only once the step fetched the last batch."""
        if not is_last:
            return self._val_due(step_idx, is_last)
        n = self.trainer.check_val_every_n_epoch
        return self.data.will_validate and (n is None or (self.progress.current_epoch + 1) % n == 0)

    def _no_batch(self, sized: bool) -> None:
        """An epoch without a single batch: an error for a loader with a length (its length lied); for one
        without, the epoch ends empty as in Lightning (a stream may have nothing this epoch), said once per fit."""
        message = (
            "The train dataloader yielded no batch. Check the dataset is not empty, that batch_size <= "
            "len(dataset) when drop_last=True, and limit_train_batches"
        )
        if sized:
            raise ValueError(message + ".")
        if not self._warned_empty and self.trainer.is_global_zero:
            warnings.warn(
                f"{message} (epoch {self.progress.current_epoch}; it has no length, so the epoch ends "
                "without training, as Lightning does; said once per fit).",
                UserWarning,
                stacklevel=3,
            )
        self._warned_empty = True

    def _report_uneven(self, lockstep: Lockstep, start: int, used: int) -> None:
        """Some rank's loader ran out before the others': say how many batches each had, once per fit.

        A collective (every rank gets here together: ``lockstep.uneven`` is agreed). An epoch in which
        some rank had no batch at all cannot train, and raises instead.
        """
        if self._warned_uneven and used > 0:
            return
        t = self.trainer
        message = uneven_message(lockstep.batches_per_rank(start), used, self.progress.current_epoch)
        if used == 0:
            raise ValueError(message)
        self._warned_uneven = True
        if t.strategy.is_global_zero:
            warnings.warn(message, UserWarning, stacklevel=2)

    def _end_epoch(self, whole: bool, unfinished: bool = False) -> None:
        p = self.progress
        self.log_step = max(p.global_step - 1, 0)
        self.hooks.call("on_train_epoch_end", monitoring=False)
        self.logs.record_epoch(self.metrics.end_stage())
        # Checkpoints written by the monitoring callbacks resume after this point: with the next epoch, or
        # (``unfinished``) with this epoch's next batch.
        p.epoch_finished = not unfinished
        self.hooks.call("on_train_epoch_end", monitoring=True)
        self._finish_epoch(whole)

    def _finish_epoch(self, whole: bool) -> None:
        p = self.progress
        p.epoch_finished = False
        p.current_epoch += 1
        p.batch_in_epoch = p.steps_in_epoch = 0
        p.val_checks_in_epoch = 0
        self.log_step = p.global_step
        if whole and self.optim.schedulers and self.step.automatic:
            # Only ReduceLROnPlateau here: the others stepped after the epoch's last batch.
            self.optim.step_schedulers("epoch", p.current_epoch, self.metrics.callback_metrics, plateau=True)

    def manual_backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
        self.step.manual_backward(loss, *args, **kwargs)
