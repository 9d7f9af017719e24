"""One training epoch's batches, for :class:`~ember.trainer.loops.FitLoop`, which runs the epochs and their start
and end (the whole schedule, in order: ``loops.py``'s docstring).

Two flavors of batch loop, chosen once per run: :meth:`EpochLoop.run` for the usual ``training_step(self, batch,
batch_idx)``, :meth:`EpochLoop.run_iter` for a ``training_step(self, dataloader_iter)`` that fetches its own
batches. What follows each step is the same in both, one method, :meth:`EpochLoop._after_step`: ``global_step``,
the schedulers, ``on_train_batch_end``, the loggers' write, a validation when due, the step boundary, and
whether training stops there. What they need per batch is looked up once per epoch (:class:`_EpochParts`), so
a hook nobody overrides costs nothing per batch.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from ember.batches import sized_len
from ember.profilers.base import iterate, wrap
from ember.trainer.dataloader_iter import DataLoaderIter, last_by_count, last_by_lookahead
from ember.trainer.loader_checks import warn_if_short
from ember.trainer.loaders import batch_transfer, set_loader_epoch
from ember.trainer.lockstep import Lockstep, uneven_message
from ember.trainer.step import as_output_dict
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
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
    preemption: PreemptionHandler | None  # polled at each step boundary
    preemption_polls: bool  # whether every boundary polls the other ranks for a stop signal
    schedulers: list[Any]  # the schedulers the loop steps (none in manual optimization)
    epoch_schedulers: bool  # whether some non-plateau scheduler steps per epoch
    log_every: int  # log_every_n_steps, or 0 without loggers
    val_due: Callable[[int, bool], bool] | None  # whether validation is due after a step; None: never this epoch


class EpochLoop:
    """Runs the batches of one training epoch at a time, with validation interleaved.

    Args:
        trainer: the public state the loop reads and writes (``progress``, ``should_stop``, the
            schedule arguments) and hands to callbacks.
        hooks, metrics, optim: the run's hooks, ``self.log`` collector, optimizers and schedulers.
        data: the fit's loaders.
        logs: writes step and epoch metrics to the loggers.
        evaluation: runs validation.
        step: runs one training batch.
        input_dtype: floating inputs are cast to it (64-true), or None.
        can_stop: whether ``should_stop`` may end training now (``FitLoop.can_stop``).
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
        can_stop: Callable[[], bool],
    ) -> None:
        self.trainer, self.hooks, self.metrics, self.optim = trainer, hooks, metrics, optim
        self.data, self.logs, self.evaluation, self.step = data, logs, evaluation, step
        self.input_dtype, self.can_stop = input_dtype, can_stop
        self.progress = trainer.progress
        #: Whether the loop writes step metrics once the current batch is done (decided before
        #: ``on_train_batch_end``, for callbacks that log beside ``self.log``).
        self.writes_step_metrics = False
        #: The step loggers get (see ``callbacks/logger_writes.logger_step``): the steps taken before the
        #: current batch's step; at an epoch's end, the index of its last step (FitLoop sets it there).
        self.log_step = 0
        self._warned_uneven = False  # ranks' unsized loaders yielded different numbers of batches
        self._warned_empty = False  # an unsized train loader yielded no batch in an epoch
        self._warned_frequency = False  # a step scheduler's frequency is no multiple of accumulate_grad_batches
        self._warned_none = False  # the train loader yielded a None batch

    def _epoch_parts(self, preemption: PreemptionHandler | None, val_due: Callable[[int, bool], bool]) -> _EpochParts:
        """What the batch loop needs, looked up once per epoch, after ``on_train_epoch_start``; ``val_due``: the
        flavor's validation test."""
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
            preemption=preemption,
            val_due=val_due if self.data.will_validate else None,
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
            stacklevel=user_stacklevel(),  # FitLoop.run, which runs the epoch
        )

    def run(self, preemption: PreemptionHandler | None = None) -> bool:
        """The batches of an epoch of the usual ``training_step(self, batch, batch_idx)``: each moved to the
        device, stepped, then :meth:`_after_step`. Returns whether the epoch ran whole (to its last batch, or a
        hook or the data ended it as if it had), not stopped mid-epoch."""
        t, p, data, metrics, step = self.trainer, self.progress, self.data, self.metrics, self.step
        start = p.batch_in_epoch  # > 0 only when resuming mid-epoch
        loader, n_batches = data.train_loader, data.num_training_batches
        parts = self._epoch_parts(preemption, self._val_due)
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
        is_last = exhausted = refused = False
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
            if batch is None:  # as Lightning: skipped (no on_train_batch_start, no step), yet a batch of the epoch
                outputs, steps = self._skip_none(batch_idx)
            elif parts.batch_start and self._refused(parts, batch, batch_idx):
                refused = True
                break
            else:
                metrics.fx = "training_step"
                outputs, steps = run_step(batch, batch_idx, is_last)
            p.batch_in_epoch = batch_idx + 1
            p.total_batches += 1
            if self._after_step(parts, outputs, steps, batch_idx + 1, is_last, batch, batch_idx, batch is None):
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
        return exhausted or ran_last or refused or p.batch_in_epoch >= n_batches

    def run_iter(self, preemption: PreemptionHandler | None = None) -> bool:
        """:meth:`run` for a ``training_step(self, dataloader_iter)``, which fetches its own batches from a
        :class:`~ember.trainer.dataloader_iter.DataLoaderIter` (the rules: ``trainer/dataloader_iter.py``).

        Steps and batches are counted apart: ``steps_in_epoch`` against ``num_training_batches``, the validation
        interval and accumulation windows; ``batch_in_epoch`` for the data position. What follows each step is
        :meth:`_after_step`, as in :meth:`run`; the hooks get the last batch the step fetched.
        """
        t, p, data, metrics, step, optim = self.trainer, self.progress, self.data, self.metrics, self.step, self.optim
        parts = self._epoch_parts(preemption, self._iter_val_due)
        loader, n_batches = data.train_loader, data.num_training_batches
        start, first_step = p.batch_in_epoch, p.steps_in_epoch  # > 0 when resuming mid-epoch
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
        refused = stopped = validated = False
        while step_idx < n_batches and not fetcher.done:
            p.is_last_batch = False
            self.log_step = p.global_step
            # As Lightning: on_train_batch_start gets the last batch fetched, before this step fetches (None at first).
            if parts.batch_start and self._refused(parts, fetcher.batch, fetcher.batch_idx):
                refused = True
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
            checks = p.val_checks_in_epoch
            if self._after_step(parts, outputs, steps, step_idx, is_last, fetcher.batch, fetcher.batch_idx):
                break
            validated = p.val_checks_in_epoch != checks
        if stopped:
            # The data ran out inside a step: the epoch ends as after its last batch (Lightning skips the
            # epoch-interval schedulers and the epoch's validation then: docs/from-lightning.md, where ember differs).
            p.batch_in_epoch = start + fetcher.fetched
            p.is_last_batch = True
            if parts.epoch_schedulers:
                optim.step_schedulers("epoch", p.current_epoch + 1, metrics.callback_metrics, plateau=False)
            if step_idx > first_step and not validated and parts.val_due and self._iter_val_due(step_idx, True):
                self._validate()
        if lockstep is not None and lockstep.uneven:
            self._report_uneven(lockstep, start, p.batch_in_epoch)
        if not (refused or start or first_step or step_idx or fetcher.fetched):  # the loader yielded nothing
            self._no_batch(length is not None)
        return fetcher.done or stopped or refused or step_idx >= n_batches

    def _refused(self, parts: _EpochParts, batch: Any, batch_idx: int) -> bool:
        """``on_train_batch_start``; True when a hook returned -1: as Lightning, the rest of the epoch is skipped,
        and the epoch ends as after its last batch (``trainer.is_last_batch``, the epoch-interval schedulers)."""
        self.metrics.fx = "on_train_batch_start"
        if not any(h(batch, batch_idx) == -1 for h in parts.batch_start):
            return False
        self.progress.is_last_batch = True
        if parts.epoch_schedulers:
            self.optim.step_schedulers(
                "epoch", self.progress.current_epoch + 1, self.metrics.callback_metrics, plateau=False
            )
        return True

    def _skip_none(self, batch_idx: int) -> tuple[Any, int]:
        """A None batch from the train loader: no step (``on_train_batch_end`` gets ``outputs=None``); said once
        per fit, on global rank zero."""
        if not self._warned_none and self.trainer.is_global_zero:
            warnings.warn(
                f"train_dataloader yielded None (batch {batch_idx}): as in Lightning, the batch is skipped (no "
                "on_train_batch_start, training_step or optimizer step; on_train_batch_end gets outputs=None) and "
                "counts as one of the epoch's batches. If this was on purpose, ignore this warning (said once per "
                "fit).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        self._warned_none = True
        return self.step.skip(batch_idx)

    def _after_step(
        self,
        parts: _EpochParts,
        outputs: Any,
        steps: int,
        done: int,
        is_last: bool,
        batch: Any,
        batch_idx: int,
        skipped: bool = False,
    ) -> bool:
        """What follows each step, in both epoch loops, in Lightning's order: ``global_step``, the schedulers,
        ``on_train_batch_end``, the loggers' write, a validation when due, the step boundary.

        Args:
            parts: the epoch's hooks and schedule (:meth:`_epoch_parts`).
            outputs, steps: what the step returned: its outputs, and whether the optimizer stepped.
            done: the epoch's batches (steps, for ``dataloader_iter``) run so far, this one included: what a
                step-interval scheduler's ``frequency`` and an accumulation window count.
            is_last: whether it was the epoch's last.
            batch, batch_idx: what ``on_train_batch_end`` receives.
            skipped: whether the loader yielded None for the batch (its hooks get ``outputs=None``).

        Returns:
            Whether training stops here: ``max_steps`` reached, or a stop requested that may end it now.
        """
        t, p, metrics, optim = self.trainer, self.progress, self.metrics, self.optim
        if steps:
            p.global_step += 1  # before on_train_batch_end, as in Lightning
        if parts.schedulers:
            if steps:  # as Lightning: a frequency counts the epoch's batches, not optimizer steps
                optim.step_schedulers("step", done, metrics.callback_metrics, plateau=False)
            if is_last and parts.epoch_schedulers:
                optim.step_schedulers("epoch", p.current_epoch + 1, metrics.callback_metrics, plateau=False)
        # As Lightning: every log_every_n_steps, and every step once a stop is requested.
        log_every = parts.log_every
        self.writes_step_metrics = bool(steps and log_every) and (p.global_step % log_every == 0 or t.should_stop)
        if parts.batch_end:
            metrics.fx = "on_train_batch_end"
            if parts.wants_outputs and not skipped:  # as Lightning: hooks see a dict with a detached "loss"
                outputs = as_output_dict(outputs)
            for h in parts.batch_end:
                h(outputs, batch, batch_idx)
        if self.writes_step_metrics or (t.should_stop and steps and log_every):  # (a stop requested just now)
            self.writes_step_metrics = False
            self.logs.step_metrics()
        if parts.val_due is not None and parts.val_due(done - 1, is_last):
            # Inside an accumulation window the gradients are kept for the window's step.
            k = self.step.k
            self._validate(zero_grad=not self.step.automatic or k == 1 or done % k == 0 or is_last)
        if steps and parts.schedulers:  # after the validation whose metrics they may monitor (as Lightning)
            optim.step_schedulers("step", done, metrics.callback_metrics, plateau=True)
        for h in parts.boundary:
            h(t, t.module)
        preemption = parts.preemption
        if preemption is not None and (parts.preemption_polls or preemption.received is not None):
            preemption.check()  # on a stop signal (any rank): saves, then raises ember.exceptions.Preempted
        # current_epoch counts finished epochs: before min_epochs, finish this one whole.
        if not ((t.max_steps != -1 and p.global_step >= t.max_steps) or (t.should_stop and self.can_stop())):
            return False
        # Stopping mid-epoch: run the epoch-end validation that would otherwise be skipped, so monitored
        # metrics (checkpointing, early stopping) reflect the final weights.
        if not is_last and self._val_due_at_epoch_end() and p.val_checks_in_epoch == 0:
            self._validate()
        return True

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

    def _iter_val_due(self, step_idx: int, is_last: bool) -> bool:
        """Whether validation is due after step ``step_idx`` of a ``dataloader_iter`` epoch: as for the usual
        step, and also (as Lightning for this flavor) at every epoch's end whatever the interval, since
        the end shows only once the step fetched the last batch."""
        if not is_last:
            return self._val_due(step_idx, is_last)
        n = self.trainer.check_val_every_n_epoch
        return self.data.will_validate and (n is None or (self.progress.current_epoch + 1) % n == 0)

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
                stacklevel=user_stacklevel(),  # FitLoop.run, which runs the epoch
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
            warnings.warn(message, UserWarning, stacklevel=user_stacklevel())
