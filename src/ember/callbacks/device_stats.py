"""DeviceStatsMonitor: the device's statistics to the loggers around batches, as Lightning's.

On the CPU these are ``psutil``'s memory, CPU and swap percentages (``cpu_vm_percent``,
``cpu_percent``, ``cpu_swap_percent``); on CUDA, ``torch.cuda.memory_stats`` (with the CPU's too when
``cpu_stats=True``). Written at Lightning's cadence (every ``log_every_n_steps``, counted in
optimizer steps in training and in batches in evaluation) under
``DeviceStatsMonitor.<hook>/<stat>``, at the step the loggers get for that batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ember.accelerators import cpu_stats
from ember.callbacks.callback import Callback
from ember.callbacks.logger_writes import logger_step

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer
    from ember.types import Stage


class DeviceStatsMonitor(Callback):
    """Log device statistics at the start and end of training, validation and test batches.

    Args:
        cpu_stats: also log CPU statistics on a GPU (True), never (False), or only when training on
            the CPU (None, the default). CPU statistics need ``psutil``.

    Raises:
        ValueError: at fit without a logger (there would be nowhere to write).
        ModuleNotFoundError: when CPU statistics are wanted and ``psutil`` is missing.
    """

    uses_step_outputs = False

    def __init__(self, cpu_stats: bool | None = None) -> None:
        self._cpu_stats = cpu_stats

    def setup(self, trainer: Trainer, module: TrainModule, stage: Stage) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise ValueError(
                "DeviceStatsMonitor writes to the loggers, but Trainer(logger=False) has none. Give the "
                "Trainer a logger, or remove the callback."
            )
        wants_cpu = self._cpu_stats or (self._cpu_stats is None and trainer.strategy.root_device.type == "cpu")
        if wants_cpu:
            try:
                import psutil  # noqa: F401
            except ModuleNotFoundError as err:
                raise ModuleNotFoundError(
                    "DeviceStatsMonitor needs psutil for CPU statistics: pip install psutil "
                    "(or pass cpu_stats=False on a GPU)."
                ) from err

    def _stats(self, trainer: Trainer) -> dict[str, float]:
        device = trainer.strategy.root_device
        if device.type == "cpu":
            return cpu_stats() if self._cpu_stats is not False else {}
        stats: dict[str, float] = {}
        if device.type == "cuda":
            stats = {k: float(v) for k, v in torch.cuda.memory_stats(device).items()}
        if self._cpu_stats:
            stats.update(cpu_stats())
        return stats

    def _log(self, trainer: Trainer, hook: str, count: int) -> None:
        every = trainer.log_every_n_steps
        if not trainer.is_global_zero or not trainer.loggers or not every:
            return
        if count % every and not trainer.should_stop:
            return
        stats = self._stats(trainer)
        if not stats:
            return
        prefix = f"{type(self).__qualname__}.{hook}/"
        step = logger_step(trainer)
        for lg in trainer.loggers:
            lg.log_metrics({prefix + k: v for k, v in stats.items()}, step)

    def _train_count(self, trainer: Trainer) -> int:
        return logger_step(trainer) + 1  # as Lightning: the optimizer steps this batch's metrics are logged with, +1

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        self._log(trainer, "on_train_batch_start", self._train_count(trainer))

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._log(trainer, "on_train_batch_end", self._train_count(trainer))

    def on_validation_batch_start(
        self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._log(trainer, "on_validation_batch_start", batch_idx + 1)

    def on_validation_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._log(trainer, "on_validation_batch_end", batch_idx + 1)

    def on_test_batch_start(
        self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._log(trainer, "on_test_batch_start", batch_idx + 1)

    def on_test_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._log(trainer, "on_test_batch_end", batch_idx + 1)
