"""The Trainer's public state, read (and, for the loggers, assigned) by users and callbacks: progress,
ranks, metrics, optimizers, loggers, the checkpoint and early-stopping callbacks, loaders and batch counts."""

from __future__ import annotations

import math
import signal
from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.early_stopping import EarlyStopping
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.callbacks.progress_bar import ProgressBar
from ember.loggers.file_logger import FileLogger
from ember.loggers.logger import Logger
from ember.module import TrainModule
from ember.trainer.arguments import default_epoch_limits
from ember.trainer.loaders import CombinedBatches
from ember.trainer.predict_record import PredictionRecord
from ember.trainer.states import RunningStage, TrainerFn, TrainerState, TrainerStatus

if TYPE_CHECKING:
    from ember.accelerators import Accelerator
    from ember.callbacks.callback import Callback
    from ember.strategies.strategy import Strategy
    from ember.trainer.loaders import FitData
    from ember.trainer.loops import FitLoop
    from ember.trainer.metrics import MetricCollector
    from ember.trainer.optim import OptimizerState
    from ember.trainer.precision import Precision
    from ember.trainer.preemption import PreemptionHandler
    from ember.trainer.progress import FitProgress
    from ember.trainer.state import FitState


def as_logger_list(value: Any) -> list[Logger]:
    """What ``trainer.logger = ...`` / ``trainer.loggers = ...`` accept: None, one Logger, or an iterable of them."""
    if value is None:
        return []
    loggers = [value] if isinstance(value, Logger) else list(value) if isinstance(value, (list, tuple)) else None
    if loggers is None or not all(isinstance(lg, Logger) for lg in loggers):
        raise TypeError(
            f"trainer.logger / trainer.loggers take None, an ember Logger or a list of them, got "
            f"{value!r}. Build one with ember.loggers.CSVLogger(...) or TensorBoardLogger(...)."
        )
    return loggers


def _one_or_list(loaders: list[Any]) -> Any:
    return loaders[0] if len(loaders) == 1 else loaders or None


# trainer.state.stage from Lightning's flags, in the order they are checked (the sanity check comes first).
_STAGE_FLAGS = (
    ("training", RunningStage.TRAINING),
    ("validating", RunningStage.VALIDATING),
    ("testing", RunningStage.TESTING),
    ("predicting", RunningStage.PREDICTING),
)


class TrainerProperties:
    """Public state of the Trainer (a base class of ``Trainer``; it holds no state of its own)."""

    if TYPE_CHECKING:
        fit_state: FitState
        strategy: Strategy
        state: TrainerState
        _accelerator: Accelerator
        sanity_checking: bool
        module: TrainModule | None
        callbacks: list[Callback]
        default_root_dir: str
        accumulate_grad_batches: int
        max_epochs: int | None
        val_check_interval: int | float
        max_steps: int
        _loggers: list[Logger]
        _logged_metrics: dict[str, Any]
        _loop: FitLoop | None
        _eval_batches: dict[str, list[float]]
        _eval_loaders: dict[str, list[Any]]
        _precision_name: str
        _preemption: PreemptionHandler | None

    # The parts of ``fit_state`` (``state.py``), by the names the trainer package reads them by.
    @property
    def progress(self) -> FitProgress:
        return self.fit_state.progress

    @property
    def _metrics(self) -> MetricCollector:
        return self.fit_state.metrics

    @property
    def _optim(self) -> OptimizerState:
        return self.fit_state.optim

    @property
    def _data(self) -> FitData:
        return self.fit_state.data

    @property
    def _precision(self) -> Precision:
        return self.fit_state.precision

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
    def logged_metrics(self) -> dict[str, Any]:
        """The last value of every key logged with ``logger=True``: what went to the loggers, and, as in
        Lightning, the latest step values even when no write was due (merged on read, not per step)."""
        logged = self._logged_metrics
        for pending in (
            self._metrics.pending_step_logs,
            self._metrics.pending_eval_step_logs,
            self._metrics.epoch_so_far(),
        ):
            if pending:  # as Lightning: the current batch's step values are visible before they are written
                logged.update(pending)
        return logged

    @logged_metrics.setter
    def logged_metrics(self, value: dict[str, Any]) -> None:
        self._logged_metrics = value

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """What the progress bar shows, as floats (as Lightning's); epoch values so far in an epoch-end hook."""
        return self._metrics.progress_bar_floats()

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._optim.optimizers

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        return self._optim.schedulers

    # ------------------------------------------------------------------ loggers (assignable, as Lightning's)
    @property
    def loggers(self) -> list[Logger]:
        return self._loggers

    @loggers.setter
    def loggers(self, value: Any) -> None:
        new = as_logger_list(value)
        old = getattr(self, "_loggers", [])
        # ember's loggers are callbacks too: the old ones stop getting hooks, the new ones start.
        self.callbacks = [c for c in self.callbacks if not any(c is lg for lg in old)]
        self.callbacks.extend(lg for lg in new if not any(c is lg for c in self.callbacks))
        self._loggers = new

    @property
    def logger(self) -> Logger | None:
        return self._loggers[0] if self._loggers else None

    @logger.setter
    def logger(self, value: Logger | None) -> None:
        self.loggers = value

    @property
    def log_dir(self) -> str | None:
        """As Lightning: the first logger's run directory for TensorBoard and CSV loggers, the first
        logger's ``save_dir`` for any other (None without one), ``default_root_dir`` without a logger."""
        if not self._loggers:
            return self.default_root_dir
        first = self._loggers[0]
        return first.log_dir if isinstance(first, FileLogger) else first.save_dir

    # ------------------------------------------------------------------ callbacks found by kind
    @property
    def checkpoint_callbacks(self) -> list[Any]:
        """Every ``ModelCheckpoint`` among the callbacks."""
        return [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> Any:
        """The first ``ModelCheckpoint``, or None."""
        found = self.checkpoint_callbacks
        return found[0] if found else None

    @property
    def early_stopping_callbacks(self) -> list[Any]:
        """Every ``EarlyStopping`` among the callbacks."""
        return [c for c in self.callbacks if isinstance(c, EarlyStopping)]

    @property
    def early_stopping_callback(self) -> Any:
        """The first ``EarlyStopping``, or None."""
        found = self.early_stopping_callbacks
        return found[0] if found else None

    # ------------------------------------------------------------------ the run
    @property
    def precision(self) -> str:
        return self._precision_name

    @property
    def predict_loop(self) -> PredictionRecord:
        """The last (or current) ``predict`` run's outputs and batch indices, under Lightning's names."""
        record = self.__dict__.get("_predict_record")
        if record is None:
            record = self.__dict__["_predict_record"] = PredictionRecord()
        return record

    @property
    def precision_plugin(self) -> Precision:
        """The object that applies ``precision``: autocast, the gradient scaler, the module's dtype."""
        return self._precision

    @property
    def accelerator(self) -> Accelerator:
        """The kind of device the run uses (``CPUAccelerator`` or ``CUDAAccelerator``, ``ember.accelerators``)."""
        return self._accelerator

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """``num_replicas`` and ``rank`` for a ``DistributedSampler`` of this process under ddp / fsdp;
        None where one process reads all the data (single device, dp)."""
        return self.strategy.distributed_sampler_kwargs

    # ------------------------------------------------------------------ what is running (Lightning's names)
    @property
    def training(self) -> bool:
        """In a fit and not in its validation (or sanity check), as Lightning's ``trainer.training``."""
        return self.state == "fitting" and not self.sanity_checking and self._metrics.stage != "validate"

    @property
    def validating(self) -> bool:
        """In ``trainer.validate``, or in a validation inside a fit (not the sanity check)."""
        if self.state == "validating":
            return True
        return self.state == "fitting" and not self.sanity_checking and self._metrics.stage == "validate"

    @property
    def testing(self) -> bool:
        """In ``trainer.test``."""
        return self.state == "testing"

    @property
    def predicting(self) -> bool:
        """In ``trainer.predict``."""
        return self.state == "predicting"

    @property
    def evaluating(self) -> bool:
        """Validating, testing or sanity checking (as Lightning's: not predicting)."""
        return self.validating or self.testing or self.sanity_checking

    @property
    def interrupted(self) -> bool:
        """Whether an exception ended (or is ending) the current or last run: Ctrl-C, a stop signal, an error."""
        return self.state.status == TrainerStatus.INTERRUPTED

    def _running_stage(self) -> RunningStage | None:
        """``trainer.state.stage``: the part of the entry point running now, read from the flags above."""
        if self.sanity_checking:
            return RunningStage.SANITY_CHECKING
        for flag, stage in _STAGE_FLAGS:
            if getattr(self, flag):
                return stage
        return None

    @property
    def received_sigterm(self) -> bool:
        """Whether the current (or last) fit received SIGTERM."""
        handler = self._preemption
        return handler is not None and handler.received == signal.SIGTERM

    # ------------------------------------------------------------------ devices (Lightning's names)
    @property
    def device_ids(self) -> list[int]:
        """The index of each device this process's strategy uses (0 for the CPU), as Lightning's."""
        devices = self.strategy.parallel_devices or [self.strategy.root_device]
        return [device.index or i for i, device in enumerate(devices)]

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)

    @property
    def num_nodes(self) -> int:
        return self.strategy.num_nodes

    @property
    def node_rank(self) -> int:
        return self.strategy.node_rank

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The 16-mixed gradient scaler (None under other precisions)."""
        return self._precision.scaler

    @property
    def progress_bar_callback(self) -> ProgressBar | None:
        """The progress bar among the callbacks, if any."""
        return next((c for c in self.callbacks if isinstance(c, ProgressBar)), None)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on each machine's local rank zero only (Lightning's ``trainer.print``)."""
        if self.local_rank == 0:
            print(*args, **kwargs)

    @property
    def lightning_module(self) -> TrainModule | None:
        return self.module

    @property
    def model(self) -> TrainModule | None:
        """The module being run (ember's strategies keep their wrappers, such as DDP's, to themselves)."""
        return self.module

    @property
    def fit_loop(self) -> FitLoop | None:
        """The running (or last) fit's loop."""
        return self._loop

    @property
    def train_dataloader(self) -> Any:
        """The fit's training loader (None before it is requested): in one process the loader given or
        requested (the sampler ember puts in for an exact mid-epoch resume is its own affair; with
        ``overfit_batches``, the loader with its sampler made sequential), with several processes the one
        each rank iterates, its sampler sharding the data (as Lightning's ``DistributedSampler`` loader)."""
        data = self._data
        if self.world_size == 1 or data.train_loader is None:
            return data.train_given
        loader = data.train_loader
        return loader.combined.iterables if isinstance(loader, CombinedBatches) else loader

    @property
    def _val_from_validate(self) -> bool:
        """Whether the validation loaders to show are ``validate``'s: it is the running or last entry point, or
        it ran after the last fit (a ``test`` or ``predict`` since leaves them as they were)."""
        return self.state.fn == TrainerFn.VALIDATING or self._data.superseded_by_validate

    @property
    def val_dataloaders(self) -> Any:
        """The validation loaders of the run that last set them up, ``fit`` or ``validate`` (one loader, a
        list, or None): a fit's from the time it requests them (see ``FitData``)."""
        if self._val_from_validate:
            return _one_or_list(self._eval_loaders.get("validate", []))
        return _one_or_list(self._data.val_loaders)

    @property
    def test_dataloaders(self) -> Any:
        """The loaders of the running (or last) ``test``: one loader, a list, or None before any."""
        return _one_or_list(self._eval_loaders.get("test", []))

    @property
    def predict_dataloaders(self) -> Any:
        """The loaders of the running (or last) ``predict``: one loader, a list, or None before any."""
        return _one_or_list(self._eval_loaders.get("predict", []))

    @property
    def enable_validation(self) -> bool:
        """Whether fit validates, as Lightning decides it: a validation loader given or defined, a
        ``validation_step``, and ``limit_val_batches`` above 0 (False before a module is attached)."""
        return self.module is not None and self._data.plans_validation

    @property
    def is_last_batch(self) -> bool:
        """Whether the training batch being run is the epoch's last."""
        return self.progress.is_last_batch

    @property
    def num_training_batches(self) -> float:
        """The training batches of an epoch (after ``limit_train_batches``); ``inf`` until a fit has its train
        loader, as Lightning's."""
        data = self._data
        return data.num_training_batches if data.train_loader is not None else math.inf

    @property
    def num_val_batches(self) -> list[float]:
        """The batches to run of each validation loader, of the run that last set them up (``val_dataloaders``)."""
        if self._val_from_validate:
            return self._eval_batches.get("validate", [])
        return self._data.num_val_batches

    @property
    def num_test_batches(self) -> list[float]:
        return self._eval_batches.get("test", [])

    @property
    def num_predict_batches(self) -> list[float]:
        return self._eval_batches.get("predict", [])

    @property
    def val_check_batch(self) -> int | float | None:
        """Training batches between two validations of a fit (Lightning's): an int ``val_check_interval`` itself,
        a fraction of the epoch's batches (at least 1; ``inf`` for a loader without a length); None until a fit
        has its train loader."""
        data = self._data
        if data.train_loader is None:
            return None
        v, n = self.val_check_interval, data.num_training_batches
        if isinstance(v, int):
            return v
        return math.inf if n == math.inf else max(1, int(n * v))

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer steps the fit will take (inf when the loader has no length and no max_steps)."""
        if self.state == "fitting" and self._data.train_loader is None and self.module is not None:
            self._data.request_train()  # read in configure_optimizers: the loader is requested now (as Lightning)
        n = self.num_training_batches
        per_epoch = math.ceil(n / self.accumulate_grad_batches) if n != math.inf else math.inf
        epochs = self.max_epochs
        if epochs is None:  # before a fit settles it: what the fit would take
            epochs = default_epoch_limits(self.max_steps, None, self.callbacks)[0]
        total = per_epoch * epochs if epochs != -1 else math.inf
        return min(total, self.max_steps) if self.max_steps != -1 else total
