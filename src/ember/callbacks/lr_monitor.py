"""LearningRateMonitor: log every optimizer's learning rate (per param group) to the loggers, and put
it in ``trainer.callback_metrics`` so EarlyStopping and ModelCheckpoint can monitor it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.callback import Callback
from ember.callbacks.logger_writes import logger_step, logs_after_this_batch, write_to_loggers

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer


class LearningRateMonitor(Callback):
    """Log the learning rate of each optimizer and param group.

    Names are ``lr-<OptimizerClass>`` (``-1``, ``-2``... for repeated classes, or the scheduler
    config's ``name``), with ``/pg<i>`` per param group when an optimizer has several. Each value
    written also goes into ``trainer.callback_metrics`` (as a tensor), so ``EarlyStopping`` and
    ``ModelCheckpoint`` can monitor ``"lr-SGD"``, as in Lightning.

    Attributes (as Lightning's): ``lrs`` maps each name to every rate written, in order;
    ``last_momentum_values`` / ``last_weight_decay_values`` map ``<name>-momentum`` /
    ``<name>-weight_decay`` to the value written last (None before the first write, or when
    ``log_momentum`` / ``log_weight_decay`` is off).

    Args:
        logging_interval: "step" (at the Trainer's ``log_every_n_steps`` cadence, with the global
            step of the optimizer step that used the rate), "epoch" (at each epoch start), or None:
            "step" when a scheduler steps per step, else "epoch".
        log_momentum: also log ``<name>-momentum`` (SGD momentum, or Adam's beta1).
        log_weight_decay: also log ``<name>-weight_decay``.
    """

    uses_step_outputs = False  # the loop need not build {"loss": ...} for this callback

    def __init__(
        self, logging_interval: str | None = None, log_momentum: bool = False, log_weight_decay: bool = False
    ) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f"logging_interval must be None, 'step' or 'epoch', got {logging_interval!r}.")
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self._interval = "epoch"
        self._names: list[tuple[torch.optim.Optimizer, list[str]]] = []
        self._last_step = -1
        #: The values written last, for tests and notebooks.
        self.last_stats: dict[str, float] = {}
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        if not trainer.loggers:
            raise ValueError(
                "LearningRateMonitor writes to the Trainer's loggers, but it has none (logger=False). "
                "Pass logger=True or a logger, or remove the LearningRateMonitor."
            )
        schedulers = trainer.lr_scheduler_configs
        if self.logging_interval is not None:
            self._interval = self.logging_interval
        else:
            self._interval = "step" if any(c.interval == "step" for c in schedulers) else "epoch"
        named = {id(c.scheduler.optimizer): c.name for c in schedulers if c.name and hasattr(c.scheduler, "optimizer")}
        seen: dict[str, int] = {}
        self._names = []
        for opt in trainer.optimizers:
            base = named.get(id(opt)) or f"lr-{type(opt).__name__}"
            count = seen.get(base, 0)
            seen[base] = count + 1
            if count:
                base = f"{base}-{count}"
            groups = opt.param_groups
            self._names.append((opt, [base if len(groups) == 1 else f"{base}/pg{i + 1}" for i in range(len(groups))]))
        self._last_step = -1
        flat = [name for _, names in self._names for name in names]
        self.lrs = {name: [] for name in flat}
        self.last_momentum_values = {f"{name}-momentum": None for name in flat}
        self.last_weight_decay_values = {f"{name}-weight_decay": None for name in flat}

    def _stats(self) -> dict[str, float]:
        stats: dict[str, float] = {}
        for opt, names in self._names:
            for group, name in zip(opt.param_groups, names):
                stats[name] = float(group["lr"])
                if self.log_momentum:
                    momentum = group.get("momentum", group.get("betas", (0.0,))[0])
                    stats[f"{name}-momentum"] = float(momentum)
                if self.log_weight_decay:
                    stats[f"{name}-weight_decay"] = float(group.get("weight_decay", 0.0))
        return stats

    def _log(self, trainer: Trainer, step: int, stats: dict[str, float] | None = None) -> None:
        if step == self._last_step:
            return
        self._last_step = step
        self.last_stats = stats or self._stats()
        for _, names in self._names:
            for name in names:
                self.lrs[name].append(self.last_stats[name])
                if self.log_momentum:
                    self.last_momentum_values[f"{name}-momentum"] = self.last_stats[f"{name}-momentum"]
                if self.log_weight_decay:
                    self.last_weight_decay_values[f"{name}-weight_decay"] = self.last_stats[f"{name}-weight_decay"]
        device = trainer.strategy.root_device
        trainer.callback_metrics.update({k: torch.tensor(v, device=device) for k, v in self.last_stats.items()})
        write_to_loggers(trainer, self.last_stats, step)

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        # Schedulers step before on_train_batch_end (as in Lightning): read the rates this step uses now.
        if self._interval == "step":
            self._rates_of_this_step = self._stats()

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._interval == "step" and logs_after_this_batch(trainer):
            self._log(trainer, logger_step(trainer), getattr(self, "_rates_of_this_step", None))

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        if self._interval == "epoch":
            self._log(trainer, logger_step(trainer))
