"""The Trainer: arguments, the fit / validate / test / predict entry points, the one run helper they
share (prepare -> setup -> restore -> run -> teardown; the stages inside it are ``stages.py``), checkpoint
saving, and public state (``properties.py``)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from ember.accelerators import accelerator_for
from ember.callbacks.callback import Callback
from ember.checkpoint import contents
from ember.checkpoint.writer import BackgroundSave
from ember.data import DataModule
from ember.hparams import drop_unpicklable
from ember.loggers.logger import DummyLogger, Logger
from ember.module import TrainModule
from ember.overrides import is_overridden
from ember.profilers import Profiler
from ember.strategies.strategy import Strategy
from ember.trainer import arguments, locate
from ember.trainer.hooks import Hooks
from ember.trainer.loaders import FitData
from ember.trainer.log_writer import LogWriter
from ember.trainer.loops import FitLoop, settle_epoch_limits
from ember.trainer.precision import Precision, normalize_precision
from ember.trainer.preemption import PreemptionHandler
from ember.trainer.stages import TrainerStages
from ember.trainer.state import FitState
from ember.trainer.states import TrainerState
from ember.types import PrecisionInput, Stage

log = logging.getLogger(__name__)


class Trainer(TrainerStages):
    """Runs a ``TrainModule``'s training, evaluation and prediction on a chosen strategy.

    Args:
        strategy: "auto", "single", "dp", "ddp", "ddp_spawn", another registered name, or a Strategy.
        accelerator: "auto", "cpu" or "cuda" ("gpu" is an alias of "cuda").
        devices: how many devices (int), which ones (list of indices), or "auto" (1).
        max_epochs: stop after this many epochs; -1 means no epoch limit. Default 1000 when
            neither ``max_epochs`` nor ``max_steps`` is given.
        max_steps: stop after this many optimizer steps (``global_step``); -1 means no limit.
        min_epochs: ``should_stop`` is ignored before this many epochs (default 0; 1 when only
            ``min_steps`` is given, as Lightning).
        min_steps: ``should_stop`` is ignored before this many optimizer steps (None: no minimum).
        max_time: stop after this much training time (timedelta, seconds, ``{"hours": 2}`` or
            "DD:HH:MM:SS"): adds a ``Timer`` checking after every step (unless callbacks hold one).
            With a Timer and no ``max_epochs`` / ``max_steps``, there is no epoch limit.
        accumulate_grad_batches: step the optimizer every k batches; the loss of each batch is
            divided by the size of its window, so a short final window still averages its batches.
        gradient_clip_val: clip gradients to this norm/value before each optimizer step.
        gradient_clip_algorithm: "norm" or "value".
        precision: "32-true", "64-true", "bf16-mixed" or "16-mixed".
        val_check_interval: a fraction of the training epoch, or an int number of batches.
        check_val_every_n_epoch: validate every n epochs; None to validate by batch count only.
        limit_train_batches, limit_val_batches, limit_test_batches, limit_predict_batches: a
            fraction or an int number of batches per epoch (a whole float above 1.0 counts batches).
            ``limit_train_batches=0`` skips training (the sanity check still runs).
        overfit_batches: train and validate on this fraction or number of batches only (replacing
            both limits), with shuffling turned off, to check a model can overfit a little data.
        num_sanity_val_steps: validation batches run before training (-1: all; None: 2).
        log_every_n_steps: how often step metrics go to the loggers (0: never; None: 50).
        fast_dev_run: run n (True: 1) batches of train, validation and test, without loggers or checkpoints
            (a ModelCheckpoint stays in ``trainer.callbacks`` and saves nothing; loggers become a DummyLogger).
        deterministic: ``torch.use_deterministic_algorithms`` (True, False or "warn").
        benchmark: the value for ``torch.backends.cudnn.benchmark`` (None: left as it is, or False
            when ``deterministic`` is True).
        detect_anomaly: run training under ``torch.autograd.set_detect_anomaly``.
        enable_autolog_hparams: hand the module's and datamodule's ``hparams`` to the loggers at fit start.
        default_root_dir: where logs and checkpoints go by default (the working directory).
        callbacks: a Callback or a list of them.
        enable_progress_bar: add the default progress bar (None: True).
        enable_checkpointing: add a default ModelCheckpoint when none is given (None: True).
        logger: True for the default logger, False/None for none, or one or more Logger callbacks.
        enable_model_summary: print a table of the model's layers at fit start.
        reload_dataloaders_every_n_epochs: request the loaders from the module or datamodule again
            every n epochs (0: once per fit).
        profiler: "simple", "advanced", "pytorch" or a ``ember.profilers.Profiler``: times the hooks,
            the step, backward, the optimizer step and fetching batches, and reports at the end of each
            run (None: no profiling, at no cost per step).
        barebones: turn off everything beside the training loop that may take time, to measure the loop's own
            cost: checkpointing, the loggers and ``self.log``, step logging, the progress bar, the model summary
            and the sanity check. Passing an argument that turns one of them on (or ``fast_dev_run``,
            ``detect_anomaly=True``, a ``profiler``) raises a ValueError.
    """

    def __init__(
        self,
        *,
        strategy: str | Strategy = "auto",
        accelerator: str = "auto",
        devices: int | Sequence[int] | str = "auto",
        max_epochs: int | None = None,
        max_steps: int = -1,
        min_epochs: int | None = None,
        min_steps: int | None = None,
        max_time: Any = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = "norm",
        precision: PrecisionInput | None = "32-true",
        val_check_interval: int | float | None = 1.0,
        check_val_every_n_epoch: int | None = 1,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        overfit_batches: int | float = 0.0,
        num_sanity_val_steps: int | None = None,
        log_every_n_steps: int | None = None,
        fast_dev_run: bool | int = False,
        deterministic: bool | str | None = None,
        benchmark: bool | None = None,
        detect_anomaly: bool = False,
        default_root_dir: str | None = None,
        callbacks: Callback | Iterable[Callback] | None = None,
        enable_progress_bar: bool | None = None,
        enable_checkpointing: bool | None = None,
        logger: bool | Logger | Iterable[Logger] | None = True,
        enable_model_summary: bool | None = False,
        reload_dataloaders_every_n_epochs: int = 0,
        enable_autolog_hparams: bool = True,
        profiler: str | Profiler | None = None,
        barebones: bool = False,
        **unknown: Any,
    ) -> None:
        if unknown:
            arguments.reject_unknown(unknown, Trainer.__init__)
        # None stands for the default of these, as in Lightning's signature.
        gradient_clip_algorithm = "norm" if gradient_clip_algorithm is None else gradient_clip_algorithm
        val_check_interval = 1.0 if val_check_interval is None else val_check_interval
        #: Whether everything beside the training loop that may take time is off (``Trainer(barebones=True)``).
        self.barebones: bool = barebones
        switches = arguments.resolve_switches(
            barebones,
            enable_checkpointing=enable_checkpointing,
            enable_progress_bar=enable_progress_bar,
            logger=logger,
            log_every_n_steps=log_every_n_steps,
            enable_model_summary=enable_model_summary,
            num_sanity_val_steps=num_sanity_val_steps,
            fast_dev_run=fast_dev_run,
            detect_anomaly=detect_anomaly,
            profiler=profiler,
        )
        arguments.check_schedule(
            max_epochs=max_epochs,
            max_steps=max_steps,
            min_epochs=min_epochs,
            min_steps=min_steps,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val,
            gradient_clip_algorithm=gradient_clip_algorithm,
            val_check_interval=val_check_interval,
            check_val_every_n_epoch=check_val_every_n_epoch,
            log_every_n_steps=switches.log_every_n_steps,
            num_sanity_val_steps=switches.num_sanity_val_steps,
            reload_dataloaders_every_n_epochs=reload_dataloaders_every_n_epochs,
            fast_dev_run=fast_dev_run,
        )
        self.reload_dataloaders_every_n_epochs = reload_dataloaders_every_n_epochs
        # As Lightning: left None when not given, and set when a fit starts (loops.settle_epoch_limits).
        self.max_epochs: int | None = max_epochs
        self.max_steps = max_steps
        self.min_epochs: int | None = min_epochs
        self.min_steps = min_steps
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.val_check_interval = val_check_interval
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.limit_train_batches = arguments.check_limit("limit_train_batches", limit_train_batches)
        self.limit_val_batches = arguments.check_limit("limit_val_batches", limit_val_batches)
        self.limit_test_batches = arguments.check_limit("limit_test_batches", limit_test_batches)
        self.limit_predict_batches = arguments.check_limit("limit_predict_batches", limit_predict_batches)
        self.overfit_batches = arguments.check_limit("overfit_batches", overfit_batches)
        if self.overfit_batches > 0:  # as Lightning: replaces the train and validation limits
            self.limit_train_batches = self.limit_val_batches = self.overfit_batches
        self.detect_anomaly = bool(detect_anomaly)
        self.enable_autolog_hparams = bool(enable_autolog_hparams)
        self.num_sanity_val_steps = math.inf if switches.num_sanity_val_steps == -1 else switches.num_sanity_val_steps
        self.log_every_n_steps = switches.log_every_n_steps
        logger = switches.logger
        self.default_root_dir = arguments.check_root_dir(default_root_dir)

        # As Lightning: True for 1 (and True), else the number of batches (0 or False: off).
        self.fast_dev_run: bool | int = True if fast_dev_run == 1 else fast_dev_run
        dummy_logger = False
        if self.fast_dev_run:
            n = int(self.fast_dev_run)
            self.limit_train_batches = self.limit_val_batches = n
            self.limit_test_batches = self.limit_predict_batches = n
            self.max_epochs, self.max_steps, self.num_sanity_val_steps = 1, n, 0
            self.val_check_interval, self.check_val_every_n_epoch = 1.0, 1
            # Nothing written, but a module's self.logger.experiment... still runs (Lightning's DummyLogger);
            # a ModelCheckpoint (the default one too, as Lightning) stays, and saves nothing.
            dummy_logger, logger = arguments.wants_loggers(logger), False
            log.info(
                "Running in `fast_dev_run` mode: will run the requested loop using %d batch(es). Logging and "
                "checkpointing is suppressed.",
                n,
            )

        arguments.set_backend_flags(deterministic, benchmark)
        self.profiler: Profiler = arguments.resolve_profiler(profiler)

        self._precision_name = normalize_precision(precision)
        accelerator_name, device_list = arguments.resolve_devices(accelerator, devices)
        self._accelerator = accelerator_for(accelerator_name)
        self.strategy = arguments.resolve_strategy(self, strategy, accelerator_name, device_list)
        precision_plugin = Precision(
            self._precision_name, self.strategy.root_device.type, in_module=self.strategy.precision_in_module
        )
        self._input_dtype = precision_plugin.input_dtype
        #: What a fit carries, as named parts (module, datamodule, callbacks, optimizers and schedulers,
        #: precision, progress, metric accumulators, data position, RNG), each with ``state_dict`` /
        #: ``load_state_dict``: what checkpoints save and restore (``state.py``).
        self.fit_state = FitState(self, self.strategy, precision_plugin, FitData(self, None, None))

        self.callbacks: list[Callback] = arguments.build_callbacks(self, callbacks, switches, max_time)
        self.loggers = [DummyLogger()] if dummy_logger else arguments.build_loggers(self, logger)  # (callbacks too)
        self.callbacks = arguments.checkpoints_last(self.callbacks)

        self.should_stop = False
        self.sanity_checking = False
        self._preemption: PreemptionHandler | None = None  # the fit's stop-signal handler (received_sigterm)
        self.state = TrainerState(self._running_stage)
        self.module: TrainModule | None = None
        self.datamodule: DataModule | None = None
        self._hooks = Hooks(self, self.callbacks, None, self._metrics)
        self._logs = LogWriter(self, self._metrics)
        self._logged_metrics: dict[str, Any] = {}
        #: Epoch-level metrics of the last fit, one dict per epoch.
        self.history: list[dict[str, float]] = []
        self._loop: FitLoop | None = None
        #: Batches per loader of the current validate / test / predict run, and of the sanity check.
        self._eval_batches: dict[str, list[float]] = {}
        self._eval_loaders: dict[str, list[Any]] = {}  # (trainer.test_dataloaders, ...)
        self.num_sanity_val_batches: list[float] = []
        self.ckpt_path: str | None = None
        self._return_predictions = True
        self._verbose = True  # validate / test print their results table
        self._weights_only = True  # how the run's ckpt_path is read (fit / validate / ... weights_only=)

    # ------------------------------------------------------------------ one run, in every process
    def _run(
        self,
        stage: Stage,
        module: TrainModule,
        loaders: tuple[Any, ...],
        datamodule: DataModule | None,
        ckpt_path: str | None,
    ) -> Any:
        """prepare -> setup -> restore -> run -> teardown, for fit, validate, test and predict."""
        try:
            if self.barebones and self.is_global_zero:
                log.info(arguments.BAREBONES_RUN_NOTICE)  # (no progress bar: the run would look stalled)
            path = self._prepare(stage, module, datamodule, ckpt_path)
            if stage == "fit":
                self._fit(module, loaders, path)
                return None
            result = self._evaluate_or_predict(stage, module, loaders[0], path)
            self._logs.finalize("success")  # as a fit's end (and Lightning's): the stage's rows reach the disk
            return result
        except BaseException as exc:
            self._on_exception(exc)
            raise
        finally:
            self._teardown(stage)

    def _prepare(
        self, stage: Stage, module: TrainModule, datamodule: DataModule | None, ckpt_path: str | os.PathLike | None
    ) -> str | None:
        """Attach, join the processes, prepare_data, setup hooks, configure_model; returns the checkpoint
        file to restore, if any."""
        self.module, self.datamodule = module, datamodule
        # As Lightning when a run starts: hyper-parameters that cannot be pickled are dropped, with a warning.
        for source in (module, datamodule):
            if source is not None and source.__dict__.get("_hparams") is not None:
                drop_unpicklable(source.hparams)
        module.trainer = self
        if datamodule is not None:
            datamodule.trainer = self
        # Each fit / validate / test / predict starts from empty metrics, as in Lightning.
        self.fit_state.start_run()
        self._preemption = None
        self.logged_metrics = {}
        extra = module.configure_callbacks() or []
        extra = [extra] if isinstance(extra, Callback) else list(extra)  # one Callback, as Lightning takes it
        if extra:
            types = {type(c) for c in extra}
            self.callbacks = [c for c in self.callbacks if type(c) not in types] + extra
        self.callbacks = arguments.checkpoints_last(self.callbacks)
        for cb in self.callbacks:  # as Lightning: self.log / self.log_dict in a callback log through the module
            if not hasattr(type(cb), "log"):
                cb.log, cb.log_dict = module.log, module.log_dict  # type: ignore[attr-defined]
        self._hooks = Hooks(self, self.callbacks, module, self._metrics)
        self._logs = LogWriter(self, self._metrics)
        self.strategy.setup_environment()
        if self.strategy.local_rank == 0:
            if datamodule is not None:
                datamodule.prepare_data()
            if is_overridden("prepare_data", module, TrainModule):
                module.prepare_data()
        self.strategy.barrier("prepare_data")
        # "last" is resolved before the loggers' and callbacks' setup: a fit continuing a run's
        # last.ckpt continues writing into that run's directory.
        path = (
            locate.resolve(self, ckpt_path, continue_run=True)
            if stage == "fit"
            else locate.resolve(self, ckpt_path)
            if ckpt_path is not None
            else None
        )
        if datamodule is not None:
            datamodule.setup(stage=stage)
        # By keyword, as Lightning: ``def setup(self, stage)`` and ``(self, stage=None)`` both work.
        self._hooks.call("setup", stage=stage)
        if stage == "fit":
            locate.mark_job_runs(self)
        if is_overridden("configure_sharded_model", module, TrainModule):
            arguments.check_sharded_model_hook(module, is_overridden("configure_model", module, TrainModule))
            self._metrics.fx = "configure_sharded_model"
            module.configure_sharded_model()
        if is_overridden("configure_model", module, TrainModule):
            self._metrics.fx = "configure_model"
            module.configure_model()
        # After the loggers' setup: their run folder is the report's default home.
        self.profiler.setup(stage, self.global_rank if self.world_size > 1 else None, self.log_dir)
        return path

    def save_checkpoint(
        self, filepath: str | os.PathLike, weights_only: bool = False, storage_options: BackgroundSave | None = None
    ) -> None:
        """Save the full training state (or only the weights) to ``filepath``, atomically, on rank zero.

        A checkpoint being written in the background (``ModelCheckpoint(async_save=True)``) is waited for
        first; if that write failed, its error is raised here.

        Args:
            filepath: the file to write.
            weights_only: the module's weights and hyper-parameters only (cannot resume a fit).
            storage_options: as Lightning's argument: None (write now), or an
                ``ember.checkpoint.BackgroundSave``, which writes on the strategy's background writer after
                one copy of the state (what ``ModelCheckpoint(async_save=True)`` passes).
        """
        if self.module is None:
            raise RuntimeError("save_checkpoint needs a module: call it during or after trainer.fit(...).")
        contents.save(self.fit_state, self.strategy, filepath, weights_only, storage_options)

    @contextlib.contextmanager
    def init_module(self, empty_init: bool | None = None) -> Iterator[None]:
        """Create the module's tensors where they will run, as Lightning's ``Trainer.init_module``.

        Under this context, layers are created on the strategy's device (``"fsdp"`` with ``empty_init=True``:
        on the meta device, with no memory, each rank then materialising only its own shards), and in
        float64 under ``precision="64-true"``.

        Args:
            empty_init: skip initialising the weights on creation (they are loaded or initialised later); what
                a sharding strategy needs to build a model no device can hold.
        """
        dtype = torch.float64 if self._precision_name == "64-true" else None
        previous = torch.get_default_dtype()
        with self.strategy.tensor_init_context(empty_init):
            if dtype is not None:
                torch.set_default_dtype(dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(previous)

    # ------------------------------------------------------------------ entry points
    def fit(
        self,
        model: TrainModule | None = None,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | None = None,
        weights_only: bool | None = None,
        *,
        module: TrainModule | None = None,
    ) -> None:
        """Train ``module``.

        Args:
            model: the TrainModule to train (``module=`` also works).
            train_dataloaders: a DataLoader (or any iterable of batches).
            val_dataloaders: one loader or a list of them.
            datamodule: a DataModule providing the loaders instead.
            ckpt_path: resume from this checkpoint, or "last" / "best"; "auto": resume from the most
                recent checkpoint when one exists, else start fresh. A restart of a torchrun or SLURM
                job resumes from the job's own latest checkpoint on its own (``ember/checkpoint/auto_resume.py``).
            weights_only: as Lightning's: None or True reads the checkpoint as plain data only; False lets it
                unpickle objects (only for a file you trust).
        """
        # (validation_step is checked once the fit knows whether it validates: Trainer._fit)
        module = self._check_module(self._one_module(model, module, "fit"), ("training_step",))
        self._weights_only = weights_only is not False
        if isinstance(train_dataloaders, DataModule) and datamodule is None:  # Lightning's fit(model, dm)
            train_dataloaders, datamodule = None, train_dataloaders
        if datamodule is not None and (train_dataloaders is not None or val_dataloaders is not None):
            raise ValueError("Pass either dataloaders or a datamodule to fit, not both.")
        self.state.start("fit")
        settle_epoch_limits(self)
        self.strategy.launch(self._run, "fit", module, (train_dataloaders, val_dataloaders), datamodule, ckpt_path)

    def validate(
        self,
        model: TrainModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: DataModule | None = None,
        weights_only: bool | None = None,
        *,
        module: TrainModule | None = None,
    ) -> list[dict[str, float]]:
        """Run ``validation_step`` over the loaders; returns one metric dict per loader, and with ``verbose``
        prints them as a table (on global rank zero), as Lightning."""
        module = self._one_module(model, module, "validate")
        return self._evaluate("validate", module, dataloaders, datamodule, ckpt_path, verbose, weights_only)

    def test(
        self,
        model: TrainModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: DataModule | None = None,
        weights_only: bool | None = None,
        *,
        module: TrainModule | None = None,
    ) -> list[dict[str, float]]:
        """Run ``test_step`` over the loaders; returns one metric dict per loader, and with ``verbose`` prints
        them as a table (on global rank zero), as Lightning."""
        module = self._one_module(model, module, "test")
        return self._evaluate("test", module, dataloaders, datamodule, ckpt_path, verbose, weights_only)

    def predict(
        self,
        model: TrainModule | None = None,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        return_predictions: bool | None = None,
        ckpt_path: str | None = None,
        weights_only: bool | None = None,
        *,
        module: TrainModule | None = None,
    ) -> list[Any] | None:
        """Run ``predict_step``; returns the outputs (a list per loader when there are several), or None
        with ``return_predictions=False``, which keeps no output (for predictions a callback writes out)."""
        module = self._module_for_eval(self._one_module(model, module, "predict"), "predict_step")
        self._weights_only = weights_only is not False
        if isinstance(dataloaders, DataModule) and datamodule is None:  # Lightning's predict(model, dm)
            dataloaders, datamodule = None, dataloaders
        if return_predictions not in (None, True, False):
            raise TypeError(f"return_predictions must be True, False or None, got {return_predictions!r}.")
        self._return_predictions = return_predictions is not False
        self.state.start("predict")
        return self.strategy.launch(self._run, "predict", module, (dataloaders,), datamodule, ckpt_path)

    def _evaluate(
        self,
        stage: Stage,
        module: TrainModule | None,
        dataloaders: Any,
        datamodule: DataModule | None,
        ckpt_path: str | None,
        verbose: bool,
        weights_only: bool | None,
    ) -> list[dict[str, float]]:
        module = self._module_for_eval(module, "validation_step" if stage == "validate" else "test_step")
        self._verbose = bool(verbose)
        self._weights_only = weights_only is not False
        if isinstance(dataloaders, DataModule) and datamodule is None:  # Lightning's validate/test(model, dm)
            dataloaders, datamodule = None, dataloaders
        self.state.start(stage)
        return self.strategy.launch(self._run, stage, module, (dataloaders,), datamodule, ckpt_path)
