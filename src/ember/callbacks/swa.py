"""StochasticWeightAveraging: average the weights of the last epochs, as Lightning's callback.

Stochastic Weight Averaging (Izmailov et al., 2018) keeps a running mean of the weights over the
last epochs of training, with the learning rate annealed to a constant (``SWALR``), and ends with
that mean. The schedule is Lightning's, epoch by epoch:

- ``swa_epoch_start`` (an int, 1-based; or a fraction of ``max_epochs``) picks the first SWA epoch.
  At its start the optimizer's scheduler is swapped for ``torch.optim.swa_utils.SWALR`` (stepped once
  per epoch, saved with the other schedulers in ``lr_schedulers``), and at the start of every SWA
  epoch the current weights are added to the running mean. As in Lightning, the last epoch's own
  training is therefore not part of the mean.
- At the end of the fit the mean is copied into the module. A module with BatchNorm layers then gets
  its running statistics recomputed for those weights, with one pass over the train loader through
  ``training_step`` without gradients (as the extra epoch Lightning runs for it; here it is a pass
  inside ``on_train_end``, so no optimizer step, epoch or checkpoint is added). Under ``ddp`` the
  statistics are averaged across processes, so every rank ends with the same module.

The mean is kept as one tensor per parameter on ``device``, not as a copy of the module: a
``TrainModule`` holds its trainer and loaders, which a deep copy would drag along. A checkpoint holds
the mean, how many weights it averages, the last epoch added and ``SWALR``'s state, so a resume
(mid-epoch too) continues the same mean and the same learning rates.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.swa_utils import SWALR

from ember.callbacks.callback import Callback
from ember.types import SchedulerConfig
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer

log = logging.getLogger(__name__)

#: ``avg_fn(averaged, current, num_averaged) -> new averaged``, as ``torch.optim.swa_utils.AveragedModel``'s.
AvgFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


class StochasticWeightAveraging(Callback):
    """Average the weights of the last epochs (Lightning's ``StochasticWeightAveraging``, same arguments).

    Args:
        swa_lrs: the learning rate SWA anneals to: one number for every parameter group of the
            optimizer, or a list with one per group.
        swa_epoch_start: the first SWA epoch: an int >= 1 (the ``swa_epoch_start``-th epoch), or a float
            in [0, 1], the epoch ``int(swa_epoch_start * max_epochs)``.
        annealing_epochs: how many epochs ``SWALR`` takes to reach ``swa_lrs``.
        annealing_strategy: ``"cos"`` or ``"linear"`` annealing.
        avg_fn: how a new weight joins the mean, ``avg_fn(averaged, current, num_averaged)``; default:
            the equally weighted running mean.
        device: where the mean is kept (default the CPU); None keeps it on the module's device.

    Only one optimizer, and at most one LR scheduler (which SWA replaces), are supported, as in
    Lightning; the schedule counts epochs.
    """

    def __init__(
        self,
        swa_lrs: float | list[float],
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: Literal["cos", "linear"] = "cos",
        avg_fn: AvgFn | None = None,
        device: torch.device | str | None = torch.device("cpu"),  # noqa: B008 (Lightning's default)
    ) -> None:
        if isinstance(swa_epoch_start, bool) or not isinstance(swa_epoch_start, (int, float)):
            raise TypeError(f"swa_epoch_start must be an int >= 1 or a float in [0, 1], got {swa_epoch_start!r}.")
        if isinstance(swa_epoch_start, int) and swa_epoch_start < 1:
            raise ValueError(
                f"swa_epoch_start={swa_epoch_start}: an int counts epochs from 1 (1 starts SWA with the first "
                "epoch). Pass an int >= 1, or a float in [0, 1] for a fraction of max_epochs."
            )
        if isinstance(swa_epoch_start, float) and not 0 <= swa_epoch_start <= 1:
            raise ValueError(
                f"swa_epoch_start={swa_epoch_start}: a float is a fraction of max_epochs and must be in [0, 1]; "
                "pass an int to name the epoch."
            )
        lrs = swa_lrs if isinstance(swa_lrs, (list, tuple)) else [swa_lrs]
        if not lrs or not all(_positive(lr) for lr in lrs):
            raise ValueError(
                f"swa_lrs must be a positive number or a list of positive numbers (one per parameter group), "
                f"got {swa_lrs!r}."
            )
        if isinstance(annealing_epochs, bool) or not isinstance(annealing_epochs, int) or annealing_epochs < 0:
            raise ValueError(f"annealing_epochs must be an int >= 0, got {annealing_epochs!r}.")
        if annealing_strategy not in ("cos", "linear"):
            raise ValueError(f"annealing_strategy must be 'cos' or 'linear', got {annealing_strategy!r}.")
        if avg_fn is not None and not callable(avg_fn):
            raise TypeError(
                f"avg_fn must be a function avg_fn(averaged, current, num_averaged), got {type(avg_fn).__name__}."
            )
        if device is not None and not isinstance(device, (torch.device, str)):
            raise TypeError(f"device must be a torch.device, a str or None, got {device!r}.")
        self._swa_lrs = [float(lr) for lr in lrs] if isinstance(swa_lrs, (list, tuple)) else float(swa_lrs)
        self._swa_epoch_start = swa_epoch_start
        self._annealing_epochs = annealing_epochs
        self._annealing_strategy = annealing_strategy
        self._avg_fn: AvgFn = avg_fn or self.avg_fn
        self._device = torch.device(device) if device is not None else None
        #: How many weights the mean holds (a tensor, as Lightning's), None before SWA starts.
        self.n_averaged: Tensor | None = None
        #: BatchNorm momenta kept while the averaged weights' statistics are recomputed (Lightning's name).
        self.momenta: dict[nn.Module, float | None] = {}
        self._average: dict[str, Tensor] | None = None  # parameter name -> its running mean
        self._swa_scheduler: SWALR | None = None
        self._latest_update_epoch = -1
        self._max_epochs = -1
        self._start = 0  # the first SWA epoch, 0-based (resolved at fit start)
        self._contains_batch_norm = False
        self._restored: dict[str, Any] | None = None  # state loaded from a checkpoint, applied at fit start

    # ------------------------------------------------------------------ the schedule
    @property
    def swa_start(self) -> int:
        """The first SWA epoch, 0-based."""
        return self._start

    @property
    def swa_end(self) -> float:
        """The last SWA epoch, 0-based (the fit's last epoch; infinite with ``max_epochs=-1``)."""
        return math.inf if self._max_epochs == -1 else self._max_epochs - 1

    @staticmethod
    def pl_module_contains_batch_norm(pl_module: nn.Module) -> bool:
        return any(isinstance(m, _BatchNorm) for m in pl_module.modules())

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"StochasticWeightAveraging works with one optimizer; configure_optimizers returned "
                f"{len(trainer.optimizers)}."
            )
        if len(trainer.lr_scheduler_configs) > 1:
            raise ValueError(
                f"StochasticWeightAveraging replaces the LR scheduler with SWALR, so it supports at most one; "
                f"configure_optimizers returned {len(trainer.lr_scheduler_configs)}."
            )
        max_epochs = trainer.max_epochs if trainer.max_epochs is not None else -1
        start = self._swa_epoch_start
        if isinstance(start, float):
            if max_epochs == -1:
                raise ValueError(
                    f"StochasticWeightAveraging(swa_epoch_start={start}) is a fraction of max_epochs, but "
                    "max_epochs=-1 (no limit). Pass swa_epoch_start as an int epoch."
                )
            start = int(max_epochs * start)
        self._start = max(start - 1, 0)
        self._max_epochs = max_epochs
        if self._start > self.swa_end:
            raise ValueError(
                f"StochasticWeightAveraging would start at epoch {self._start + 1} (swa_epoch_start="
                f"{self._swa_epoch_start!r}) but the fit has max_epochs={max_epochs}, so no weight would be "
                "averaged. Lower swa_epoch_start or raise max_epochs."
            )
        self._contains_batch_norm = self.pl_module_contains_batch_norm(module)
        self._average = None
        self._swa_scheduler = None
        self.n_averaged = None
        self._latest_update_epoch = -1
        restored, self._restored = self._restored, None
        if restored is not None:
            self._latest_update_epoch = restored["latest_update_epoch"]
            if restored["average_model_state"] is not None:
                self._average = self._new_average(module)
                self._check_and_load_average(restored["average_model_state"])
            if restored["scheduler_state"] is not None:
                # SWA had started: SWALR takes the scheduler's place now, so the checkpoint's scheduler state
                # (SWALR's) is restored into it with the optimizer's, right after this hook.
                self._start_swa(trainer, module, restored_n=restored["n_averaged"])

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        epoch = trainer.current_epoch
        if not self.swa_start <= epoch <= self.swa_end:
            return
        if self._swa_scheduler is None:
            self._start_swa(trainer, module, restored_n=0)
        if epoch > self._latest_update_epoch:
            assert self._average is not None and self.n_averaged is not None
            self.update_average(module)
            self._latest_update_epoch = epoch

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        # As Lightning: the mean replaces the weights when the fit ran to its last epoch (or has no last
        # epoch); a fit stopped before then (early stopping, max_steps) keeps its own weights.
        finished = self._max_epochs == -1 or trainer.current_epoch - 1 == self.swa_end
        if not finished or self._average is None or not self.n_averaged:
            return
        self.transfer_weights(self._average, module)
        if self._contains_batch_norm:
            self._update_batch_norm(trainer, module)

    # ------------------------------------------------------------------ the parts
    def _new_average(self, module: TrainModule) -> dict[str, Tensor]:
        device = self._device or module.device
        return {name: p.detach().to(device, copy=True) for name, p in module.named_parameters()}

    def _start_swa(self, trainer: Trainer, module: TrainModule, restored_n: int) -> None:
        optimizer = trainer.optimizers[0]
        groups = optimizer.param_groups
        lrs = self._swa_lrs if isinstance(self._swa_lrs, list) else [self._swa_lrs] * len(groups)
        if len(lrs) != len(groups):
            raise ValueError(
                f"StochasticWeightAveraging got {len(lrs)} swa_lrs but the optimizer has {len(groups)} parameter "
                "groups: pass one learning rate per group, or a single number for all of them."
            )
        for lr, group in zip(lrs, groups):
            group["initial_lr"] = lr
        # Lightning's arguments, so the learning rates match its run epoch for epoch.
        self._swa_scheduler = SWALR(
            optimizer,
            swa_lr=lrs,  # type: ignore[arg-type]  # (a list, one per group, is accepted: torch's annotation is narrower)
            anneal_epochs=self._annealing_epochs,
            anneal_strategy=self._annealing_strategy,
            last_epoch=self._max_epochs if self._annealing_strategy == "cos" else -1,
        )
        config = SchedulerConfig(self._swa_scheduler, interval="epoch", frequency=1)
        configs = trainer.lr_scheduler_configs
        if configs:
            old = configs[0]
            if old.interval != "epoch" or old.frequency != 1:
                warnings.warn(f"SWA is currently only supported every epoch. Found {old}", stacklevel=user_stacklevel())
            if trainer.is_global_zero:
                log.info(
                    "Swapping scheduler `%s` for `%s`", type(old.scheduler).__name__, type(self._swa_scheduler).__name__
                )
            configs[0] = config
        else:
            configs.append(config)
        if self._average is None:
            self._average = self._new_average(module)
        self.n_averaged = torch.tensor(restored_n, dtype=torch.long)

    def update_average(self, module: TrainModule) -> None:
        """Add the module's current weights to the mean."""
        assert self._average is not None and self.n_averaged is not None
        for name, p in module.named_parameters():
            avg = self._average[name]
            current = p.detach().to(avg.device)
            avg.copy_(current if self.n_averaged == 0 else self._avg_fn(avg, current, self.n_averaged.to(avg.device)))
        self.n_averaged += 1

    @staticmethod
    def avg_fn(averaged_model_parameter: Tensor, model_parameter: Tensor, num_averaged: Tensor) -> Tensor:
        """The equally weighted running mean (``torch.optim.swa_utils.AveragedModel``'s default)."""
        return averaged_model_parameter + (model_parameter - averaged_model_parameter) / (num_averaged + 1)

    @staticmethod
    def update_parameters(average_model: nn.Module, model: nn.Module, n_averaged: Tensor, avg_fn: AvgFn) -> None:
        """Lightning's static helper: fold ``model``'s parameters into ``average_model``'s (the mean of
        ``n_averaged`` models so far; the first model is copied) and count it (``n_averaged`` grows in place)."""
        for averaged, current in zip(average_model.parameters(), model.parameters(), strict=True):
            target = averaged.detach()
            value = current.detach().to(target.device)
            target.copy_(value if n_averaged == 0 else avg_fn(target, value, n_averaged.to(target.device)))
        n_averaged += 1

    def reset_batch_norm_and_save_state(self, pl_module: nn.Module) -> None:
        """Before recomputing BatchNorm statistics for the averaged weights: every BatchNorm's running
        statistics in ``pl_module`` reset (mean 0, variance 1, no batches counted) and its momentum kept in
        ``momenta`` and set to None (a cumulative mean over the pass), as Lightning's (and ``swa_utils.update_bn``)."""
        self.momenta = {}
        for bn in pl_module.modules():
            if isinstance(bn, _BatchNorm):
                bn.reset_running_stats()
                self.momenta[bn] = bn.momentum
                bn.momentum = None

    def reset_momenta(self) -> None:
        """Give each BatchNorm the momentum ``reset_batch_norm_and_save_state`` kept."""
        for bn, momentum in self.momenta.items():
            setattr(bn, "momentum", momentum)  # noqa: B010 (nn.Module's typing of attributes: a float here)

    @staticmethod
    def transfer_weights(average: dict[str, Tensor], module: nn.Module) -> None:
        """Copy the mean into ``module``'s parameters."""
        for name, p in module.named_parameters():
            p.detach().copy_(average[name].to(p.device))

    def _update_batch_norm(self, trainer: Trainer, module: TrainModule) -> None:
        """Recompute BatchNorm's running statistics for the averaged weights (``swa_utils.update_bn``'s way:
        reset, cumulative average over one pass, momenta put back), running batches through ``training_step``."""
        bns = [m for m in module.modules() if isinstance(m, _BatchNorm)]
        self.reset_batch_norm_and_save_state(pl_module=module)
        was_training = module.training
        module.train()
        device = trainer.strategy.root_device
        limit = trainer.num_training_batches
        try:
            with torch.no_grad():
                for batch_idx, batch in enumerate(trainer.train_dataloader):
                    if batch_idx >= limit:
                        break
                    batch = module.on_before_batch_transfer(batch, 0)
                    batch = module.transfer_batch_to_device(batch, device, 0)
                    batch = module.on_after_batch_transfer(batch, 0)
                    module.training_step(batch, batch_idx)
        finally:
            self.reset_momenta()
            module.train(was_training)
        if trainer.strategy.world_size > 1:  # every rank saw its own shard: agree on the mean of their statistics
            for bn in bns:
                for name in ("running_mean", "running_var"):
                    buffer = getattr(bn, name)
                    if buffer is not None:
                        buffer.copy_(trainer.strategy.reduce(buffer.clone(), "mean"))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "n_averaged": 0 if self.n_averaged is None else int(self.n_averaged.item()),
            "latest_update_epoch": self._latest_update_epoch,
            "scheduler_state": None if self._swa_scheduler is None else self._swa_scheduler.state_dict(),
            "average_model_state": None
            if self._average is None
            else {k: v.detach().clone() for k, v in self._average.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        keys = {"n_averaged", "latest_update_epoch", "scheduler_state", "average_model_state"}
        if not isinstance(state_dict, dict) or not keys <= set(state_dict):
            found = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"StochasticWeightAveraging's saved state needs the keys {sorted(keys)}; got {found}.")
        self._restored = dict(state_dict)

    def _check_and_load_average(self, saved: dict[str, Tensor]) -> None:
        assert self._average is not None
        if set(saved) != set(self._average):
            missing, extra = sorted(set(self._average) - set(saved)), sorted(set(saved) - set(self._average))
            raise ValueError(
                f"The checkpoint's StochasticWeightAveraging mean does not match the module's parameters "
                f"(missing: {missing}, unexpected: {extra}). Resume with the module that wrote it."
            )
        for name, avg in self._average.items():
            if saved[name].shape != avg.shape:
                raise ValueError(
                    f"The checkpoint's StochasticWeightAveraging mean of {name!r} has shape "
                    f"{tuple(saved[name].shape)}, the parameter {tuple(avg.shape)}."
                )
            avg.copy_(saved[name])
