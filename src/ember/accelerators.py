"""``trainer.accelerator``: the kind of device a run uses, with Lightning's ``Accelerator`` methods.

ember's strategies place the module and the batches themselves; the accelerator object answers what a
Lightning user asks of it: which kind of device (``isinstance(trainer.accelerator, CUDAAccelerator)``),
whether it is available, how many there are, the devices for a ``devices=`` value, and a device's
statistics (``get_device_stats``, what ``DeviceStatsMonitor`` logs).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Accelerator", "CPUAccelerator", "CUDAAccelerator", "accelerator_for", "cpu_stats"]


def cpu_stats() -> dict[str, float]:
    """``psutil``'s memory, CPU and swap use, in percent."""
    import psutil

    return {
        "cpu_vm_percent": psutil.virtual_memory().percent,
        "cpu_percent": psutil.cpu_percent(),
        "cpu_swap_percent": psutil.swap_memory().percent,
    }


class Accelerator:
    """One kind of device. Subclasses say which (``device_type``) and how to count and read them."""

    device_type = ""

    def setup_device(self, device: torch.device) -> None:
        """Make ``device`` this process's current device of its kind."""
        if device.type != self.device_type:
            raise ValueError(f"{type(self).__name__} cannot set up {device}: it is not a {self.device_type} device.")

    def teardown(self) -> None:
        """Release what the run held on its devices."""

    def get_device_stats(self, device: torch.device | str | int) -> dict[str, Any]:
        """The device's statistics, by name."""
        raise NotImplementedError

    @classmethod
    def get_parallel_devices(cls, devices: int | list[int]) -> list[torch.device]:
        """The devices a ``devices=`` value names: a count (the first ones) or a list of indices."""
        indices = list(range(devices)) if isinstance(devices, int) else list(devices)
        return [torch.device(cls.device_type, i) for i in indices]

    @staticmethod
    def auto_device_count() -> int:
        """How many devices ``devices="auto"`` uses."""
        raise NotImplementedError

    @staticmethod
    def is_available() -> bool:
        """Whether this machine has such a device."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CPUAccelerator(Accelerator):
    device_type = "cpu"

    def get_device_stats(self, device: torch.device | str | int) -> dict[str, Any]:
        return dict(cpu_stats())

    @classmethod
    def get_parallel_devices(cls, devices: int | list[int]) -> list[torch.device]:
        count = devices if isinstance(devices, int) else len(devices)
        return [torch.device("cpu")] * count  # processes on the CPU share it

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True


class CUDAAccelerator(Accelerator):
    device_type = "cuda"

    def setup_device(self, device: torch.device) -> None:
        super().setup_device(device)
        torch.cuda.set_device(device)

    def teardown(self) -> None:
        torch.cuda.empty_cache()

    def get_device_stats(self, device: torch.device | str | int) -> dict[str, Any]:
        return dict(torch.cuda.memory_stats(device))

    @staticmethod
    def auto_device_count() -> int:
        return torch.cuda.device_count()

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()


def accelerator_for(device_type: str) -> Accelerator:
    """The accelerator of a resolved ``Trainer(accelerator=...)`` ("cpu" or "cuda")."""
    kinds: dict[str, type[Accelerator]] = {"cpu": CPUAccelerator, "cuda": CUDAAccelerator}
    if device_type not in kinds:
        raise ValueError(f"No accelerator for device type {device_type!r}; ember runs on 'cpu' and 'cuda'.")
    return kinds[device_type]()
