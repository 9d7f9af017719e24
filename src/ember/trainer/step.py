"""One training batch: the optimization step, automatic or manual, as in Lightning.

Automatic optimization, per batch::

    [not the window's last batch]  under no_backward_sync: the closure's work, no step
    [the window's last batch]      module.optimizer_step(epoch, batch_idx, optimizer, closure), whose
                                   default is optimizer.step(closure=closure); the closure runs
        training_step
        [first batch of an accumulation window] on_before_zero_grad -> optimizer_zero_grad
        on_before_backward -> strategy.backward(module.backward) -> on_after_backward
        on_before_optimizer_step -> configure_gradient_clipping
    and the optimizer steps after it (an optimizer such as LBFGS calls the closure itself, maybe
    several times).

Overriding a module hook (``optimizer_step``, ``optimizer_zero_grad``, ``backward``,
``configure_gradient_clipping``) changes what that point does, nothing else.

Two paths run that step, and one function, :meth:`TrainingStep.forward_backward` (with
:meth:`TrainingStep.pre_step`), does the batch's work in both:

- the direct path, where the layers between the loop and the work add nothing (the default ``optimizer_step``,
  no gradient scaler, an optimizer whose step takes no closure, no profiler: :meth:`TrainingStep._skip_layers`):
  the batch's work, then ``optimizer.step()``; it calls the module's ``training_step`` and ``loss.backward()``
  itself where the strategy's methods would only pass them on;
- the closure path, through every layer: ``module.optimizer_step(..., closure)``, where the closure
  (:class:`_Closure`) does the batch's work.

Both run the same hooks in the same order and give the same fit, to the bit. Manual optimization is its own
path (:meth:`TrainingStep.manual_step`): the module's ``training_step`` steps its optimizers itself. Each step
returns the batch's outputs and how many optimizer steps it took (as in Lightning, a window whose batches all
returned None from ``training_step`` takes a step that updates nothing but counts), which the fit loop counts
into ``global_step``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ember.module import TrainModule
from ember.overrides import defines_hook
from ember.profilers.base import Profiler, is_active, wrap
from ember.strategies.strategy import Strategy
from ember.trainer.optim import TrainerOptimizer
from ember.trainer.precision import Precision
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.trainer.hooks import Hooks
    from ember.trainer.metrics import MetricCollector
    from ember.trainer.optim import OptimizerState
    from ember.trainer.progress import FitProgress


def check_loss(output: Any) -> torch.Tensor | None:
    """The loss inside what ``training_step`` returned, or None to skip the batch."""
    if type(output) is torch.Tensor and output.requires_grad and not output.ndim:
        return output  # the usual return, a scalar that requires grad: nothing more to check
    if output is None:
        return None
    loss = output
    if isinstance(output, dict):
        if "loss" not in output:
            raise ValueError(
                f"training_step returned a dict without a 'loss' key (keys: {sorted(output)}). "
                "In automatic optimization, return the loss tensor or {'loss': loss, ...}."
            )
        loss = output["loss"]
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"training_step must return a scalar loss tensor, a dict with 'loss', or None to skip the "
            f"batch; it returned {type(loss).__name__}."
        )
    if loss.numel() != 1:
        raise ValueError(
            f"training_step returned a loss of shape {tuple(loss.shape)}; the loss must be a scalar. "
            "Reduce it (e.g. loss.mean()) before returning it."
        )
    if not loss.requires_grad:
        raise ValueError(
            "training_step returned a loss that does not require grad, so nothing can be trained. "
            "Was it computed under torch.no_grad(), or detached (.item(), .detach())?"
        )
    return loss


def as_output_dict(output: Any) -> Any:
    """What ``on_train_batch_end`` receives in automatic optimization: a dict with a detached ``loss`` (an
    empty one when ``training_step`` returned None, as Lightning)."""
    if output is None:
        return {}
    if isinstance(output, torch.Tensor):
        return {"loss": output.detach()}
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return {**output, "loss": output["loss"].detach()}
    return output


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (LBFGS and similar line-search optimizers)."""
    try:
        param = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a builtin or otherwise opaque step
        return False
    return param is not None and param.default is inspect.Parameter.empty


def _override(module: TrainModule, name: str) -> Callable[..., Any] | None:
    """``module``'s ``name`` when it overrides TrainModule's (None on the instance does not), else None."""
    return getattr(module, name) if defines_hook(name, module, TrainModule) else None


class _Closure:
    """What ``optimizer_step`` receives as ``optimizer_closure``: one call runs the batch's forward,
    backward and pre-step work and returns the loss (None when ``training_step`` returned None)."""

    __slots__ = ("_step", "_batch", "_batch_idx", "_pos", "_window", "outputs", "called")

    def __init__(self, step: TrainingStep, batch: Any, batch_idx: int, pos: int) -> None:
        self._step, self._batch, self._batch_idx, self._pos = step, batch, batch_idx, pos
        self._window: list[torch.Tensor | None] | None = None
        self.outputs: Any = None
        self.called = False

    def __call__(self) -> torch.Tensor | None:
        step = self._step
        if self._pos > 0 and step.evaluates_loss:
            self._window_gradients()
        # An optimizer that evaluates the loss itself cannot skip a batch (loss_closure raises instead).
        warn = not self.called and not step.evaluates_loss
        outputs, loss = step.forward_backward(self._batch, self._batch_idx, self._pos, warn=warn)
        if not self.called:
            self.called, self.outputs = True, outputs
        step.pre_step(self._pos)
        return loss

    def _window_gradients(self) -> None:
        """An optimizer that calls the closure several times (LBFGS's line search) at the last batch of an
        accumulation window: every call must see the window's earlier batches' gradients plus this batch's
        at the current weights. The first call keeps a copy of the earlier ones; the later calls start from
        it (Lightning adds each call's gradients on top of the previous calls')."""
        params = [p for group in self._step.optimizer.param_groups for p in group["params"]]
        if self._window is None:
            self._window = [None if p.grad is None else p.grad.clone() for p in params]
            return
        for p, grad in zip(params, self._window):
            p.grad = None if grad is None else grad.clone()


class TrainingStep:
    """Runs one training batch on the fit's collaborators.

    Args:
        strategy: runs ``training_step``, ``backward`` (with the module's override inside its framing)
            and the optimizer step; ``no_backward_sync`` inside an accumulation window.
        module: the TrainModule; its override points are looked up once, here.
        precision: autocast, loss scaling, unscaling, the scaler's step.
        optim: the optimizers (automatic optimization steps the first).
        metrics: told which hook runs, for ``self.log``'s defaults.
        hooks: callback and module hooks of this run.
        progress: the epoch passed to ``optimizer_step`` / ``optimizer_zero_grad``.
        accumulate_grad_batches, gradient_clip_val, gradient_clip_algorithm: the Trainer's arguments.
        profiler: times the step's parts (training_step, backward, optimizer_step); None or the
            pass-through leaves the bound methods unwrapped.
    """

    def __init__(
        self,
        *,
        strategy: Strategy,
        module: TrainModule,
        precision: Precision,
        optim: OptimizerState,
        metrics: MetricCollector,
        hooks: Hooks,
        progress: FitProgress,
        accumulate_grad_batches: int,
        gradient_clip_val: float | None,
        gradient_clip_algorithm: str,
        profiler: Profiler | None = None,
    ) -> None:
        self.strategy, self.module, self.precision, self.optim = strategy, module, precision, optim
        self.metrics, self.hooks, self.progress = metrics, hooks, progress
        self.k = accumulate_grad_batches
        self.clip_val, self.clip_algorithm = gradient_clip_val, gradient_clip_algorithm
        self.automatic = module.automatic_optimization
        self.batch_idx = 0  # the batch being run (for messages)
        #: Batches this epoch (to size a short final accumulation window) and whether the loader has a length.
        self.num_batches: float = 0
        self.sized = True
        self.window_has_grad = False
        self._warned_none = False  # "training_step returned None" is said once per fit (one TrainingStep per fit)
        self._autocast = precision.autocast if precision.autocast_dtype is not None else None
        self._backward_override = _override(module, "backward")
        self._zero_grad_override = _override(module, "optimizer_zero_grad")
        self._clip_override = _override(module, "configure_gradient_clipping") or (
            module.configure_gradient_clipping if _override(module, "clip_gradients") else None
        )
        self._hooks_bound = False
        self._profiler = profiler
        self.evaluates_loss = False
        if self.automatic and optim.optimizers:
            self._optimizer = optim.optimizers[0]
            #: What ``optimizer_step`` receives: its ``step(closure)`` is :meth:`step_optimizer`.
            self.optimizer = TrainerOptimizer(self._optimizer, self.step_optimizer)
            #: An optimizer such as LBFGS evaluates the loss itself: it gets the closure.
            self.evaluates_loss = needs_closure(self._optimizer)
            self._check_closure_optimizer()

    def bind_hooks(self) -> None:
        """Look up the per-step hooks (once per run: the hook table does not change during it)."""
        hooks, profiler, strategy = self.hooks, self._profiler, type(self.strategy).__name__
        # The callables each step makes, timed when a profiler is on (otherwise the methods themselves).
        self._training_step = wrap(profiler, f"[Strategy]{strategy}.training_step", self.strategy.training_step)
        self._backward = wrap(profiler, f"[Strategy]{strategy}.backward", self.strategy.backward)
        # As Lightning, a hook set to None is not called (nothing then runs the closure: an error, in __call__).
        optimizer_step = getattr(self.module, "optimizer_step", None)
        self._optimizer_step = (
            None
            if optimizer_step is None
            else wrap(profiler, f"[TrainModule]{type(self.module).__name__}.optimizer_step", optimizer_step)
        )
        self._h_zero_grad = hooks.get("on_before_zero_grad")
        self._h_before_backward = hooks.get("on_before_backward")
        self._h_after_backward = hooks.get("on_after_backward")
        self._h_before_step = hooks.get("on_before_optimizer_step")
        # Whether anything runs between the last backward and the step (besides a short window's rescale).
        self.pre_step_work = bool(
            self.precision.scaler is not None or self._h_before_step or self._clip_override is not None or self.clip_val
        )
        self._skip_layers(untimed=not is_active(profiler))
        self._hooks_bound = True

    def _skip_layers(self, untimed: bool) -> None:
        """Decide which layers of the step add nothing to this fit, so that the step skips them: the same
        calls in the same order, fewer frames a step. Each is skipped only when it is the default and no
        profiler times it (``untimed``):

        - the strategy's ``training_step``, when it only calls the module's with ``(batch, batch_idx)``;
        - the strategy's ``backward``, when it only calls ``loss.backward()`` (or the module's ``backward``);
        - the module's ``optimizer_step``, the optimizer wrapper, the precision's and the strategy's
          ``optimizer_step`` and the closure, when together they only run the closure and then
          ``optimizer.step()`` (no gradient scaler, an optimizer whose step takes no closure).
        """
        strategy, module = self.strategy, self.module
        self._module_step = (
            untimed
            and not defines_hook("training_step", strategy, Strategy)
            and strategy.passes_batch_idx("training_step")
            and strategy.module is module
        )
        self._own_backward = untimed and not defines_hook("backward", strategy, Strategy)
        self._direct_step = bool(
            untimed
            and self.automatic
            and self.optim.optimizers
            and not self.evaluates_loss
            and self._optimizer_step is not None
            and not defines_hook("optimizer_step", module, TrainModule)
            and self.precision.scaler is None
            and not defines_hook("optimizer_step", self.precision, Precision)
            and not defines_hook("optimizer_step", strategy, Strategy)
        )

    def runner(self) -> Callable[[Any, int, bool], tuple[Any, int]]:
        """What runs each batch of an epoch: :meth:`__call__`, or :meth:`manual_step` in manual optimization."""
        if not self._hooks_bound:
            self.bind_hooks()
        return self.__call__ if self.automatic else self.manual_step

    def __call__(self, batch: Any, batch_idx: int, is_last: bool) -> tuple[Any, int]:
        """Run one batch in automatic optimization; return its outputs and the optimizer steps it took."""
        k = self.k
        pos = batch_idx % k if k > 1 else 0
        if pos != k - 1 and not is_last:
            with self.strategy.no_backward_sync():  # not the window's last batch: no gradient communication
                outputs, _ = self.forward_backward(batch, batch_idx, pos)
            return outputs, 0
        self.batch_idx = batch_idx
        if self._direct_step:  # the closure path's work and step, without its layers (see _skip_layers)
            outputs, _ = self.forward_backward(batch, batch_idx, pos)
            if self.pre_step(pos):
                self._optimizer.step()
            return outputs, 1
        closure = _Closure(self, batch, batch_idx, pos)
        if self._optimizer_step is not None:
            self._optimizer_step(self.progress.current_epoch, batch_idx, self.optimizer, closure)
        if not closure.called:
            if self._optimizer_step is None:
                raise RuntimeError(
                    f"{type(self.module).__name__}.optimizer_step is None, so nothing runs training_step and "
                    f"backward (batch {batch_idx}): in automatic optimization optimizer_step calls "
                    "optimizer_closure. Remove the `optimizer_step = None` to use the default."
                )
            raise RuntimeError(
                f"{type(self.module).__name__}.optimizer_step did not call optimizer_closure (batch "
                f"{batch_idx}): pass it to optimizer.step(closure=optimizer_closure), or call it "
                "yourself to skip the step. It runs training_step and backward."
            )
        # As Lightning, the step counts (global_step, step-interval schedulers) even when every batch of its
        # window returned None and nothing is updated.
        return closure.outputs, 1

    def _warn_none(self, batch_idx: int) -> None:
        """Say, once per fit, that ``training_step`` returned None."""
        if self._warned_none:
            return
        self._warned_none = True
        warnings.warn(
            f"training_step returned None for batch {batch_idx}: skipping its backward, and that of every "
            "batch that returns None (said once per fit). As in Lightning, the optimizer step still counts "
            "in global_step; it updates with the gradients of the accumulation window's other batches, if any.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )

    # ------------------------------------------------------------------ the batch's work, on both paths
    def forward_backward(self, batch: Any, batch_idx: int, pos: int, warn: bool = True) -> tuple[Any, Any]:
        """training_step, then (first batch of a window) zero_grad, then backward; returns (outputs, loss)."""
        step = self.module.training_step if self._module_step else self._training_step
        if self._autocast is None:
            outputs = step(batch, batch_idx)
        else:
            with self._autocast():
                outputs = step(batch, batch_idx)
        loss = check_loss(outputs)
        if pos == 0:
            self.zero_grad(batch_idx)
        if loss is None:
            if warn:
                self._warn_none(batch_idx)
            return outputs, None
        scaled = loss
        if self.k > 1:
            # Scale by the window's real size so a short final window still averages its batches.
            window = min(self.k, self.num_batches - (batch_idx - pos)) if self.sized else self.k
            scaled = loss / window
        if self._h_before_backward:
            self.metrics.fx = "on_before_backward"
            for h in self._h_before_backward:
                h(loss)
        if self.precision.scaler is not None:
            scaled = self.precision.scale_loss(scaled)
        if not self._own_backward:
            self._backward(scaled, self._backward_override)
        elif self._backward_override is None:
            scaled.backward()
        else:
            self._backward_override(scaled)
        if self._h_after_backward:
            self.metrics.fx = "on_after_backward"
            for h in self._h_after_backward:
                h()
        self.window_has_grad = True
        return outputs, loss

    def zero_grad(self, batch_idx: int) -> None:
        """At an accumulation window's first batch: ``on_before_zero_grad``, then ``optimizer_zero_grad``."""
        optimizer = self._optimizer
        for h in self._h_zero_grad:
            h(optimizer)
        if self._zero_grad_override is None:
            optimizer.zero_grad(set_to_none=True)
        else:
            self._zero_grad_override(self.progress.current_epoch, batch_idx, optimizer)
        self.window_has_grad = False

    def skip(self, batch_idx: int) -> tuple[Any, int]:
        """A batch the train loader yielded as None: no ``training_step`` and no optimizer step (as Lightning), but
        it holds its place in its accumulation window. When it opens a window of several batches, the window's
        gradients are zeroed there, so that its other batches do not add to the previous window's (Lightning
        zeroes nothing then)."""
        if self.automatic and self.k > 1 and batch_idx % self.k == 0 and self.optim.optimizers:
            self.zero_grad(batch_idx)
        return None, 0

    def pre_step(self, pos: int) -> bool:
        """After the window's last backward: what runs before the step (see :meth:`before_optimizer_step`), when
        anything does; returns whether the window has gradients to step on."""
        # A window whose last batch returned None still steps on its earlier batches' gradients.
        if self.window_has_grad:
            if self.pre_step_work or not self.sized:
                self.before_optimizer_step(pos)
            return True
        if self.pre_step_work:
            # Every batch of the window returned None: as Lightning, on_before_optimizer_step and the clipping
            # still run (on no gradients); nothing was scaled, so nothing is unscaled.
            self.before_optimizer_step(pos, unscale=False)
        return False

    def before_optimizer_step(self, pos: int, unscale: bool = True) -> None:
        """Between the window's last backward and the step: unscale (``unscale``: when there was a backward to
        unscale), ``on_before_optimizer_step``, clip."""
        optimizer = self._optimizer
        if not self.sized and pos + 1 < self.k:
            # A short final window of a loader without a length: rescale the 1/k-scaled gradients.
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(self.k / (pos + 1))
        if not self.pre_step_work:
            return
        if self.precision.scaler is not None and unscale:
            self.precision.unscale(optimizer)
        if self._h_before_step:
            self.metrics.fx = "on_before_optimizer_step"
            for h in self._h_before_step:
                h(optimizer)
        if self._clip_override is not None:
            # The Trainer's values; like Lightning, no algorithm is named when no clipping value is set.
            self._clip_override(
                optimizer,
                gradient_clip_val=self.clip_val,
                gradient_clip_algorithm=self.clip_algorithm if self.clip_val is not None else None,
            )
        elif self.clip_val:
            self.module.clip_gradients(optimizer, self.clip_val, self.clip_algorithm)

    def step_optimizer(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None, kwargs: dict[str, Any]
    ) -> Any:
        """``optimizer.step(closure, **kwargs)`` inside ``optimizer_step``: runs the closure, then the real step
        through the precision plugin and the strategy; an optimizer that evaluates the loss itself (LBFGS)
        gets the closure instead. A window whose batches all returned None takes no step."""
        precision, strategy = self.precision, self.strategy
        if closure is not None:
            if self.evaluates_loss:
                return precision.optimizer_step(optimizer, strategy, self.loss_closure(closure), **kwargs)
            closure()
            if not self.window_has_grad:  # training_step returned None on every batch of the window: no step
                return None
        return precision.optimizer_step(optimizer, strategy, None, **kwargs)

    def loss_closure(self, closure: Callable[[], Any]) -> Callable[[], torch.Tensor]:
        """For an optimizer that calls the closure itself: every call must yield a loss, the same on every rank."""
        strategy = self.strategy

        def evaluate() -> torch.Tensor:
            loss = closure()
            if loss is None:
                raise ValueError(
                    f"training_step returned None for batch {self.batch_idx}, but "
                    f"{type(self.optim.optimizers[0]).__name__} needs the loss from every closure call, "
                    "so the batch cannot be skipped. Return a loss, or use an optimizer whose step takes "
                    "no closure."
                )
            if strategy.world_size > 1:
                # The optimizer decides from the loss (convergence, line search): every rank must see the
                # same value, or ranks would call the closure a different number of times and leave each
                # other waiting in the gradient all-reduce.
                return strategy.reduce(loss.detach(), "mean")
            return loss

        return evaluate

    def _check_closure_optimizer(self) -> None:
        if not self.evaluates_loss:
            return
        name = type(self._optimizer).__name__
        if self.precision.scaler is not None:
            raise ValueError(
                f"{name}.step needs a closure, which a gradient scaler (precision='16-mixed') cannot "
                "drive. Use precision='bf16-mixed' or '32-true' with this optimizer."
            )

    # ------------------------------------------------------------------ manual optimization
    def manual_step(self, batch: Any, batch_idx: int, is_last: bool) -> tuple[Any, int]:
        """Run one batch in manual optimization: its ``training_step`` steps the optimizers itself (``is_last``
        is not needed); return its outputs and the optimizer steps it took."""
        before = self.optim.steps_taken
        with self.precision.autocast():
            outputs = self._training_step(batch, batch_idx)
        return outputs, self.optim.steps_taken - before

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``self.manual_backward(loss)``: the backward hooks, precision scaling and the strategy's gradient sync."""
        self.hooks.call("on_before_backward", loss)
        scaled = self.precision.scale_loss(loss)
        if args or kwargs:
            custom = self._backward_override or torch.Tensor.backward
            self.strategy.backward(scaled, lambda t: custom(t, *args, **kwargs))
        else:
            self.strategy.backward(scaled, self._backward_override)
        self.hooks.call("on_after_backward")
