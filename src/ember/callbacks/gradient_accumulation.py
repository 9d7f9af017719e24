"""GradientAccumulationScheduler: a different ``accumulate_grad_batches`` per epoch, as Lightning's.

The callback sets ``trainer.accumulate_grad_batches`` when an epoch starts, and the fit loop reads
it once per epoch, before the epoch's first batch. It also sets it when training starts, because a
fit resumed in the middle of an epoch does not run ``on_train_epoch_start`` for that epoch: the
resumed windows then have the size the interrupted run used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer


class GradientAccumulationScheduler(Callback):
    """Accumulate gradients over ``scheduling[e]`` batches from epoch ``e`` (0-based) on.

    Args:
        scheduling: ``{epoch: accumulation_factor}``; epochs before the smallest key accumulate 1
            batch (``{4: 2}``: one batch per step for epochs 0-3, two from epoch 4).

    Raises:
        TypeError: if ``scheduling`` is empty or not a dict.
        ValueError: for an epoch that is not an int >= 0 or a factor that is not an int >= 1.

    Example::

        trainer = ember.Trainer(callbacks=[GradientAccumulationScheduler({0: 8, 4: 4, 8: 1})])
    """

    def __init__(self, scheduling: dict[int, int]) -> None:
        if not isinstance(scheduling, dict) or not scheduling:
            raise TypeError(f"scheduling must be a non-empty dict {{epoch: accumulation_factor}}, got {scheduling!r}.")
        if any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in scheduling):
            raise ValueError(f"scheduling's keys are epochs: ints >= 0. Got {list(scheduling)}.")
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in scheduling.values()):
            raise ValueError(
                f"scheduling's values are accumulation factors: ints >= 1. Got {list(scheduling.values())}."
            )
        self.scheduling = dict(scheduling)
        if min(self.scheduling) != 0:  # as Lightning: epochs before the first key accumulate one batch
            self.scheduling[0] = 1
        self.epochs = sorted(self.scheduling)
        self._set: int | None = None  # the factor this callback last put on the trainer

    def going_to_accumulate_grad_batches(self) -> bool:
        """Whether any epoch accumulates more than one batch."""
        return any(v > 1 for v in self.scheduling.values())

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        """The factor for ``epoch``: the value of the largest key <= ``epoch``."""
        return self.scheduling[max(e for e in self.epochs if e <= epoch)]

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        if not module.automatic_optimization:
            raise RuntimeError(
                "GradientAccumulationScheduler changes automatic optimization's accumulation; with "
                "automatic_optimization=False, accumulate in training_step yourself, or remove the "
                "callback."
            )
        if trainer.accumulate_grad_batches not in (1, self._set):
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and a "
                "GradientAccumulationScheduler both set the accumulation: remove one of them."
            )
        self._apply(trainer)

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        self._apply(trainer)

    def _apply(self, trainer: Trainer) -> None:
        self._set = self.get_accumulate_grad_batches(trainer.current_epoch)
        trainer.accumulate_grad_batches = self._set
