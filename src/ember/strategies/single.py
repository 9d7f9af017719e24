"""One process, one device: the strategy every other one must agree with."""

from __future__ import annotations

from typing import Any

import torch

from ember.strategies.strategy import Strategy


class SingleDeviceStrategy(Strategy):
    """Train on one device in this process.

    Args:
        device: the device to use; defaults to the one the Trainer resolves.
    """

    def __init__(self, device: str | torch.device | None = None, accelerator: str | None = None) -> None:
        super().__init__(accelerator=accelerator, devices=[torch.device(device)] if device is not None else None)
        self._cpu_only = self._never_moves = False

    def setup(self, trainer: Any, module: Any) -> None:
        super().setup(trainer, module)
        self._cpu_only = self.root_device.type == "cpu"
        # Without CUDA no batch can ever hold a CUDA tensor: not even the per-step check below is needed.
        self._never_moves = self._cpu_only and not torch.cuda.is_available()

    def moves_batches(self) -> bool:
        return not self._never_moves

    def batch_to_device(self, batch: Any) -> Any:
        # On a CPU run where CUDA was never initialised, no tensor can live anywhere but the CPU:
        # skip walking the batch (this is the whole per-step cost of the transfer on CPU).
        if self._never_moves or (self._cpu_only and not torch.cuda.is_initialized()):
            return batch
        return super().batch_to_device(batch)
