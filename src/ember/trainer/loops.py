"""The fit loop: the one place where the order of a training step lives (evaluation.py has the others).

Per training batch (automatic optimization), as in Lightning::

    on_before_batch_transfer -> transfer_batch_to_device -> on_after_batch_transfer -> on_train_batch_start
    [last batch of the window] optimizer_step(closure), the closure running:
    training_step
    [first batch of an accumulation window] on_before_zero_grad -> optimizer_zero_grad
    on_before_backward -> backward -> on_after_backward
    [last batch of the window] on_before_optimizer_step -> configure_gradient_clipping -> the step itself
    step-interval schedulers (lr_scheduler_step); after the epoch's last batch, epoch-interval ones
    on_train_batch_end -> log step metrics -> [validation due] on_validation_model_zero_grad, validation

After the last batch of an epoch: on_train_epoch_end (non-monitoring callbacks, then the module),
epoch metrics reduced (across processes too), monitoring callbacks (checkpoint, early stopping),
ReduceLROnPlateau schedulers. The module's override points (``optimizer_step``, ``backward``, ...)
are called only when the module overrides them; otherwise the loop does their work inline.
"""
from __future__ import annotations

import inspect
import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ember.module import TrainModule
from ember.strategies.strategy import Strategy
from ember.trainer.lockstep import Lockstep, uneven_message

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


def num_batches(loader: Any, limit: int | float) -> float:
    """How many batches of ``loader`` to run under ``limit`` (int count or float fraction)."""
    try:
        n: float = len(loader)
    except TypeError:
        n = math.inf
    if isinstance(limit, float):
        if n == math.inf:
            if limit != 1.0:
                raise ValueError("A fractional limit_*_batches needs a dataloader with a length; pass an int instead.")
            return n
        return max(1, int(n * limit)) if limit > 0 and n > 0 else 0
    return min(n, limit)


def _has_len(loader: Any) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def _lookahead(iterable: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Yield ``(item, is_last)``: used when a loader has no length, to find the last batch."""
    it = iter(iterable)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def _as_output_dict(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return {"loss": output.detach()}
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return {**output, "loss": output["loss"].detach()}
    return output


def check_loss(output: Any) -> torch.Tensor | None:
    """The loss inside what ``training_step`` returned, or None to skip the batch."""
    if output is None:
        return None
    loss = output
    if isinstance(output, dict):
        if "loss" not in output:
            raise ValueError(f"training_step returned a dict without a 'loss' key (keys: {sorted(output)}). "
                             "In automatic optimization, return the loss tensor or {'loss': loss, ...}.")
        loss = output["loss"]
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"training_step must return a scalar loss tensor, a dict with 'loss', or None to skip the "
                        f"batch; it returned {type(loss).__name__}.")
    if loss.numel() != 1:
        raise ValueError(f"training_step returned a loss of shape {tuple(loss.shape)}; the loss must be a scalar. "
                         "Reduce it (e.g. loss.mean()) before returning it.")
    if not loss.requires_grad:
        raise ValueError("training_step returned a loss that does not require grad, so nothing can be trained. "
                         "Was it computed under torch.no_grad(), or detached (.item(), .detach())?")
    return loss


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (LBFGS and similar line-search optimizers)."""
    try:
        param = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a builtin or otherwise opaque step
        return False
    return param is not None and param.default is inspect.Parameter.empty


def _warn_skipped(batch_idx: int) -> None:
    warnings.warn(f"training_step returned None for batch {batch_idx}: skipping its backward and optimizer step.",
                  UserWarning, stacklevel=3)


def _override(module: Any, name: str) -> Callable[..., Any] | None:
    """``module``'s bound ``name`` when its class overrides TrainModule's, else None."""
    return getattr(module, name) if getattr(type(module), name) is not getattr(TrainModule, name) else None


class _StepProxy:
    """The optimizer an overridden ``TrainModule.optimizer_step`` receives: ``step(closure)`` runs the
    closure (training_step, backward, pre-step hooks) and then the real step, through the precision
    plugin and the strategy."""

    def __init__(self, optimizer: torch.optim.Optimizer, loop: FitLoop) -> None:
        self.optimizer = optimizer
        self._loop = loop

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        t = self._loop.trainer
        if closure is not None and not _needs_closure(self.optimizer):
            closure()  # outside optimizer.step: a skipped batch (None loss) must not step
            if not self._loop._window_has_grad:
                return None
            return self._loop._step_optimizer(self.optimizer)
        return t._precision.optimizer_step(self.optimizer, t.strategy, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class FitLoop:
    """Runs epochs of training with validation interleaved. Holds no state that progress doesn't."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.stepped_this_batch = False
        self._window_has_grad = False
        self._keep_train_stage = False  # the first epoch keeps what on_train_start logged
        self._sized = True  # whether the train loader has a length (set per epoch)
        self._warned_uneven = False  # ranks' unsized loaders yielded different numbers of batches

    # ------------------------------------------------------------------ fit
    def run(self) -> None:
        t = self.trainer
        p = t.progress
        self._warned_uneven = False
        if t.num_sanity_val_steps and any(t.num_val_batches) and p.global_step == 0 and p.batch_in_epoch == 0:
            t._run_evaluation("sanity")
        if p.batch_in_epoch == 0 or p.epoch_finished:
            # Values logged in on_train_start (per epoch by default) count toward the first epoch run.
            t._metrics.start_stage("train")
            self._keep_train_stage = True
        else:
            t._metrics.resume_stage("train")  # mid-epoch resume: keep the restored accumulations
        t._call("on_train_start")
        self._loaded_at = p.current_epoch  # the epoch whose loaders are in use (reload_dataloaders_every_n_epochs)
        while not self._done():
            self.run_epoch()
            if t.should_stop and p.current_epoch >= t.min_epochs:
                break
        t._call("on_train_end")

    def _done(self) -> bool:
        t, p = self.trainer, self.trainer.progress
        if t.max_steps != -1 and p.global_step >= t.max_steps:
            return True
        return t.max_epochs != -1 and p.current_epoch >= t.max_epochs

    def run_epoch(self) -> None:
        t, p = self.trainer, self.trainer.progress
        every = t.reload_dataloaders_every_n_epochs
        if every and p.current_epoch - self._loaded_at >= every and not p.epoch_finished and p.batch_in_epoch == 0:
            t._reload_loaders()
            self._loaded_at = p.current_epoch
        metrics = t._metrics
        strategy = t.strategy
        loader = t._train_loader
        n_batches = t.num_training_batches
        if p.epoch_finished:  # resumed from a checkpoint written at this epoch's end: only its bookkeeping is left
            self._finish_epoch()
            return
        start = p.batch_in_epoch  # > 0 only when resuming mid-epoch
        if start == 0 and not self._keep_train_stage:
            metrics.start_stage("train")
        else:
            metrics.resume_stage("train")
        self._keep_train_stage = False
        if start == 0:  # a mid-epoch resume continues the epoch: it already started (as in Lightning)
            metrics.fx = "on_train_epoch_start"
            t._call("on_train_epoch_start")
        t._set_loader_epoch(loader, p.current_epoch, start)

        # Look up per-step hooks once: a hook nobody overrides costs nothing inside the loop.
        batch_start = t._hooks("on_train_batch_start")
        batch_end = t._hooks("on_train_batch_end")
        # Building Lightning's {"loss": detached} outputs costs a detach and a dict per step: only
        # when a hook may read them (the module's own, or a callback that does not opt out).
        wants_outputs = any(getattr(getattr(getattr(h, "func", h), "__self__", None), "uses_step_outputs", True)
                            for h in batch_end)
        # After a batch's bookkeeping and any validation: where checkpoints resume exactly (see checkpoint.py).
        boundary = [cb.on_train_step_boundary for cb in t.callbacks if hasattr(cb, "on_train_step_boundary")]
        preemption = getattr(t, "_preemption", None)
        # One process only needs to look when a signal arrived; several agree periodically (preemption.py).
        preemption_polls = preemption is not None and strategy.world_size > 1
        may_validate = bool(t._val_loaders and any(t.num_val_batches))
        max_steps = t.max_steps
        automatic = t.module.automatic_optimization
        k = t.accumulate_grad_batches
        # Bound once: the strategy's own transfer (unless inputs must also be cast, 64-true, or the
        # module overrides a batch-transfer hook).
        to_device = t._transfer(0)
        step = self._bind_step_hooks()
        schedulers = t._optim.schedulers if automatic else None  # manual optimization steps its own schedulers
        # As Lightning: step-interval schedulers step before on_train_batch_end, and epoch-interval ones
        # (except ReduceLROnPlateau, which waits for the epoch's metrics) after the epoch's last batch.
        epoch_schedulers = bool(schedulers) and any(c.interval == "epoch" and not c.is_plateau for c in schedulers)
        loggers, log_every = t.loggers, t.log_every_n_steps
        last_idx = n_batches - 1 if n_batches != math.inf else -1
        self._sized = _has_len(loader)
        lockstep = None
        if self._sized:
            # (zip and repeat are C iterators: no Python frame per batch, unlike a generator expression)
            stream: Iterable[tuple[Any, bool]] = zip(loader, itertools.repeat(False))
        else:
            # Without a length, the stream may end before an int limit does: look ahead to find its last
            # batch. Several ranks agree on it, or one that runs out first would leave the others waiting.
            batches = loader if n_batches == math.inf else itertools.islice(loader, int(n_batches) - start)
            if strategy.world_size > 1:
                stream = lockstep = Lockstep(batches, strategy)
            else:
                stream = _lookahead(batches)
        batch_idx = start - 1
        for batch, is_last in stream:
            batch_idx += 1
            if batch_idx >= n_batches:
                break
            is_last = is_last or batch_idx == last_idx
            batch = to_device(batch)
            metrics.batch = batch
            metrics.batch_size = None
            if batch_start:
                metrics.fx = "on_train_batch_start"
                if any(h(batch, batch_idx) == -1 for h in batch_start):
                    break
            metrics.fx = "training_step"
            outputs = step(batch, batch_idx, is_last)
            p.batch_in_epoch = batch_idx + 1
            p.total_batches += 1
            if schedulers:
                if self.stepped_this_batch:
                    t._optim.step_schedulers("step", p.global_step + 1, metrics.callback_metrics, plateau=False)
                if is_last and epoch_schedulers:
                    t._optim.step_schedulers("epoch", p.current_epoch + 1, metrics.callback_metrics, plateau=False)
            if batch_end:
                metrics.fx = "on_train_batch_end"
                if automatic and wants_outputs:  # as Lightning: hooks see a dict with a detached "loss"
                    outputs = _as_output_dict(outputs)
                for h in batch_end:
                    h(outputs, batch, batch_idx)
            if self.stepped_this_batch:
                self.stepped_this_batch = False
                p.global_step += 1
                if schedulers:
                    t._optim.step_schedulers("step", p.global_step, metrics.callback_metrics, plateau=True)
                if loggers and p.global_step % log_every == 0:
                    t._log_step_metrics()
            if may_validate and t._val_due(batch_idx, is_last):
                if not automatic or k == 1 or (batch_idx + 1) % k == 0 or is_last:  # not inside a window
                    t.module.on_validation_model_zero_grad()  # frees the gradients during validation (Lightning)
                t._run_evaluation("validate")
                metrics.resume_stage("train")
            for h in boundary:
                h(t, t.module)
            if preemption_polls or (preemption is not None and preemption.received is not None):
                preemption.check()  # on a stop signal (any rank): saves, then raises ember.exceptions.Preempted
            # current_epoch counts finished epochs: before min_epochs, finish this one whole.
            if (t.should_stop and p.current_epoch >= t.min_epochs) or (max_steps != -1 and p.global_step >= max_steps):
                # Stopping mid-epoch: run the epoch-end validation that would otherwise be skipped,
                # so monitored metrics (checkpointing, early stopping) reflect the final weights.
                if not is_last and t._val_due_at_epoch_end() and p.val_checks_in_epoch == 0:
                    t.module.on_validation_model_zero_grad()
                    t._run_evaluation("validate")
                    metrics.resume_stage("train")
                break
        if lockstep is not None and lockstep.uneven:
            self._report_uneven(lockstep, start, p.batch_in_epoch)
        if batch_idx < start:  # the loader yielded nothing
            if start == 0:
                raise ValueError("The train dataloader yielded no batch. Check the dataset is not empty, that "
                                 "batch_size <= len(dataset) when drop_last=True, and limit_train_batches.")
        self._end_epoch()

    def _report_uneven(self, lockstep: Lockstep, start: int, used: int) -> None:
        """Some rank's loader ran out before the others': say how many batches each had, once per fit.

        A collective (every rank gets here together: ``lockstep.uneven`` is agreed). An epoch in which
        some rank had no batch at all cannot train, and raises instead.
        """
        if self._warned_uneven and used > 0:
            return
        t = self.trainer
        message = uneven_message(lockstep.batches_per_rank(start), used, t.progress.current_epoch)
        if used == 0:
            raise ValueError(message)
        self._warned_uneven = True
        if t.strategy.is_global_zero:
            warnings.warn(message, UserWarning, stacklevel=2)

    def _end_epoch(self) -> None:
        t, p = self.trainer, self.trainer.progress
        t._metrics.fx = "on_train_epoch_end"
        t._call("on_train_epoch_end", monitoring=False)
        epoch_metrics = t._metrics.end_stage()
        t._record_epoch(epoch_metrics)
        p.epoch_finished = True  # checkpoints written by the monitoring callbacks resume after this point
        t._call("on_train_epoch_end", monitoring=True)
        self._finish_epoch()

    def _finish_epoch(self) -> None:
        t, p = self.trainer, self.trainer.progress
        p.epoch_finished = False
        p.current_epoch += 1
        p.batch_in_epoch = 0
        p.val_checks_in_epoch = 0
        if t._optim.schedulers and t.module.automatic_optimization:
            # Only ReduceLROnPlateau here: the others stepped after the epoch's last batch.
            t._optim.step_schedulers("epoch", p.current_epoch, t._metrics.callback_metrics, plateau=True)

    # ------------------------------------------------------------------ one batch
    def _bind_step_hooks(self) -> Callable[[Any, int, bool], Any]:
        """Resolve the per-step hooks once per epoch, so the step does no lookups; return the step to run."""
        t = self.trainer
        self._h_zero_grad = t._hooks("on_before_zero_grad")
        self._h_before_backward = t._hooks("on_before_backward")
        self._h_after_backward = t._hooks("on_after_backward")
        self._h_before_step = t._hooks("on_before_optimizer_step")
        self._autocast = t._precision.autocast if t._precision.autocast_dtype is not None else None
        # The strategy's verbs, bound once; where a strategy keeps the base behaviour, the step
        # calls the module / tensor / optimizer directly (one Python frame fewer per verb per step).
        strategy, base = t.strategy, Strategy
        self._training_step = (t.module.training_step if type(strategy).training_step is base.training_step
                               else strategy.training_step)
        self._backward = torch.Tensor.backward if type(strategy).backward is base.backward else strategy.backward
        module = t.module
        # The module's override points, each None unless the module overrides it (then the step calls it).
        self._m_zero_grad = _override(module, "optimizer_zero_grad")
        self._m_optimizer_step = _override(module, "optimizer_step")
        self._m_clip = _override(module, "configure_gradient_clipping") or (
            module.configure_gradient_clipping if _override(module, "clip_gradients") else None)
        if _override(module, "backward") is not None and type(strategy).backward is base.backward:
            self._backward = module.backward
        plain_step = t._precision.scaler is None and type(strategy).optimizer_step is base.optimizer_step
        self._step_optimizer = (lambda opt: opt.step()) if plain_step else \
            (lambda opt: t._precision.optimizer_step(opt, strategy))
        if not t.module.automatic_optimization:
            return self._manual_step
        self._optimizer = t._optim.optimizers[0]
        if _needs_closure(self._optimizer):
            self._check_closure_optimizer()
            return self._closure_step
        # The common case (one step per batch, no scaling, clipping or step hooks) runs in one frame.
        simple = (t.accumulate_grad_batches == 1 and self._autocast is None and plain_step and not t.gradient_clip_val
                  and not (self._h_zero_grad or self._h_before_backward or self._h_after_backward
                           or self._h_before_step)
                  and self._m_zero_grad is None and self._m_optimizer_step is None and self._m_clip is None
                  and _override(t.module, "backward") is None)
        return self._simple_step if simple else self._automatic_step

    def _simple_step(self, batch: Any, batch_idx: int, is_last: bool) -> Any:
        """``_automatic_step`` when it reduces to forward, zero_grad, backward, step (same order, same result)."""
        outputs = self._training_step(batch, batch_idx)
        # The usual return (a scalar tensor that requires grad) needs no further checking.
        loss = outputs if type(outputs) is torch.Tensor and outputs.requires_grad and not outputs.ndim \
            else check_loss(outputs)
        optimizer = self._optimizer
        optimizer.zero_grad(set_to_none=True)
        if loss is None:
            _warn_skipped(batch_idx)
            return outputs
        self._backward(loss)
        optimizer.step()
        self.stepped_this_batch = True
        return outputs

    def _automatic_step(self, batch: Any, batch_idx: int, is_last: bool) -> Any:
        t = self.trainer
        k = t.accumulate_grad_batches
        pos = batch_idx % k
        optimizer = t._optim.optimizers[0]
        if pos == k - 1 or is_last:
            if self._m_optimizer_step is not None:
                return self._module_optimizer_step(batch, batch_idx, pos, optimizer)
            outputs = self._forward_backward(batch, batch_idx, pos, optimizer)
            if self._window_has_grad:
                if not self._sized and pos + 1 < k:
                    # A short final window of a loader without a length: rescale the 1/k-scaled gradients.
                    self._rescale_grads(optimizer, k / (pos + 1))
                self._optimizer_step(optimizer)
            return outputs
        with t.strategy.no_backward_sync():  # not the window's last batch: no gradient communication
            return self._forward_backward(batch, batch_idx, pos, optimizer)

    def _forward_backward(self, batch: Any, batch_idx: int, pos: int, optimizer: torch.optim.Optimizer,
                          may_skip: bool = True) -> Any:
        t = self.trainer
        if self._autocast is None:
            outputs = self._training_step(batch, batch_idx)
        else:
            with self._autocast():
                outputs = self._training_step(batch, batch_idx)
        loss = check_loss(outputs)
        if pos == 0:
            for h in self._h_zero_grad:
                h(optimizer)
            if self._m_zero_grad is None:
                optimizer.zero_grad(set_to_none=True)
            else:
                self._m_zero_grad(t.progress.current_epoch, batch_idx, optimizer)
            self._window_has_grad = False
        if loss is None:
            if may_skip:
                _warn_skipped(batch_idx)
            return outputs
        scaled = loss
        k = t.accumulate_grad_batches
        if k > 1:
            # Scale by the window's real size so a short final window still averages its batches.
            window = min(k, t.num_training_batches - (batch_idx - pos)) if self._sized else k
            scaled = loss / window
        if self._h_before_backward:
            t._metrics.fx = "on_before_backward"
            for h in self._h_before_backward:
                h(loss)
        if t._precision.scaler is not None:
            scaled = t._precision.scale_loss(scaled)
        self._backward(scaled)
        if self._h_after_backward:
            t._metrics.fx = "on_after_backward"
            for h in self._h_after_backward:
                h()
        self._window_has_grad = True
        return outputs

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._before_optimizer_step(optimizer)
        self._step_optimizer(optimizer)
        self.stepped_this_batch = True

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Between the last backward and the step: unscale, ``on_before_optimizer_step``, clip."""
        t = self.trainer
        precision = t._precision
        if precision.scaler is not None:
            precision.unscale(optimizer)
        if self._h_before_step:
            t._metrics.fx = "on_before_optimizer_step"
            for h in self._h_before_step:
                h(optimizer)
        if self._m_clip is not None:
            # The Trainer's values; like Lightning, no algorithm is named when no clipping value is set.
            self._m_clip(optimizer, gradient_clip_val=t.gradient_clip_val,
                         gradient_clip_algorithm=t.gradient_clip_algorithm if t.gradient_clip_val is not None else None)
        elif t.gradient_clip_val:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if t.gradient_clip_algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(params, t.gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_value_(params, t.gradient_clip_val)

    def _module_optimizer_step(self, batch: Any, batch_idx: int, pos: int, optimizer: torch.optim.Optimizer) -> Any:
        """The window's last batch when the module overrides ``optimizer_step``: it gets a closure that runs
        training_step, zero_grad, backward and the pre-step work (hooks, clipping), as in Lightning, and
        an optimizer whose ``step(closure)`` runs it before stepping."""
        t = self.trainer
        outputs: list[Any] = []

        def closure() -> Any:
            out = self._forward_backward(batch, batch_idx, pos, optimizer)
            if not outputs:
                outputs.append(out)
            loss = check_loss(out)
            if self._window_has_grad:
                if not self._sized and pos + 1 < t.accumulate_grad_batches:
                    self._rescale_grads(optimizer, t.accumulate_grad_batches / (pos + 1))
                self._before_optimizer_step(optimizer)
            return loss

        proxy = _StepProxy(optimizer, self)
        self._m_optimizer_step(t.progress.current_epoch, batch_idx, proxy, closure)
        if not outputs:
            raise RuntimeError(f"{type(t.module).__name__}.optimizer_step did not call optimizer_closure (batch "
                               f"{batch_idx}): pass it to optimizer.step(closure=optimizer_closure), or call it "
                               "yourself to skip the step. It runs training_step and backward.")
        self.stepped_this_batch = True
        return outputs[0]

    def _closure_step(self, batch: Any, batch_idx: int, is_last: bool) -> Any:
        """One batch with an optimizer that evaluates the loss itself (LBFGS): ``optimizer.step(closure)``.

        The closure runs training_step, zero_grad, backward and the pre-step work (hooks, clipping),
        as Lightning's does; the optimizer may call it several times per batch. The batch's outputs
        are those of the first call.
        """
        optimizer = self._optimizer
        strategy = self.trainer.strategy
        first: list[Any] = []

        def closure() -> torch.Tensor:
            outputs = self._forward_backward(batch, batch_idx, 0, optimizer, may_skip=False)
            loss = check_loss(outputs)
            if loss is None:
                raise ValueError(f"training_step returned None for batch {batch_idx}, but {type(optimizer).__name__} "
                                 "needs the loss from every closure call, so the batch cannot be skipped. Return a "
                                 "loss, or use an optimizer whose step takes no closure.")
            self._before_optimizer_step(optimizer)
            if not first:
                first.append(outputs)
            if strategy.world_size > 1:
                # The optimizer decides from the loss (convergence, line search): every rank must see
                # the same value, or ranks would call the closure a different number of times and
                # leave each other waiting in the gradient all-reduce.
                return strategy.reduce(loss.detach(), "mean")
            return loss

        self.trainer._precision.optimizer_step(optimizer, strategy, closure)
        self.stepped_this_batch = True
        return first[0] if first else None

    def _check_closure_optimizer(self) -> None:
        t = self.trainer
        name = type(self._optimizer).__name__
        if t.accumulate_grad_batches > 1:
            raise ValueError(f"{name}.step needs a closure that computes the loss, which cannot be combined with "
                             f"gradient accumulation (accumulate_grad_batches={t.accumulate_grad_batches}). Use "
                             "accumulate_grad_batches=1, or an optimizer whose step takes no closure.")
        if t._precision.scaler is not None:
            raise ValueError(f"{name}.step needs a closure, which a gradient scaler (precision='16-mixed') cannot "
                             "drive. Use precision='bf16-mixed' or '32-true' with this optimizer.")

    @staticmethod
    def _rescale_grads(optimizer: torch.optim.Optimizer, factor: float) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(factor)

    def _manual_step(self, batch: Any, batch_idx: int, is_last: bool = False) -> Any:
        t = self.trainer
        with t._precision.autocast():
            outputs = t.strategy.training_step(batch, batch_idx)
        return outputs

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        t = self.trainer
        t._call("on_before_backward", loss)
        scaled = t._precision.scale_loss(loss)
        custom = _override(t.module, "backward")
        if args or kwargs:
            if custom is not None:
                custom(scaled, *args, **kwargs)
            else:
                scaled.backward(*args, **kwargs)
        elif custom is not None and type(t.strategy).backward is Strategy.backward:
            custom(scaled)
        else:
            t.strategy.backward(scaled)
        t._call("on_after_backward")
