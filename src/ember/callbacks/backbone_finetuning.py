"""BackboneFinetuning: train the head first, then the module's ``backbone`` too, with its own
learning rate that grows towards the head's, as Lightning's."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.nn import Module
from torch.optim import Optimizer

from ember.callbacks.finetuning import BaseFinetuning

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer

log = logging.getLogger(__name__)


def multiplicative(epoch: int) -> float:
    """The default growth of the backbone's learning rate: doubled every epoch."""
    return 2.0


class BackboneFinetuning(BaseFinetuning):
    """Freeze ``module.backbone`` until ``unfreeze_backbone_at_epoch``, then train it too.

    At that epoch the backbone joins the optimizer as a new parameter group with learning rate
    ``backbone_initial_lr`` (default: the first group's times ``backbone_initial_ratio_lr``); from
    the next epoch on, that rate is multiplied by ``lambda_func(epoch + 1)`` at every epoch start,
    and with ``should_align`` never exceeds the first group's.

    Args:
        unfreeze_backbone_at_epoch: the epoch (0-based) at which the backbone starts training.
        lambda_func: the factor applied to the backbone's learning rate each later epoch.
        backbone_initial_ratio_lr: initial backbone rate as a fraction of the first group's.
        backbone_initial_lr: initial backbone rate (overrides the ratio).
        should_align: cap the backbone's rate at the first group's.
        initial_denom_lr: kept for Lightning's signature: the backbone's rate is always given, so it is unused.
        train_bn: add the backbone's BatchNorm parameters to the optimizer when it joins.
        verbose: log both learning rates at each change.
        rounding: digits of the logged rates.
    """

    def __init__(
        self,
        unfreeze_backbone_at_epoch: int = 10,
        lambda_func: Callable[[int], float] = multiplicative,
        backbone_initial_ratio_lr: float = 10e-2,
        backbone_initial_lr: float | None = None,
        should_align: bool = True,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
        verbose: bool = False,
        rounding: int = 12,
    ) -> None:
        super().__init__()
        if (
            isinstance(unfreeze_backbone_at_epoch, bool)
            or not isinstance(unfreeze_backbone_at_epoch, int)
            or unfreeze_backbone_at_epoch < 0
        ):
            raise ValueError(f"unfreeze_backbone_at_epoch must be an int >= 0, got {unfreeze_backbone_at_epoch!r}.")
        if not callable(lambda_func):
            raise TypeError(f"lambda_func must be a function of the epoch, got {type(lambda_func).__name__}.")
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous_backbone_lr = state_dict.get("previous_backbone_lr")
        super().load_state_dict(state_dict)

    def setup(self, trainer: Trainer, module: TrainModule, stage: Any) -> None:
        if not isinstance(getattr(module, "backbone", None), Module):
            raise ValueError(
                f"BackboneFinetuning needs the module to have a torch.nn.Module attribute `backbone`; "
                f"{type(module).__name__} has none. Name the part to finetune `self.backbone`, or "
                "subclass BaseFinetuning to choose it."
            )
        super().setup(trainer, module, stage)

    def freeze_before_training(self, pl_module: TrainModule) -> None:
        self.freeze(pl_module.backbone)  # as Lightning: BatchNorm layers stay trainable until the backbone joins

    def finetune_function(self, pl_module: TrainModule, epoch: int, optimizer: Optimizer) -> None:
        current_lr = optimizer.param_groups[0]["lr"]
        if epoch == self.unfreeze_backbone_at_epoch:
            backbone_lr = (
                self.backbone_initial_lr
                if self.backbone_initial_lr is not None
                else current_lr * self.backbone_initial_ratio_lr
            )
            self.unfreeze_and_add_param_group(
                pl_module.backbone,
                optimizer,
                backbone_lr,
                train_bn=self.train_bn,
                initial_denom_lr=self.initial_denom_lr,
            )
        elif epoch > self.unfreeze_backbone_at_epoch and self.previous_backbone_lr is not None:
            backbone_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and backbone_lr > current_lr:
                backbone_lr = current_lr
            optimizer.param_groups[-1]["lr"] = backbone_lr
        else:
            return
        self.previous_backbone_lr = backbone_lr
        if self.verbose:
            log.info(
                "Current lr: %s, Backbone lr: %s", round(current_lr, self.rounding), round(backbone_lr, self.rounding)
            )
