"""Shared pieces of the CUDA suite: a small module, its data, and a plain CUDA loop to compare with.

Nothing here touches CUDA at import time, so the suite is collected (and skipped) on machines
without a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)
N, BATCH, D = 64, 16, 8


def data(n: int = N, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    return TensorDataset(x, (x @ torch.randn(D, 1, generator=g)).tanh())


def loader(n: int = N, batch_size: int = BATCH, **kwargs: Any) -> DataLoader:
    return DataLoader(data(n), batch_size=batch_size, **kwargs)


class MLP(ember.TrainModule):
    """An MLP with SGD and momentum; logs its loss to the progress bar every step."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.lr = lr
        self.seen: list[tuple[str, torch.dtype]] = []  # (device type, output dtype) per step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        self.seen.append((out.device.type, out.dtype))
        loss = F.mse_loss(out.float(), y.to(out.device).float())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class EpochLogging(MLP):
    """Also logs an epoch-level mean (accumulated on the device every step)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss_epoch_mean", loss.detach(), on_step=False, on_epoch=True)
        return loss


class ManyMetrics(EpochLogging):
    """Logs many values per step, on_step and on_epoch, as a model with several losses and accuracies does:
    device tensors (views of one, as ``unbind`` gives), some in the bar, a half-precision one, an integer one,
    a Python float, a sum and a max, from the step and from ``on_train_batch_end``."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        scaled = (loss.detach() * torch.arange(1.0, 21.0, device=loss.device)).unbind()
        for k, value in enumerate(scaled):
            self.log(f"m{k}", value, on_step=True, on_epoch=True, prog_bar=k % 5 == 0)
        self.log("half", loss.detach().half(), on_step=True, on_epoch=True)
        self.log("count", (batch[1] > 0).sum(), on_step=True, on_epoch=True)
        self.log("number", float(batch_idx), on_step=True, on_epoch=True)
        self.log("total", loss.detach(), on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("peak", loss.detach(), on_step=False, on_epoch=True, reduce_fx="max")
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("batch_end", outputs["loss"], on_step=True, on_epoch=True)


#: log_every_n_steps of the sync tests: the steps between two logger writes are the ones checked.
SYNC_LOG_EVERY = 5
#: What the sync tests log: one value a step, or many (tests/cuda/test_cuda_sync.py, and its CPU stand-in
#: tests/trainer/test_host_reads.py).
SYNC_MODULES = {"one value": EpochLogging, "many values": ManyMetrics}


def trainer(**kwargs: Any) -> ember.Trainer:
    """A Trainer on CUDA without bar, logger or checkpoints unless asked for."""
    kwargs.setdefault("accelerator", "cuda")
    kwargs.setdefault("devices", 1)
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("max_epochs", 2)
    kwargs.setdefault("num_sanity_val_steps", 0)
    return ember.Trainer(**kwargs)


def plain_cuda_loop(
    epochs: int = 2, autocast: torch.dtype | None = None, scaler: bool = False, batch_size: int = BATCH
) -> torch.nn.Module:
    """What the Trainer's single-device fit should amount to, written out by hand."""
    model = MLP().cuda()
    opt = model.configure_optimizers()
    grad_scaler = torch.amp.GradScaler("cuda") if scaler else None
    for _ in range(epochs):
        for x, y in loader(batch_size=batch_size):
            x, y = x.cuda(), y.cuda()
            with torch.autocast("cuda", dtype=autocast or torch.float32, enabled=autocast is not None):
                loss = F.mse_loss(model(x).float(), y)
            opt.zero_grad()
            if grad_scaler is not None:
                grad_scaler.scale(loss).backward()
                grad_scaler.step(opt)
                grad_scaler.update()
            else:
                loss.backward()
                opt.step()
    return model


def assert_close_modules(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-6) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p.float().cpu(), q.float().cpu(), atol=atol, rtol=0, msg=name)


def assert_same_grads(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        # A gradient that is identically zero may come back as zeros on one side, None on the other.
        pg = p.grad if p.grad is not None else torch.zeros_like(p)
        qg = q.grad if q.grad is not None else torch.zeros_like(q)
        torch.testing.assert_close(pg, qg, msg=name, rtol=1e-5, atol=1e-6)
