"""Tiny modules, data and recording callbacks shared by the tests.

Everything here is small enough that a fit takes milliseconds on one CPU core.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ember
from ember.callbacks import Callback
from ember.callbacks.callback import HOOKS
from ember.loggers import Logger
from ember.strategies.single import SingleDeviceStrategy


# ---------------------------------------------------------------------- data
def regression_data(n: int = 32, d: int = 4, seed: int = 0) -> TensorDataset:
    """``y = x @ w + noise`` with a fixed generator, so every test sees the same numbers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def regression_loader(n: int = 32, batch_size: int = 8, d: int = 4, seed: int = 0, **kwargs: Any) -> DataLoader:
    return DataLoader(regression_data(n, d, seed), batch_size=batch_size, **kwargs)


class UnsizedBatches(IterableDataset):
    """An iterable of ready-made batches with no ``__len__`` (a stream)."""

    def __init__(self, n: int = 32, batch_size: int = 8, d: int = 4, seed: int = 0) -> None:
        data = regression_data(n, d, seed)
        self.batches = [
            (data.tensors[0][i : i + batch_size], data.tensors[1][i : i + batch_size]) for i in range(0, n, batch_size)
        ]

    def __iter__(self):
        return iter(self.batches)


def fast_trainer(**kwargs: Any) -> ember.Trainer:
    """A Trainer on the CPU with the progress bar, loggers and default checkpointing off (unless asked for).

    Pinned to the CPU so that exact comparisons with CPU reference loops hold on machines with a GPU too.
    """
    kwargs.setdefault("accelerator", "cpu")
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("max_epochs", 1)
    return ember.Trainer(**kwargs)


# ---------------------------------------------------------------------- modules
class BoringModel(ember.TrainModule):
    """A linear regression: logs ``train_loss``, ``val_loss``, ``test_loss``; SGD lr 0.1."""

    def __init__(self, d: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(d, 1)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TrainOnlyModel(BoringModel):
    """A BoringModel without evaluation steps (they fall back to TrainModule's)."""

    validation_step = ember.TrainModule.validation_step
    test_step = ember.TrainModule.test_step


# ---------------------------------------------------------------------- recorders
_MODULE_HOOKS = tuple(
    n
    for n in vars(ember.TrainModule)
    if (n.startswith("on_") or n in ("setup", "teardown", "prepare_data"))
    and n not in ("on_save_checkpoint", "on_load_checkpoint", "on_before_batch_transfer", "on_after_batch_transfer")
    and not n.endswith(("_model_eval", "_model_train", "_model_zero_grad"))
)


def _recorder(owner: str, name: str, with_stage: bool):
    if with_stage:

        def hook(self, *args: Any, **kwargs: Any) -> None:
            self.calls.append(f"{owner}.{name}:{kwargs['stage'] if 'stage' in kwargs else args[-1]}")
    else:

        def hook(self, *args: Any) -> None:
            self.calls.append(f"{owner}.{name}")

    hook.__name__ = name
    return hook


class RecordingCallback(Callback):
    """Appends ``"Callback.<hook>"`` (``"Callback.setup:fit"`` for setup/teardown) to ``calls``."""

    def __init__(self, calls: list[str] | None = None) -> None:
        self.calls = calls if calls is not None else []


for _name in HOOKS:
    if _name not in ("on_save_checkpoint", "on_load_checkpoint", "on_exception"):
        setattr(RecordingCallback, _name, _recorder("Callback", _name, _name in ("setup", "teardown")))


class RecordingModule(BoringModel):
    """A BoringModel that appends ``"Module.<hook or step>"`` to ``calls`` for every hook it gets."""

    def __init__(self, calls: list[str] | None = None) -> None:
        super().__init__()
        self.calls = calls if calls is not None else []

    def configure_callbacks(self) -> list[Callback]:
        self.calls.append("Module.configure_callbacks")
        return []

    def configure_optimizers(self) -> Any:
        self.calls.append("Module.configure_optimizers")
        return super().configure_optimizers()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls.append("Module.training_step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.calls.append("Module.validation_step")
        super().validation_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.calls.append("Module.test_step")
        super().test_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        self.calls.append("Module.predict_step")
        return super().predict_step(batch, batch_idx)


for _name in _MODULE_HOOKS:
    setattr(RecordingModule, _name, _recorder("Module", _name, _name in ("setup", "teardown")))


class RecordingLogger(Logger):
    """A Logger that keeps every ``log_metrics`` call as ``(step, metrics)`` and its finalize status."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []
        self.status: str | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.records.append((step, dict(metrics)))

    def finalize(self, status: str) -> None:
        self.status = status

    def steps_with(self, key: str) -> list[int]:
        return [s for s, m in self.records if key in m]


class OtherRank(SingleDeviceStrategy):
    """A single-device strategy that reports being rank 1 of 2, as a DDP worker would."""

    @property
    def global_rank(self) -> int:
        return 1

    @property
    def is_global_zero(self) -> bool:
        return False


def value_loader(values: list[float], batch_size: int = 4) -> DataLoader:
    """Batches of ``(v, v)`` where v is one float per sample, so the logged batch mean is known."""
    t = torch.tensor(values).unsqueeze(1)
    return DataLoader(TensorDataset(t, t), batch_size=batch_size)
