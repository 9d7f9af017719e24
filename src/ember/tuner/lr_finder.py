"""The learning-rate range test (``Tuner.lr_find``), with Lightning's semantics.

The sweep trains ``num_training`` optimizer steps while the learning rate rises from ``min_lr`` to
``max_lr`` (evenly in log space, "exponential", or linearly), and records the loss of each step,
smoothed by an exponential moving average (``beta=0.98``) with bias correction. It stops early once
the smoothed loss exceeds ``early_stop_threshold`` times the best so far (the loss diverged). The
suggestion is the rate where the smoothed loss falls fastest: the minimum of its gradient with
respect to the rate, skipping the first ``skip_begin`` and last ``skip_end`` points, as Lightning.

Where it differs from Lightning's, cheaply: the schedule reaches ``max_lr`` on the last step and
passes through every point between (Lightning's skips its second point); an infinite or NaN loss
stops the sweep (Lightning's keeps going); and under ddp the loss each step records is the mean
over the ranks, so every rank sees the same curve, stops at the same step and suggests the same rate.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer


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
    one optimizer (a user's schedulers keep stepping, but cannot move the sweep's rate). The loss of
    a window is the mean of its batches' losses; under several ranks, the mean over the ranks too.
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

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"lr_find sweeps one optimizer's learning rate, but configure_optimizers returned "
                f"{len(trainer.optimizers)}. Tune each separately, or skip lr_find."
            )

    def _window_edges(self, trainer: Trainer, batch_idx: int) -> tuple[bool, bool]:
        k = trainer.accumulate_grad_batches
        n = trainer.num_training_batches
        first = batch_idx % k == 0
        last = (batch_idx + 1) % k == 0 or batch_idx + 1 >= n
        return first, last

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        first, _ = self._window_edges(trainer, batch_idx)
        if first:
            lr = self.lrs_planned[min(len(self.lrs), len(self.lrs_planned) - 1)]
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = lr
            self._window = []

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
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
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
