"""The Trainer: arguments, the fit / validate / test / predict entry points, and public state."""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ember.callbacks.callback import Callback
from ember.callbacks.logger import Logger
from ember.data import DataModule
from ember.module import TrainModule
from ember.strategies.strategy import Strategy
from ember.trainer import arguments, loops
from ember.trainer.metrics import MetricCollector
from ember.trainer.optim import OptimizerState
from ember.trainer.precision import Precision, normalize_precision
from ember.trainer.preemption import PreemptionHandler
from ember.trainer.progress import FitProgress
from ember.trainer.runs import _Runs
from ember.types import PrecisionInput, Stage, TrainerState


class Trainer(_Runs):
    """Runs a ``TrainModule``'s training, evaluation and prediction on a chosen strategy.

    Args:
        strategy: "auto", "single", "dp", "ddp", "ddp_spawn", another registered name, or a Strategy.
        accelerator: "auto", "cpu" or "cuda" ("gpu" is an alias of "cuda").
        devices: how many devices (int), which ones (list of indices), or "auto" (1).
        max_epochs: stop after this many epochs; -1 means no epoch limit. Default 1000 when
            neither ``max_epochs`` nor ``max_steps`` is given.
        max_steps: stop after this many optimizer steps (``global_step``); -1 means no limit.
        min_epochs: ``should_stop`` is ignored before this many epochs.
        accumulate_grad_batches: step the optimizer every k batches; the loss of each batch is
            divided by the size of its window, so a short final window still averages its batches.
        gradient_clip_val: clip gradients to this norm/value before each optimizer step.
        gradient_clip_algorithm: "norm" or "value".
        precision: "32-true", "64-true", "bf16-mixed" or "16-mixed".
        val_check_interval: a fraction of the training epoch, or an int number of batches.
        check_val_every_n_epoch: validate every n epochs; None to validate by batch count only.
        limit_train_batches, limit_val_batches, limit_test_batches, limit_predict_batches: a
            fraction or an int number of batches per epoch.
        num_sanity_val_steps: validation batches run before training (-1: all).
        log_every_n_steps: how often step metrics go to the loggers.
        fast_dev_run: run n (True: 1) batches of train, validation and test, without loggers or checkpoints.
        deterministic: ``torch.use_deterministic_algorithms`` (True, False or "warn").
        default_root_dir: where logs and checkpoints go by default (the working directory).
        callbacks: a Callback or a list of them.
        enable_progress_bar: add the default progress bar.
        enable_checkpointing: add a default ModelCheckpoint when none is given.
        logger: True for the default logger, False/None for none, or one or more Logger callbacks.
        enable_model_summary: print a table of the model's layers at fit start.
        reload_dataloaders_every_n_epochs: request the loaders from the module or datamodule again
            every n epochs (0: once per fit).
    """

    def __init__(
        self,
        *,
        strategy: str | Strategy = "auto",
        accelerator: str = "auto",
        devices: int | Sequence[int] | str = "auto",
        max_epochs: int | None = None,
        max_steps: int = -1,
        min_epochs: int = 0,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        precision: PrecisionInput = "32-true",
        val_check_interval: int | float = 1.0,
        check_val_every_n_epoch: int | None = 1,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        num_sanity_val_steps: int = 2,
        log_every_n_steps: int = 50,
        fast_dev_run: bool | int = False,
        deterministic: bool | str | None = None,
        default_root_dir: str | None = None,
        callbacks: Callback | Iterable[Callback] | None = None,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        logger: bool | Logger | Iterable[Logger] | None = True,
        enable_model_summary: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
    ) -> None:
        if max_epochs is None:
            max_epochs = 1000 if max_steps == -1 else -1
        if not isinstance(max_epochs, int) or (max_epochs < 0 and max_epochs != -1):
            raise ValueError(f"max_epochs must be a non-negative int (or -1 for no limit), got {max_epochs!r}.")
        if not isinstance(max_steps, int) or (max_steps < 0 and max_steps != -1):
            raise ValueError(f"max_steps must be a non-negative int (or -1 for no limit), got {max_steps!r}.")
        if not isinstance(min_epochs, int) or min_epochs < 0:
            raise ValueError(f"min_epochs must be a non-negative int, got {min_epochs!r}.")
        if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be a positive int, got {accumulate_grad_batches!r}.")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value', got {gradient_clip_algorithm!r}.")
        if gradient_clip_val is not None and gradient_clip_val < 0:
            raise ValueError(f"gradient_clip_val must be >= 0, got {gradient_clip_val!r}.")
        if (isinstance(val_check_interval, bool) or not isinstance(val_check_interval, (int, float))
                or val_check_interval <= 0):
            raise ValueError("val_check_interval must be a fraction in (0, 1] or a positive int, "
                             f"got {val_check_interval!r}.")
        if isinstance(val_check_interval, float) and val_check_interval > 1.0:
            raise ValueError(f"val_check_interval={val_check_interval} is a fraction above 1.0; "
                             "pass an int for a batch count.")
        if check_val_every_n_epoch is not None and (not isinstance(check_val_every_n_epoch, int)
                                                    or check_val_every_n_epoch < 1):
            raise ValueError("check_val_every_n_epoch must be a positive int or None, "
                             f"got {check_val_every_n_epoch!r}.")
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be a positive int, got {log_every_n_steps!r}.")
        if not isinstance(num_sanity_val_steps, int) or num_sanity_val_steps < -1:
            raise ValueError(f"num_sanity_val_steps must be an int >= -1, got {num_sanity_val_steps!r}.")

        if not isinstance(reload_dataloaders_every_n_epochs, int) or reload_dataloaders_every_n_epochs < 0:
            raise ValueError("reload_dataloaders_every_n_epochs must be a non-negative int, got "
                             f"{reload_dataloaders_every_n_epochs!r}.")
        self.reload_dataloaders_every_n_epochs = reload_dataloaders_every_n_epochs
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.min_epochs = min_epochs
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.val_check_interval = val_check_interval
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.limit_train_batches = arguments.check_limit("limit_train_batches", limit_train_batches)
        self.limit_val_batches = arguments.check_limit("limit_val_batches", limit_val_batches)
        self.limit_test_batches = arguments.check_limit("limit_test_batches", limit_test_batches)
        self.limit_predict_batches = arguments.check_limit("limit_predict_batches", limit_predict_batches)
        self.num_sanity_val_steps = math.inf if num_sanity_val_steps == -1 else num_sanity_val_steps
        self.log_every_n_steps = log_every_n_steps
        self.default_root_dir = os.fspath(default_root_dir) if default_root_dir is not None else os.getcwd()

        if not isinstance(fast_dev_run, int) or fast_dev_run < 0:  # bool is an int: True means 1
            raise ValueError(f"fast_dev_run must be a bool or a non-negative int, got {fast_dev_run!r}.")
        self.fast_dev_run = int(fast_dev_run)
        if self.fast_dev_run:
            n = self.fast_dev_run
            self.limit_train_batches = self.limit_val_batches = n
            self.limit_test_batches = self.limit_predict_batches = n
            self.max_epochs, self.max_steps, self.num_sanity_val_steps = 1, n, 0
            self.val_check_interval, self.check_val_every_n_epoch = 1.0, 1
            logger, enable_checkpointing = False, False

        if deterministic is not None:
            if deterministic not in (True, False, "warn"):
                raise ValueError(f"deterministic must be True, False or 'warn', got {deterministic!r}.")
            torch.use_deterministic_algorithms(bool(deterministic), warn_only=deterministic == "warn")

        self._precision_name = normalize_precision(precision)
        accelerator_name, device_list = arguments.resolve_devices(accelerator, devices)
        self.strategy = arguments.resolve_strategy(self, strategy, accelerator_name, device_list)
        self._precision = Precision(self._precision_name, self.strategy.root_device.type)
        self._input_dtype = self._precision.input_dtype

        self.callbacks: list[Callback] = arguments.build_callbacks(self, callbacks, enable_progress_bar,
                                                                   enable_checkpointing, enable_model_summary)
        self.loggers: list[Logger] = arguments.build_loggers(self, logger)
        for lg in self.loggers:
            if lg not in self.callbacks:
                self.callbacks.append(lg)

        self.progress = FitProgress()
        self._preemption: PreemptionHandler | None = None  # installed for the length of a fit loop
        self.should_stop = False
        self.sanity_checking = False
        self.state: TrainerState = "initializing"
        # None until a run attaches one; _Runs (runs.py) types it without None: see pyproject.toml.
        self.module: TrainModule | None = None  # type: ignore[assignment]
        self.datamodule: DataModule | None = None
        self._metrics = MetricCollector(self.strategy)
        self.logged_metrics: dict[str, float] = {}
        #: Epoch-level metrics of the last fit, one dict per epoch.
        self.history: list[dict[str, float]] = []
        self._optim = OptimizerState(self, [], [])
        self._loop = loops.FitLoop(self)
        self._hook_table: dict[tuple[str, Any], list[Callable[..., Any]]] = {}
        self._train_loader: Any = None
        #: ``(epoch, samples)``: where a resume on another number of ranks left the global position
        #: of that epoch relative to ``batch_in_epoch * batch_size * world_size`` (see checkpoint.py).
        self._position_offset: tuple[int, int] | None = None
        self._val_loaders: list[Any] = []
        self.num_training_batches: float = 0
        self.num_val_batches: list[float] = []
        self._eval_total: float = 0
        self.ckpt_path: str | None = None

    # ------------------------------------------------------------------ hook dispatch
    def _hooks(self, name: str, monitoring: bool | None = None) -> list[Callable[..., Any]]:
        """Bound callables for hook ``name``: overriding callbacks first, then the module.

        ``monitoring`` selects callbacks that watch metrics (``monitors_metrics = True``, e.g.
        checkpointing and early stopping) or the others; they run after the module's epoch-end hook.
        """
        key = (name, monitoring)
        table = self._hook_table.get(key)
        if table is not None:
            return table
        table = []
        base = getattr(Callback, name, None)
        for cb in self.callbacks:
            if monitoring is not None and bool(cb.monitors_metrics) != monitoring:
                continue
            if base is not None and getattr(type(cb), name, base) is not base:
                table.append(functools.partial(getattr(cb, name), self, self.module))
        module = self.module
        mod_base = getattr(TrainModule, name, None)
        if (module is not None and monitoring is not True and mod_base is not None
                and getattr(type(module), name) is not mod_base):
            table.append(getattr(module, name))
        self._hook_table[key] = table
        return table

    def _call(self, name: str, *args: Any, monitoring: bool | None = None) -> None:
        hooks = self._hooks(name, monitoring)
        if hooks:
            self._metrics.fx = name  # decides self.log's on_step/on_epoch defaults inside the hook
            for h in hooks:
                h(*args)

    # ------------------------------------------------------------------ entry points
    def fit(self, module: TrainModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: DataModule | None = None, ckpt_path: str | None = None) -> None:
        """Train ``module``.

        Args:
            module: the TrainModule to train.
            train_dataloaders: a DataLoader (or any iterable of batches).
            val_dataloaders: one loader or a list of them.
            datamodule: a DataModule providing the loaders instead.
            ckpt_path: resume from this checkpoint, or "last" / "best".
        """
        self._check_module(module)
        if isinstance(train_dataloaders, DataModule) and datamodule is None:  # Lightning's fit(model, dm)
            train_dataloaders, datamodule = None, train_dataloaders
        if datamodule is not None and (train_dataloaders is not None or val_dataloaders is not None):
            raise ValueError("Pass either dataloaders or a datamodule to fit, not both.")
        self.state = "fitting"
        self.strategy.launch(self._run_fit, module, train_dataloaders, val_dataloaders, datamodule, ckpt_path)

    def validate(self, module: TrainModule | None = None, dataloaders: Any = None, datamodule: DataModule | None = None,
                 ckpt_path: str | None = None) -> list[dict[str, float]]:
        """Run ``validation_step`` over the loaders; returns one metric dict per loader."""
        return self._evaluate("validate", module, dataloaders, datamodule, ckpt_path)

    def test(self, module: TrainModule | None = None, dataloaders: Any = None, datamodule: DataModule | None = None,
             ckpt_path: str | None = None) -> list[dict[str, float]]:
        """Run ``test_step`` over the loaders; returns one metric dict per loader."""
        return self._evaluate("test", module, dataloaders, datamodule, ckpt_path)

    def predict(self, module: TrainModule | None = None, dataloaders: Any = None, datamodule: DataModule | None = None,
                ckpt_path: str | None = None) -> list[Any]:
        """Run ``predict_step``; returns the outputs (a list per loader when there are several)."""
        module = self._module_for_eval(module)
        if isinstance(dataloaders, DataModule) and datamodule is None:  # Lightning's predict(model, dm)
            dataloaders, datamodule = None, dataloaders
        self.state = "predicting"
        return self.strategy.launch(self._run_predict, module, dataloaders, datamodule, ckpt_path)

    def _evaluate(self, stage: Stage, module: TrainModule | None, dataloaders: Any, datamodule: DataModule | None,
                  ckpt_path: str | None) -> list[dict[str, float]]:
        module = self._module_for_eval(module)
        if isinstance(dataloaders, DataModule) and datamodule is None:  # Lightning's validate/test(model, dm)
            dataloaders, datamodule = None, dataloaders
        self.state = "validating" if stage == "validate" else "testing"
        return self.strategy.launch(self._run_eval, stage, module, dataloaders, datamodule, ckpt_path)

    def _module_for_eval(self, module: TrainModule | None) -> TrainModule:
        if module is None:
            if self.module is None:
                raise ValueError("No module given and none was fitted with this Trainer: pass the module.")
            module = self.module
        self._check_module(module)
        return module

    @staticmethod
    def _check_module(module: Any) -> None:
        if not isinstance(module, TrainModule):
            raise TypeError(f"Expected an ember.TrainModule, got {type(module).__name__}. Subclass ember.TrainModule.")
        if "_log_sink" not in module.__dict__:
            raise RuntimeError(f"{type(module).__name__}.__init__ did not call super().__init__(); call it first.")

    # ------------------------------------------------------------------ public state
    @property
    def current_epoch(self) -> int:
        return self.progress.current_epoch

    @property
    def global_step(self) -> int:
        return self.progress.global_step

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def callback_metrics(self) -> dict[str, Any]:
        return self._metrics.callback_metrics

    @callback_metrics.setter
    def callback_metrics(self, value: dict[str, Any]) -> None:
        self._metrics.callback_metrics = value

    @property
    def progress_bar_metrics(self) -> dict[str, Any]:
        return self._metrics.progress_bar_metrics

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._optim.optimizers

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        return self._optim.schedulers

    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str:
        """The first logger's directory, or ``default_root_dir`` without a logger."""
        for lg in self.loggers:
            if lg.log_dir is not None:
                return lg.log_dir
        return self.default_root_dir

    @property
    def precision(self) -> str:
        return self._precision_name

    @property
    def training(self) -> bool:
        return self.state == "fitting" and not self.sanity_checking

    @property
    def lightning_module(self) -> TrainModule | None:
        return self.module

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer steps the fit will take (inf when the loader has no length and no max_steps)."""
        if self.state == "fitting" and self._train_loader is None and self.module is not None:
            self._load_fit_loaders()  # read in configure_optimizers: the loaders are requested now (as Lightning)
        per_epoch = math.ceil(self.num_training_batches / self.accumulate_grad_batches) \
            if self.num_training_batches != math.inf else math.inf
        total = per_epoch * self.max_epochs if self.max_epochs != -1 else math.inf
        return min(total, self.max_steps) if self.max_steps != -1 else total
