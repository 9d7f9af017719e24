"""The learning-rate range test (``Tuner.lr_find``), with Lightning's semantics.

The sweep trains ``num_training`` optimizer steps while the learning rate rises from ``min_lr`` to
``max_lr`` (evenly in log space, "exponential", or linearly), and records the loss of each step,
smoothed by an exponential moving average (``beta=0.98``) with bias correction. It stops early once
the smoothed loss exceeds ``early_stop_threshold`` times the best so far (the loss diverged). The
suggestion is the rate where the smoothed loss falls fastest: the minimum of its gradient with
respect to the rate, skipping the first ``skip_begin`` and last ``skip_end`` points, as Lightning.
The sweep's schedule alone sets the rate: the user's LR schedulers are set aside while it runs and
given back afterwards in the state it found them in (``LRSweep``), so the curve and the suggestion
are the same with or without them.

Where it differs from Lightning's, cheaply: the schedule reaches ``max_lr`` on the last step and
passes through every point between (Lightning's skips its second point); an infinite or NaN loss
stops the sweep (Lightning's keeps going); and under ddp the loss each step records is the mean
over the ranks, so every rank sees the same curve, stops at the same step and suggests the same rate.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.callback import Callback
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer
    from ember.types import SchedulerConfig


class LRFinder:
    """What ``Tuner.lr_find`` returns: the sweep's ``results`` (``{"lr": [...], "loss": [...]}``, one
    entry per optimizer step, the loss smoothed), ``suggestion()`` and ``plot()``.

    Args:
        mode: "exponential" or "linear": how the rate rose.
        lr_min, lr_max: the sweep's bounds.
        num_training: the steps it was to take (fewer when it stopped early).
    """

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int) -> None:
        self.mode, self.lr_min, self.lr_max, self.num_training = mode, lr_min, lr_max, num_training
        self.results: dict[str, list[float]] = {"lr": [], "loss": []}
        self._optimal_idx: int | None = None

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The rate at the steepest fall of the smoothed loss (``torch.gradient`` with respect to the
        rate), ignoring the first ``skip_begin`` and the last ``skip_end`` points and any non-finite
        loss; None (with a warning) when fewer than two points are left."""
        lrs_all, losses_all = self.results["lr"], self.results["loss"]
        end = len(losses_all) - skip_end if skip_end else len(losses_all)
        idx = [i for i in range(skip_begin, end) if math.isfinite(losses_all[i])]
        if len(idx) < 2:
            import warnings

            warnings.warn(
                f"lr_find has too few points for a suggestion ({len(losses_all)} recorded, "
                f"skip_begin={skip_begin}, skip_end={skip_end}): raise num_training, or give it more "
                "training batches (max_epochs, limit_train_batches).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
            self._optimal_idx = None
            return None
        losses = torch.tensor([losses_all[i] for i in idx], dtype=torch.float64)
        lrs = torch.tensor([lrs_all[i] for i in idx], dtype=torch.float64)
        gradients = torch.gradient(losses, spacing=[lrs])[0]
        self._optimal_idx = idx[int(torch.argmin(gradients))]
        return lrs_all[self._optimal_idx]

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """The loss against the rate (log scale for "exponential"), as a matplotlib figure; with
        ``suggest``, the suggestion is marked in red. Needs matplotlib (``pip install ember[plot]``)."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise ImportError("LRFinder.plot needs matplotlib: pip install 'ember[plot]' (or matplotlib).") from err
        lrs, losses = self.results["lr"], self.results["loss"]
        if ax is None:
            fig, ax = plt.subplots()
        else:
            fig = ax.figure
        ax.plot(lrs, losses)
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest and self.suggestion() is not None and self._optimal_idx is not None:
            i = self._optimal_idx
            ax.plot(lrs[i], losses[i], markersize=10, marker="o", color="red")
        if show:
            plt.show()
        return fig


def schedule(mode: str, lr_min: float, lr_max: float, n: int) -> list[float]:
    """The rate of each of the ``n`` steps: from ``lr_min`` to ``lr_max`` inclusive."""
    if n == 1:
        return [lr_min]
    if mode == "exponential":
        return [lr_min * (lr_max / lr_min) ** (i / (n - 1)) for i in range(n)]
    return [lr_min + (lr_max - lr_min) * i / (n - 1) for i in range(n)]


class LRSweep(Callback):
    """The sweep's only callback: sets each optimizer step's rate, records its (smoothed) loss, and
    asks the fit to stop when the loss diverges.

    Rates are set before each accumulation window's first batch, on every parameter group of the
    one optimizer, and again just before the optimizer steps. The rate each point records is the
    planned one. The loss of a window is the mean of its batches' losses; under several ranks, the
    mean over the ranks too.

    The user's LR schedulers would move the rate (a step-interval one between the optimizer step and
    the point's record, an epoch-interval one at each epoch's end) and could not be stepped anyway
    (a ReduceLROnPlateau monitoring a validation metric finds none: the sweep does not validate). So,
    as Lightning's sweep, it sets them aside once ``configure_optimizers`` has run (``on_fit_start``)
    and ``give_back`` puts them back afterwards. In manual optimization they stay, for the module's
    ``lr_schedulers()`` steps them itself, and the rate set before each optimizer step overrides what
    they set. Either way ``give_back`` loads the optimizer's and the schedulers' states as they were
    when the sweep began, so objects that outlive one ``configure_optimizers`` call (built once and
    returned again) start the real fit as if no sweep had run.
    """

    monitors_metrics = False

    def __init__(self, lrs: list[float], early_stop_threshold: float | None, beta: float = 0.98) -> None:
        self.lrs_planned = lrs
        self.early_stop_threshold = early_stop_threshold
        self.beta = beta
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self._avg = 0.0
        self._best = math.inf
        self._window: list[float] = []
        self._rate = lrs[0]
        self._kept: _Kept | None = None

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"lr_find sweeps one optimizer's learning rate, but configure_optimizers returned "
                f"{len(trainer.optimizers)}. Tune each separately, or skip lr_find."
            )
        configs = trainer.lr_scheduler_configs
        self._kept = _Kept(trainer.optimizers[0], configs)
        if module.automatic_optimization:  # the loop steps them: out of its list for the sweep
            configs.clear()

    def give_back(self) -> None:
        """Put the user's schedulers back in the fit's list, and the optimizer's and schedulers' states
        as they were when the sweep began (nothing to do when the sweep's fit never started)."""
        if self._kept is not None:
            self._kept.restore()
            self._kept = None

    def _window_edges(self, trainer: Trainer, batch_idx: int) -> tuple[bool, bool]:
        k = trainer.accumulate_grad_batches
        n = trainer.num_training_batches
        first = batch_idx % k == 0
        last = (batch_idx + 1) % k == 0 or batch_idx + 1 >= n
        return first, last

    def _set_rate(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            group["lr"] = self._rate

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        first, _ = self._window_edges(trainer, batch_idx)
        if first:
            self._rate = self.lrs_planned[min(len(self.lrs), len(self.lrs_planned) - 1)]
            self._set_rate(trainer.optimizers[0])
            self._window = []

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainModule, optimizer: torch.optim.Optimizer) -> None:
        # Again here: a scheduler a manual training_step steps before opt.step() must not move the rate.
        self._set_rate(optimizer)

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):  # (None: training_step skipped the batch)
            self._window.append(float(loss.detach()))
        _, last = self._window_edges(trainer, batch_idx)
        if not last:
            return
        value = torch.tensor(sum(self._window) / len(self._window) if self._window else math.nan, dtype=torch.float64)
        if trainer.world_size > 1:  # one curve for all ranks: they stop together
            value = trainer.strategy.reduce(value, "mean")
        current = float(value)
        self.lrs.append(self._rate)
        if not math.isfinite(current):
            self.losses.append(math.nan)  # left out of the suggestion
            if self._window and self.early_stop_threshold is not None:
                trainer.should_stop = True  # an infinite or NaN loss: diverged
            return
        self._avg = self.beta * self._avg + (1 - self.beta) * current
        steps = sum(1 for x in self.losses if math.isfinite(x)) + 1
        # Lightning's bias correction, one step ahead of the textbook's (beta ** steps): it damps the
        # first points, where the rates are tiny and a noise-level dip would otherwise be the
        # steepest fall with respect to the rate.
        smoothed = self._avg / (1 - self.beta ** (steps + 1))
        if self.early_stop_threshold is not None and steps > 1 and smoothed > self.early_stop_threshold * self._best:
            trainer.should_stop = True
        self._best = min(self._best, smoothed)
        self.losses.append(smoothed)


class _Kept:
    """The fit's optimizer and LR schedulers as the sweep found them: copies of their states (an
    optimizer's ``state_dict`` holds its live tensors, which the sweep's steps change in place), and
    the fit's list of scheduler configs with its entries."""

    def __init__(self, optimizer: torch.optim.Optimizer, configs: list[SchedulerConfig]) -> None:
        self.optimizer = optimizer
        self.optimizer_state = copy.deepcopy(optimizer.state_dict())
        self.configs = configs
        self.entries = list(configs)
        self.scheduler_states = [copy.deepcopy(c.scheduler.state_dict()) for c in configs]

    def restore(self) -> None:
        self.configs[:] = self.entries
        for config, state in zip(self.entries, self.scheduler_states):
            config.scheduler.load_state_dict(state)
        self.optimizer.load_state_dict(self.optimizer_state)
