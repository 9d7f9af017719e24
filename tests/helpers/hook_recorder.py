"""A module, callback and datamodule that record every hook they get, for the hook-contract tests.

Each call is recorded as ``"M.<hook>"`` (module), ``"C.<hook>"`` (callback) or ``"D.<hook>"``
(datamodule), followed by ``(...)`` with the int and str arguments (keywords as ``name=value``,
other keyword arguments as ``name=``), e.g. ``"M.optimizer_step(0,1)"`` or ``"C.setup(stage='fit')"``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback
from ember.callbacks.callback import HOOKS


def _fmt(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    parts = [repr(a) for a in args if isinstance(a, (int, str)) and not isinstance(a, bool)]
    for k, v in kwargs.items():
        parts.append(f"{k}={v!r}" if isinstance(v, (int, str)) and not isinstance(v, bool) else f"{k}=")
    return name + (f"({','.join(parts)})" if parts else "")


MODULE_HOOKS = (
    "prepare_data",
    "setup",
    "teardown",
    "configure_model",
    "configure_optimizers",
    "configure_callbacks",
    "on_fit_start",
    "on_fit_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_start",
    "on_test_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_start",
    "on_predict_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_validation_model_zero_grad",
    "on_validation_model_eval",
    "on_validation_model_train",
    "on_test_model_eval",
    "on_test_model_train",
    "on_predict_model_eval",
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
    "optimizer_step",
    "optimizer_zero_grad",
    "backward",
    "configure_gradient_clipping",
    "clip_gradients",
    "lr_scheduler_step",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
    "load_state_dict",
)


def _loader(n: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 2), torch.randn(n, 1)), batch_size=1)


class HookModule(ember.TrainModule):
    """Linear(2, 1) with SGD and an epoch StepLR; ``manual=True`` steps its optimizer twice per batch."""

    def __init__(self, calls: list[str], manual: bool = False, n_val: int = 2) -> None:
        super().__init__()
        self.calls = calls
        self.layer = torch.nn.Linear(2, 1)
        self.automatic_optimization = not manual
        self.n_val = n_val

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            opt.step()
            return None
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}

    def train_dataloader(self) -> DataLoader:
        return _loader(4)

    def val_dataloader(self) -> DataLoader:
        return _loader(self.n_val)

    def test_dataloader(self) -> DataLoader:
        return _loader(2)

    def predict_dataloader(self) -> DataLoader:
        return _loader(2)


def _module_recorder(name: str) -> Any:
    def hook(self: HookModule, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("M." + _fmt(name, args, kwargs))
        return getattr(super(RecordingHookModule, self), name)(*args, **kwargs)

    hook.__name__ = name
    return hook


class RecordingHookModule(HookModule):
    pass


for _name in MODULE_HOOKS:
    setattr(RecordingHookModule, _name, _module_recorder(_name))


class HookCallback(Callback):
    """Records every Callback hook (the trainer and module arguments left out)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls


def _callback_recorder(name: str) -> Any:
    def hook(self: HookCallback, trainer: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        self.calls.append("C." + _fmt(name, args, kwargs))

    hook.__name__ = name
    return hook


for _name in HOOKS:
    setattr(HookCallback, _name, _callback_recorder(_name))


def trainer(calls: list[str], **kwargs: Any) -> ember.Trainer:
    """The trainer of the contract scenarios: 2 epochs of 2 batches, 2 validation batches, 1 sanity step."""
    options: dict[str, Any] = dict(
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        accelerator="cpu",
        callbacks=[HookCallback(calls)],
    )
    options.update(kwargs)
    return ember.Trainer(**options)
