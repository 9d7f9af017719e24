"""Two groups of TrainModule's hooks, with their defaults, that :class:`~ember.module.TrainModule` inherits:

- :class:`DataHooks` (Lightning's ``DataHooks``): where the module's loaders come from, and how a
  batch reaches the device;
- :class:`ModeHooks`: the module's mode around evaluation (eval before it, each submodule's own
  ``training`` flag back after it: :func:`restore_modes`, which the evaluation loop runs too).

The Trainer calls only the hooks a subclass defines (``ember.overrides.defines_hook``); otherwise it does
the same work inline. The lifecycle hooks (``setup``, ``on_fit_start``, ...) stay in TrainModule's own
class body (``module.py``), where the tests' hook lists read them (``vars(TrainModule)``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ember.batches import move_to_device


class DataHooks:
    """The loader hooks (a subclass defines the ones it uses) and the batch-transfer hooks."""

    # The loaders, when neither fit's arguments nor a datamodule give them. The Trainer calls only the ones
    # a subclass defines (as Lightning, whose DataHooks define them too, so that hook lists name them).
    def train_dataloader(self) -> Any:
        """The training loader (any iterable of batches), requested once per fit after the sanity check."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no train_dataloader(); define it, or pass train_dataloaders to fit."
        )

    def val_dataloader(self) -> Any:
        """One validation loader or a list of them, requested when the sanity check starts (or after the
        training loader). An empty list: this fit does not validate (None is refused, as in Lightning)."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no val_dataloader(); define it, or pass val_dataloaders to fit."
        )

    def test_dataloader(self) -> Any:
        """One test loader or a list of them, requested when ``trainer.test`` starts."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no test_dataloader(); define it, or pass dataloaders to test."
        )

    def predict_dataloader(self) -> Any:
        """One predict loader or a list of them, requested when ``trainer.predict`` starts."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no predict_dataloader(); define it, or pass dataloaders to predict."
        )

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change the batch before it is moved to the device; return it."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move ``batch`` to ``device`` (default: every tensor in nested lists, tuples and dicts)."""
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change the batch after it was moved to the device; return it."""
        return batch


class ModeHooks(nn.Module):
    """The hooks that put the module in eval mode before an evaluation (releasing its gradients first, in a
    fit's validation), and back after it."""

    def on_validation_model_zero_grad(self) -> None:
        """Before a validation inside fit (outside an accumulation window): release the gradients
        (``zero_grad()``, whose default sets them to None)."""
        self.zero_grad()

    def on_validation_model_eval(self) -> None:
        """Put the module in eval mode before validation (default: ``self.eval()``)."""
        self.eval()

    def on_validation_model_train(self) -> None:
        """After validation; by default every submodule gets back its own previous ``training`` flag."""
        restore_modes(self)

    def on_test_model_eval(self) -> None:
        self.eval()

    def on_test_model_train(self) -> None:
        restore_modes(self)

    def on_predict_model_eval(self) -> None:
        self.eval()


def restore_modes(module: nn.Module) -> None:
    """Give every submodule the ``training`` flag saved by the loop before evaluation."""
    saved = getattr(module, "_ember_saved_modes", None)
    if saved is None:
        module.train()
        return
    for m, flag in saved:
        m.training = flag
