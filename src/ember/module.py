"""TrainModule: the user's model, its steps, its optimizers and its hooks.

Beside it: the data and eval-mode hooks it inherits (``module_hooks.py``), where ``self.log`` goes under
a strategy's redirect (``log_redirect.py``), how the loops read a step's parameters (``signatures.py``;
those names are re-exported here) and the export to TorchScript and ONNX (``export.py``).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from ember import export
from ember.checkpoint.weights import read_for_module
from ember.hparams import AttributeDict as AttributeDict  # re-exported: ember.module.AttributeDict
from ember.hparams import HyperparametersMixin
from ember.log_redirect import LOG_REDIRECTS as _LOG_REDIRECTS
from ember.log_redirect import logging_off as _logging_off
from ember.log_redirect import redirect_log as redirect_log  # re-exported: ember.module.redirect_log
from ember.log_redirect import redirected_sink as _redirected_sink
from ember.metric_values import is_torchmetric
from ember.module_hooks import DataHooks, ModeHooks, PlacementProperties
from ember.signatures import hook_parameters as hook_parameters  # re-exported, as the two below
from ember.signatures import takes_batch_idx as takes_batch_idx
from ember.signatures import takes_dataloader_iter as takes_dataloader_iter
from ember.types import REDUCE_OPS, parse_reduce_fx

if TYPE_CHECKING:
    from ember.callbacks.callback import Callback
    from ember.trainer.trainer import Trainer
    from ember.types import ReduceFx, Stage

_M = TypeVar("_M", bound="TrainModule")


class TrainModule(HyperparametersMixin, DataHooks, ModeHooks, PlacementProperties, nn.Module):
    """Subclass this: define ``training_step`` and ``configure_optimizers``, then ``Trainer.fit`` it.

    Hooks are called in Lightning's order; every hook here is a no-op (the loader, batch-transfer and
    eval-mode hooks, with their defaults, come from ``module_hooks.py``, as do ``device``, ``dtype``,
    ``on_gpu`` and ``local_rank``) and the Trainer calls only the ones a subclass overrides.
    """

    # Properties TorchScript must not compile (to_torchscript scripts the module).
    __jit_unused_properties__ = [
        "trainer",
        "logger",
        "loggers",
        "current_epoch",
        "global_step",
        "global_rank",
        "example_input_array",
        "hparams",
        "hparams_initial",
        "strict_loading",
        *PlacementProperties.PLACEMENT_PROPERTIES,
    ]

    def __init__(self) -> None:
        super().__init__()
        #: With ``False``, ``training_step`` does its own ``optimizers()`` / ``manual_backward`` / ``step``.
        self.automatic_optimization: bool = True
        self._trainer: Trainer | None = None
        self._example_input_array: Any = None
        self._strict_loading: bool | None = None

    # ------------------------------------------------------------------ trainer-provided state
    @property
    def trainer(self) -> Trainer:
        if self._trainer is None and not self.__dict__.get("_exporting"):
            raise RuntimeError(
                f"{type(self).__name__} is not attached to a Trainer. Call trainer.fit(module, ...) first."
            )
        return self._trainer  # type: ignore[return-value]  # None only while exporting: TorchScript reads it

    @trainer.setter
    def trainer(self, trainer: Trainer | None) -> None:
        # As Lightning: TrainModules held as direct children (and theirs, recursively) see the same Trainer.
        for child in self.children():
            if isinstance(child, TrainModule):
                child.trainer = trainer
        self._trainer = trainer

    @property
    def example_input_array(self) -> Any:
        """An example input of ``forward``, for ``to_onnx`` and ``to_torchscript(method="trace")`` (None: unset)."""
        return self.__dict__.get("_example_input_array")

    @example_input_array.setter
    def example_input_array(self, example: Any) -> None:
        self._example_input_array = example

    @property
    def logger(self) -> Any:
        """The Trainer's first logger (None outside a Trainer or without loggers)."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list[Any]:
        """The Trainer's loggers (empty outside a Trainer)."""
        return self._trainer.loggers if self._trainer is not None else []

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def global_rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def strict_loading(self) -> bool:
        """Whether checkpoints must hold exactly this module's keys when a fit resumes, ``validate`` / ``test`` /
        ``predict`` load ``ckpt_path``, or ``load_from_checkpoint`` is not given ``strict`` (default True).
        Set it to False, as in Lightning, for a module that saves only part of its weights (e.g. not a
        frozen backbone): the keys the checkpoint holds are loaded, and the others keep their values."""
        return self._strict_loading in (None, True)

    @strict_loading.setter
    def strict_loading(self, value: bool | None) -> None:
        self._strict_loading = None if value is None else bool(value)  # None: the default (True), as Lightning

    @classmethod
    def load_from_checkpoint(
        cls: type[_M],
        checkpoint_path: str,
        map_location: Any = "cpu",
        strict: bool | None = None,
        weights_only: bool = True,
        **overrides: Any,
    ) -> _M:
        """Rebuild this module from a checkpoint's saved hyper-parameters and load its weights.

        Args:
            checkpoint_path: an ember checkpoint file, or a PyTorch Lightning one (its weights and hyper-parameters).
            weights_only: refuse files holding pickled Python objects (they can run code when loaded); pass
                ``False`` only for a file you trust, e.g. a Lightning checkpoint whose hyper-parameters hold objects.
            map_location: where tensors are loaded (as in ``torch.load``).
            strict: require the checkpoint's keys and shapes to match the module exactly (None: the
                module's ``strict_loading``; a module that set ``strict_loading = False`` refuses
                ``strict=True``, as Lightning). Without it, missing and unexpected keys are warned about.
            **overrides: constructor arguments that replace the saved hyper-parameters; names the
                constructor does not take are ignored with a warning (unless it takes ``**kwargs``).
        """
        return read_for_module(
            checkpoint_path, cls, overrides, strict=strict, map_location=map_location, weights_only=weights_only
        )

    # ------------------------------------------------------------------ logging
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: ReduceFx = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Record a metric (Lightning's ``self.log``, with its arguments in its order).

        Args:
            name: key in ``trainer.callback_metrics`` and in the loggers.
            value: a number or a scalar tensor (detached, and kept as a tensor), or a ``torchmetrics.Metric``
                (an attribute of the module): per step its last forward's batch value, per epoch its
                ``compute()`` at the epoch's end, after which it is ``reset()``. The Metric synchronises
                across processes itself; under ``dp`` the replicas' updates are merged into it after each step.
            prog_bar: show it in the progress bar.
            logger: send it to the loggers (None: True).
            on_step: keep per-step values (default: True in training steps and batch hooks, else False).
                In evaluation, per-step values go to the loggers (``name_step``), not to ``callback_metrics``.
            on_epoch: reduce over the epoch (default: the opposite of ``on_step``'s default).
            reduce_fx: epoch reduction: "mean" (batch-size weighted), "sum", "min" or "max" in any case,
                "avg", or torch.mean / torch.sum / torch.max / torch.min / sum / max / min.
            enable_graph: keep the value's autograd graph instead of detaching it.
            sync_dist: also reduce step values across processes (epoch values are always reduced).
            sync_dist_group: must be None: ember reduces across all processes.
            add_dataloader_idx: with several evaluation loaders, append ``/dataloader_idx_<i>`` to the name.
            batch_size: weight of this value in the epoch mean; inferred from the batch when omitted.
            metric_attribute: accepted for compatibility (Lightning uses it to find a logged Metric's attribute
                when restoring a checkpoint; a Metric's state here is whatever its own ``state_dict`` holds).
            rank_zero_only: accepted for compatibility; ember reduces every key on every rank.
        """
        if _logging_off(self._trainer):  # Trainer(barebones=True): nothing is logged, as in Lightning
            return
        # The trainer's collector of this run (``fit_state.start_run`` renews it), unless redirected.
        sink = _redirected_sink(self) if _LOG_REDIRECTS else None
        if sink is None and self._trainer is not None:
            sink = self._trainer.fit_state.metrics
        if sink is None:
            raise RuntimeError(
                f"self.log({name!r}, ...) was called outside of a Trainer run. Call it from training_step, "
                "validation_step or a hook while trainer.fit/validate/test runs."
            )
        if sync_dist_group is not None:
            raise ValueError(
                f"self.log({name!r}, sync_dist_group=...): ember reduces across all processes; "
                "leave sync_dist_group=None."
            )
        if reduce_fx not in REDUCE_OPS:  # an alias ("avg", "MAX") or a function (torch.max): its name
            reduce_fx = parse_reduce_fx(name, reduce_fx)
        sink.log(
            name,
            value,
            prog_bar=prog_bar,
            logger=logger is not False,
            on_step=on_step,
            on_epoch=on_epoch,
            reduce_fx=reduce_fx,
            batch_size=batch_size,
            sync_dist=sync_dist,
            add_dataloader_idx=add_dataloader_idx,
            enable_graph=enable_graph,
        )

    def log_dict(self, dictionary: Any, **kwargs: Any) -> None:
        """``self.log`` every item of ``dictionary`` (a dict, or a ``torchmetrics.MetricCollection``, whose
        Metrics are logged under their prefixed names) with the same options."""
        if is_torchmetric(dictionary, "MetricCollection"):
            # As Lightning: the member Metrics themselves (states shared within a compute group, not copied).
            items = dictionary.items(keep_base=False, copy_state=False)
        else:
            items = dictionary.items()
        for k, v in items:
            self.log(k, v, **kwargs)

    # ------------------------------------------------------------------ across processes
    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every process's ``data``, each tensor stacked along a new first dimension (Lightning's ``all_gather``).

        ``data`` may be a tensor, a number, or lists, tuples and dicts of them (numbers become tensors on
        ``self.device``). In one process (``single``, ``dp``) the tensors come back without the new dimension,
        as in Lightning; under ``ddp`` their shape is ``[world_size, *shape]``.

        Args:
            data: what to gather; every process must pass the same structure, shapes and dtypes.
            group: the process group (None: all processes).
            sync_grads: let gradients flow back through the gather to every process's tensors.
        """
        strategy = self.trainer.strategy
        device = self.device

        def gather(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return strategy.all_gather(value.to(device), group=group, sync_grads=sync_grads)
            return strategy.all_gather(torch.as_tensor(value, device=device), group=group, sync_grads=sync_grads)

        return apply_to_collection(data, (torch.Tensor, numbers.Number), gather)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank zero only (each process outside a Trainer), through the bar while one is drawn."""
        trainer = self._trainer
        bar = None if trainer is None else trainer.progress_bar_callback
        if trainer is None or trainer.is_global_zero:
            (bar.print if bar is not None and bar.is_enabled else print)(*args, **kwargs)

    # ------------------------------------------------------------------ export
    def to_torchscript(
        self,
        file_path: str | os.PathLike | None = None,
        method: str = "script",
        example_inputs: Any = None,
        **kwargs: Any,
    ) -> Any:
        """This module as TorchScript, in eval mode (Lightning's ``to_torchscript``); saved to ``file_path`` if given.

        Args:
            file_path: where to ``torch.jit.save`` it (None: only return it).
            method: "script" (``torch.jit.script``) or "trace" (``torch.jit.trace`` on ``example_inputs``).
            example_inputs: the input to trace with (default ``self.example_input_array``).
            **kwargs: passed to ``torch.jit.script`` / ``torch.jit.trace``.
        """
        return export.to_torchscript(self, file_path, method, example_inputs, **kwargs)

    def to_onnx(self, file_path: str | os.PathLike | None = None, input_sample: Any = None, **kwargs: Any) -> Any:
        """Export this module, in eval mode, to ONNX with ``torch.onnx.export`` (Lightning's ``to_onnx``).

        Needs ``pip install 'ember[onnx]'``. Returns what ``torch.onnx.export`` returns (an ``ONNXProgram``).

        Args:
            file_path: the ``.onnx`` file to write (None: only return the program).
            input_sample: the input to export with (default ``self.example_input_array``); a tuple is unpacked.
            **kwargs: passed to ``torch.onnx.export``.
        """
        return export.to_onnx(self, file_path, input_sample, **kwargs)

    # ------------------------------------------------------------------ optimizers
    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The optimizers from ``configure_optimizers`` (one, or a list), for manual optimization: each wrapped so
        that ``step`` goes through the Trainer (precision, strategy, hooks), or, with ``use_pl_optimizer=False``
        (Lightning's name), the optimizers themselves."""
        optim = self.trainer.fit_state.optim
        opts = optim.wrapped_optimizers if use_pl_optimizer else optim.optimizers
        return opts[0] if len(opts) == 1 else opts

    def lr_schedulers(self) -> Any:
        """The LR schedulers (one, a list, or None)."""
        scheds = [c.scheduler for c in self.trainer.lr_scheduler_configs]
        if not scheds:
            return None
        return scheds[0] if len(scheds) == 1 else scheds

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Let only ``optimizer``'s parameters compute gradients: every other optimizer's parameters get
        ``requires_grad=False`` until ``untoggle_optimizer`` (parameters already frozen stay frozen)."""
        state: dict[torch.nn.Parameter, bool] = {}
        for opt in self.trainer.optimizers:
            for group in opt.param_groups:
                for param in group["params"]:
                    if param not in state:
                        state[param] = param.requires_grad
                        param.requires_grad = False
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.requires_grad = state.get(param, param.requires_grad)
        self._toggled_requires_grad = state

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Give back the ``requires_grad`` flags that ``toggle_optimizer(optimizer)`` changed."""
        state = getattr(self, "_toggled_requires_grad", {})
        inner = getattr(optimizer, "optimizer", optimizer)  # what self.optimizers() hands out wraps the optimizer
        for opt in self.trainer.optimizers:
            if opt is optimizer or opt is inner:
                continue
            for group in opt.param_groups:
                for param in group["params"]:
                    if param in state:
                        param.requires_grad = state[param]
        self._toggled_requires_grad = {}

    @contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """``toggle_optimizer`` for the body of a ``with`` block, ``untoggle_optimizer`` after it."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def freeze(self) -> TrainModule:
        """No parameter computes gradients, and eval mode; returns the module."""
        for param in self.parameters():
            param.requires_grad = False
        return self.eval()

    def unfreeze(self) -> TrainModule:
        """Every parameter computes gradients, and train mode; returns the module."""
        for param in self.parameters():
            param.requires_grad = True
        return self.train()

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Backward for manual optimization: applies precision scaling and the strategy's gradient sync."""
        loop = self.trainer.fit_loop
        if loop is None or self.trainer.state != "fitting":
            raise RuntimeError("manual_backward is for training_step during fit (with automatic_optimization=False).")
        loop.manual_backward(loss, *args, **kwargs)

    # ------------------------------------------------------------------ what users override
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define training_step(self, batch, batch_idx) returning the loss to fit it."
        )

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no validation_step; define it to validate.")

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no test_step; define it to test.")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Default: ``self(batch)`` (the first element when the batch is a tuple or list)."""
        if isinstance(batch, (tuple, list)) and batch:
            batch = batch[0]
        return self(batch)

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define configure_optimizers() returning an optimizer, a list of them, "
            "([optimizers], [schedulers]) or {'optimizer': ..., 'lr_scheduler': ...}."
        )

    def configure_callbacks(self) -> Sequence[Callback] | Callback:
        return []

    def prepare_data(self) -> None: ...
    def configure_model(self) -> None:
        """Create layers here (called after ``setup`` on every entry point, before optimizers exist).

        It may run more than once (each fit / validate / ...): skip what already exists.
        """

    def configure_sharded_model(self) -> None:
        """Deprecated (Lightning's older name): override ``configure_model``; an override still runs, just before."""

    def setup(self, stage: Stage) -> None: ...
    def teardown(self, stage: Stage) -> None: ...
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...

    # ------------------------------------------------------------------ override points the loops call
    # The Trainer calls these only when a subclass overrides them; otherwise it does the same work
    # inline (the defaults below say what that work is).
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Compute gradients of ``loss`` (already scaled for accumulation and mixed precision)."""
        loss.backward(*args, **kwargs)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Reset gradients at the start of an accumulation window."""
        optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Step ``optimizer``. ``optimizer_closure`` runs training_step, zero_grad and backward (and the
        pre-step hooks and clipping): pass it to ``optimizer.step(closure=...)``, or call it yourself to
        skip the step. It must be called exactly once.
        """
        optimizer.step(closure=optimizer_closure)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip before each optimizer step; the arguments are the Trainer's. Default: ``clip_gradients``."""
        self.clip_gradients(
            optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
        )

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip the gradients of ``optimizer``'s parameters by norm or value (nothing when the value is 0 or None)."""
        if not gradient_clip_val:
            return
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if (gradient_clip_algorithm or "norm") == "norm":
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
        elif gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
        else:
            raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value', got {gradient_clip_algorithm!r}.")

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Step ``scheduler`` (with the monitored value as argument when it monitors one)."""
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)
