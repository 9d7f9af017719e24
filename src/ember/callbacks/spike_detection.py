"""SpikeDetection: stop training when the loss jumps away from its running mean (Lightning's callback).

After each training batch the loss is compared with the mean of the last ``window`` losses. It is a spike
when it is not an improvement on the previous loss (``mode``) and it differs from that mean by at least
``atol`` and by at least ``rtol`` times the mean (a tolerance left None always holds); with
``finite_only`` a NaN or infinite loss is a spike too. On a spike the batch and the one before it are
added to ``bad_batches``, global rank zero writes that list to ``exclude_batches_path`` (JSON: skip those
batches when you resume), and :class:`TrainingSpikeException` stops the fit. A loss that is no spike joins
the running mean. The first ``warmup`` batches of each epoch are not checked.

Under ``ddp`` every process compares its own loss with its own running mean, as Lightning's does, and a
spike on any process stops every process at the same batch. To that end the processes exchange their
losses each batch (one all-gather of one number each) and every process keeps every process's running
mean, so all of them decide alike without a second collective, and a checkpoint (which rank zero writes)
holds every process's state, from which a resume continues exactly. The mean is computed in float64 on the
CPU (Lightning's in float32 with torchmetrics, which ember does not need).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from ember.callbacks.callback import Callback
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer

_FILE_NAME = "skip_batches.json"


class TrainingSpikeException(RuntimeError):
    """Raised by :class:`SpikeDetection` when the loss spiked: training stops at that batch."""

    def __init__(self, batch_idx: int, *args: Any) -> None:
        super().__init__(f"Training spike detected in batch {batch_idx}", *args)
        self.batch_idx = batch_idx


class SpikeDetection(Callback):
    """Stop training with :class:`TrainingSpikeException` when the loss spikes (Lightning's ``SpikeDetection``).

    Args:
        mode: ``"min"`` (a lower loss is an improvement) or ``"max"``.
        window: how many of the latest losses the running mean takes.
        warmup: how many batches at the start of each epoch go unchecked (they still join the mean).
        atol: a spike differs from the running mean by at least this much; None: any amount.
        rtol: a spike differs from the running mean by at least ``rtol`` times it; None: any amount.
        exclude_batches_path: the JSON file the bad batches are written to (a path not ending in ``.json``
            is a directory that gets ``skip_batches.json``); None: ``skip_batches.json`` in the Trainer's
            ``default_root_dir``.
        finite_only: a NaN or infinite loss is a spike. With False it is no spike, and joins no mean.
    """

    def __init__(
        self,
        mode: Literal["min", "max"] = "min",
        window: int = 10,
        warmup: int = 1,
        atol: float | None = None,
        rtol: float | None = 2.0,
        exclude_batches_path: str | os.PathLike[str] | None = None,
        finite_only: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"SpikeDetection(mode={mode!r}): mode must be 'min' or 'max'.")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"SpikeDetection(window={window!r}): window must be an int >= 1 (losses in the mean).")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"SpikeDetection(warmup={warmup!r}): warmup must be an int >= 0 (unchecked batches).")
        self.mode = mode
        self.window = window
        self.warmup = warmup
        self.atol = atol
        self.rtol = rtol
        self.exclude_batches_path = exclude_batches_path
        self.finite_only = finite_only
        #: The batch indices to skip: each spike adds its batch and the one before (that step may be the culprit).
        self.bad_batches: list[int] = []
        self._last: list[float] = []  # per process: its latest loss that joined the mean (0.0 before any)
        self._windows: list[deque[float]] = []  # per process: its latest ``window`` losses

    @torch.no_grad()
    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if isinstance(outputs, torch.Tensor):
            loss = outputs
        elif isinstance(outputs, Mapping) and "loss" in outputs:
            loss = outputs["loss"]
        else:
            raise TypeError(
                "SpikeDetection reads the loss from what training_step returned: a tensor or a dict with a 'loss' "
                f"tensor, but got {type(outputs).__qualname__}."
            )
        mine = loss.detach().float().mean().reshape(())  # (the mean is the loss itself for a scalar loss)
        losses = [float(v) for v in trainer.strategy.gather_per_rank(mine).reshape(-1).tolist()]
        if len(self._windows) != len(losses):  # the first batch, or a resume under another world size
            self._last = [0.0] * len(losses)
            self._windows = [deque(maxlen=self.window) for _ in losses]
        if batch_idx >= self.warmup and any(self._is_spike(rank, value) for rank, value in enumerate(losses)):
            self._handle_spike(trainer, batch_idx)
        if self.finite_only or all(math.isfinite(v) for v in losses):
            for rank, value in enumerate(losses):
                self._windows[rank].append(value)
                self._last[rank] = value

    def _is_spike(self, rank: int, loss: float) -> bool:
        if self.finite_only and not math.isfinite(loss):
            return True
        change = loss - self._last[rank]
        if change <= 0 if self.mode == "min" else change >= 0:  # as good as the last loss, or better
            return False
        seen = self._windows[rank]
        mean = math.fsum(seen) / len(seen) if seen else math.nan
        diff = abs(loss - mean)
        return (self.atol is None or diff >= abs(self.atol)) and (self.rtol is None or diff >= abs(self.rtol * mean))

    def _handle_spike(self, trainer: Trainer, batch_idx: int) -> None:
        self.bad_batches.extend([batch_idx - 1, batch_idx])
        path = self._path(trainer)
        if trainer.is_global_zero:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                json.dump(self.bad_batches, f, indent=4)
        raise TrainingSpikeException(batch_idx=batch_idx)

    def _path(self, trainer: Trainer) -> str:
        path = self.exclude_batches_path
        path = os.path.join(trainer.default_root_dir, _FILE_NAME) if path is None else os.fspath(path)
        return path if path.endswith(".json") else os.path.join(path, _FILE_NAME)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "bad_batches": list(self.bad_batches),
            "last": list(self._last),
            "windows": [list(w) for w in self._windows],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.bad_batches = list(state_dict.get("bad_batches", []))
        windows = state_dict.get("windows", [])
        if any(len(w) > self.window for w in windows):
            warnings.warn(
                f"SpikeDetection(window={self.window}) resumes from a run with a longer window: the running means "
                "keep their latest losses only.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        self._windows = [deque(w, maxlen=self.window) for w in windows]
        self._last = list(state_dict.get("last", [0.0] * len(windows)))
