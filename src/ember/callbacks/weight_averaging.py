"""WeightAveraging and EMAWeightAveraging: keep an average of the weights as training goes (Lightning's).

``WeightAveraging`` keeps a ``torch.optim.swa_utils.AveragedModel`` of the module: a copy whose weights
are the running average of the module's, by default the equal-weight mean of every step's weights (SWA),
or whatever ``avg_fn`` / ``multi_avg_fn`` computes. ``EMAWeightAveraging`` is the exponential moving
average, ``decay * average + (1 - decay) * current``. As in Lightning:

- After each optimizer step, and after each training epoch, ``should_update(step_idx=...)`` /
  ``should_update(epoch_idx=...)`` (0-based) decide whether the average takes in the current weights
  (default: after every step). A batch that only accumulates gradients steps no optimizer, so it is never
  asked about.
- Validation runs with the averaged weights (swapped in at its start and out at its end), and when the
  fit ends the module is left holding them.
- A checkpoint holds the averaged weights under ``state_dict`` (what ``load_from_checkpoint`` and
  ``predict(ckpt_path=...)`` load), the weights being trained under ``current_model_state`` and the rest of
  the average's state (how many weights it holds) under ``averaging_state``. Resuming a fit puts each back
  where it was, so a resumed run ends bitwise where the uninterrupted one does.

The average is made when the fit starts (after ``configure_model`` and after the strategy has placed the
module), as a copy of the module without its Trainer; by default it lives on the module's device. Under
``ddp`` every process keeps its own, and they stay equal, as the weights they average are.
"""

from __future__ import annotations

import inspect
import itertools
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

from ember.callbacks.callback import Callback
from ember.checkpoint.weights import match_compiled_keys
from ember.user_frames import user_stacklevel
from ember.utilities.rank_zero import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer
    from ember.types import Stage

# What AveragedModel's constructor takes besides the arguments this callback gives it itself.
_AVERAGED_MODEL_KWARGS = frozenset(inspect.signature(AveragedModel.__init__).parameters) - {
    "self",
    "model",
    "device",
    "use_buffers",
}
_PREFIX = "module."  # AveragedModel holds the copy as its submodule ``module``


class WeightAveraging(Callback):
    """Average the module's weights over training steps (SWA by default); Lightning's ``WeightAveraging``.

    Override :meth:`should_update` to choose after which steps or epochs the average is updated.

    Args:
        device: where the average is kept (``"cpu"`` saves accelerator memory); None: the module's device.
        use_buffers: average the buffers (BatchNorm statistics, ...) too. With False they are copied from
            the module at each update instead, and recomputing BatchNorm statistics for the averaged weights
            (``torch.optim.swa_utils.update_bn``) is left to you.
        **kwargs: passed on to ``AveragedModel``: ``avg_fn`` or ``multi_avg_fn``.

    Raises:
        TypeError: for a keyword ``AveragedModel`` does not take.
    """

    def __init__(self, device: torch.device | str | int | None = None, use_buffers: bool = True, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - _AVERAGED_MODEL_KWARGS)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got {unknown}, which torch.optim.swa_utils.AveragedModel does not take; "
                f"it takes {sorted(_AVERAGED_MODEL_KWARGS)} (and this callback's device and use_buffers)."
            )
        self._device: torch.device | int | None = torch.device(device) if isinstance(device, str) else device
        self._use_buffers = use_buffers
        self._kwargs = kwargs
        self._average_model: AveragedModel | None = None
        # The global step and the epoch of the last update. The step starts at 0, so the first update can
        # follow the first optimizer step (global_step 1); the epoch at -1, so it can follow epoch 0.
        self._latest_update_step = 0
        self._latest_update_epoch = -1
        self._restored: dict[str, torch.Tensor] | None = None  # the average a resume loaded, applied at fit start

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Whether the average takes in the current weights now: asked after each optimizer step with
        ``step_idx`` (the 0-based index of that step) and after each training epoch with ``epoch_idx``
        (0-based). The default updates after every step and never at an epoch's end."""
        return step_idx is not None

    # ------------------------------------------------------------------ the fit
    def setup(self, trainer: Trainer, module: TrainModule, stage: Stage) -> None:
        if stage == "fit":  # a new fit counts its steps from 0; a resume loads the counts after this
            self._latest_update_step, self._latest_update_epoch, self._restored = 0, -1, None

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        device = self._device if self._device is not None else module.device
        # AveragedModel deep-copies the module: without its Trainer, which would be copied along.
        attached = module.trainer
        module.trainer = None
        try:
            self._average_model = AveragedModel(module, device=device, use_buffers=self._use_buffers, **self._kwargs)
        finally:
            module.trainer = attached
        restored, self._restored = self._restored, None
        if restored is not None:
            self._average_model.load_state_dict(restored)

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step counts the optimizer steps taken: it moved on from the last update only if this batch
        # stepped. Its 0-based index is global_step - 1.
        step = trainer.global_step
        if step > self._latest_update_step and self.should_update(step_idx=step - 1):
            self._update(module)
            self._latest_update_step = step

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        epoch = trainer.current_epoch
        if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
            self._update(module)
            self._latest_update_epoch = epoch

    def on_validation_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        if self._average_model is not None:
            self._swap(module)

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._average_model is not None:
            self._swap(module)

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._average_model is None:
            return
        with torch.no_grad():
            for average, current in self._pairs(module):
                current.copy_(average)

    def _update(self, module: TrainModule) -> None:
        assert self._average_model is not None  # made at fit start, before any training hook
        self._average_model.update_parameters(module)

    def _pairs(self, module: TrainModule) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(averaged, current) for every parameter and buffer, in the module's order."""
        assert self._average_model is not None
        copy = self._average_model.module
        averaged = itertools.chain(copy.parameters(), copy.buffers())
        return list(zip(averaged, itertools.chain(module.parameters(), module.buffers()), strict=True))

    def _swap(self, module: TrainModule) -> None:
        with torch.no_grad():
            for average, current in self._pairs(module):
                kept = current.detach().clone()
                current.copy_(average)
                average.copy_(kept)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step, "latest_update_epoch": self._latest_update_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = state_dict["latest_update_step"]
        # (Lightning's checkpoints save the step only.)
        self._latest_update_epoch = state_dict.get("latest_update_epoch", self._latest_update_epoch)

    def on_save_checkpoint(self, trainer: Trainer, module: TrainModule, checkpoint: dict[str, Any]) -> None:
        if self._average_model is None:
            rank_zero_info(
                "WeightAveraging: this checkpoint is saved outside a fit, so it holds no averaging state (after a "
                "fit the module already holds the averaged weights, which are saved as its state_dict)."
            )
            return
        average = self._average_model.state_dict()
        checkpoint["current_model_state"] = checkpoint["state_dict"]
        checkpoint["state_dict"] = {k.removeprefix(_PREFIX): v for k, v in average.items() if k.startswith(_PREFIX)}
        checkpoint["averaging_state"] = {k: v for k, v in average.items() if not k.startswith(_PREFIX)}

    def on_load_checkpoint(self, trainer: Trainer, module: TrainModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state != "fitting":
            rank_zero_warn(
                "WeightAveraging cannot restore its state outside a fit; the module gets the checkpoint's "
                "state_dict (the averaged weights, for a checkpoint saved with WeightAveraging). Remove the "
                "callback to silence this warning.",
                stacklevel=user_stacklevel() + 3,
            )
            return
        if "current_model_state" in checkpoint and "averaging_state" in checkpoint:
            # The module has just loaded ``state_dict``, the average: the average goes to the copy made at fit
            # start, and the module takes back the weights it was training.
            self._restored = {_PREFIX + k: v for k, v in checkpoint["state_dict"].items()}
            self._restored.update(checkpoint["averaging_state"])
            current = match_compiled_keys(module, checkpoint["current_model_state"])
            module.load_state_dict(current, strict=module.strict_loading)
        else:
            rank_zero_warn(
                "WeightAveraging: the checkpoint was not saved with WeightAveraging, so the average starts from "
                "its state_dict, as the module does.",
                stacklevel=user_stacklevel() + 3,
            )


class EMAWeightAveraging(WeightAveraging):
    """The exponential moving average of the weights, ``decay * average + (1 - decay) * current`` (Lightning's).

    Args:
        device: where the average is kept; None: the module's device.
        use_buffers: average the buffers too (see :class:`WeightAveraging`).
        decay: the weight the average keeps at each update, in [0, 1].
        update_every_n_steps: update after every n-th optimizer step (step indices divisible by n; 0: never
            after a step).
        update_starting_at_step: the first step index (0-based) updated after; None: from the first.
        update_starting_at_epoch: also update after each epoch from this one (0-based); None: never after
            an epoch.
        **kwargs: passed on to ``AveragedModel`` (not ``avg_fn``, which is the EMA's).
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        **kwargs: Any,
    ) -> None:
        if (
            isinstance(update_every_n_steps, bool)
            or not isinstance(update_every_n_steps, int)
            or update_every_n_steps < 0
        ):
            raise ValueError(
                f"update_every_n_steps must be an int >= 0 (0: no update after steps), got {update_every_n_steps!r}."
            )
        super().__init__(device=device, use_buffers=use_buffers, **kwargs, avg_fn=get_ema_avg_fn(decay=decay))
        self.decay = decay
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """After step ``step_idx`` when it is a multiple of ``update_every_n_steps`` from
        ``update_starting_at_step`` on; after epoch ``epoch_idx`` from ``update_starting_at_epoch`` on."""
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            if started and self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0:
                return True
        return (
            epoch_idx is not None
            and self.update_starting_at_epoch is not None
            and (epoch_idx >= self.update_starting_at_epoch)
        )
