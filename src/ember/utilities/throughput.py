"""``Throughput``: rates over a rolling window of running totals, and ``get_available_flops``, a device's peak.

Lightning keeps these in ``lightning.fabric.utilities`` (its ``pytorch_lightning.utilities`` does not export
them), so here they are importable from ``ember.utilities.throughput`` only.

The design: the caller hands in running totals (seconds since a start, batches, samples, items, and the
FLOPs of each update), and a rate is the difference between the newest and the oldest total of the last
``window_size`` updates divided by the time between them. Totals rather than per-batch amounts make one update
per batch enough, and the window smooths the rates without a per-batch division. A total that does not grow
is a bug in the caller's counters or clock, so it raises rather than giving a rate that is silently wrong.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any

import torch

from ember.user_frames import user_stacklevel
from ember.utilities.rank_zero import rank_zero_warn

__all__ = ["Throughput", "get_available_flops"]

Metrics = dict[str, int | float]


class Throughput:
    """Rates from running totals, over the last ``window_size`` updates, under Lightning's keys.

    Always returned by :meth:`compute` (the newest totals): ``time``, ``batches``, ``samples``, and
    ``lengths`` when lengths are given. Once ``window_size`` updates are in (the rates need a full window):
    ``device/batches_per_sec``, ``device/samples_per_sec``, ``device/items_per_sec`` (with lengths),
    ``device/flops_per_sec`` (once ``window_size`` updates gave ``flops``) and ``device/mfu`` (that over
    ``available_flops``). With ``world_size > 1`` also the rates of all devices together, without the
    ``device/`` part (``batches_per_sec``, ``samples_per_sec``, ``items_per_sec``, ``flops_per_sec``): this
    device's rate times ``world_size``, which assumes every device runs alike. ``/`` is ``separator``.

    Example::

        throughput = Throughput(window_size=10)
        start = time.perf_counter()
        for i, batch in enumerate(loader, 1):
            step(batch)
            throughput.update(time=time.perf_counter() - start, batches=i, samples=i * batch_size)
            if i % 10 == 0:
                print(throughput.compute())

    On a GPU, call ``torch.cuda.synchronize()`` before reading the clock, or the time is that of launching
    the work, not of doing it.

    Args:
        available_flops: the peak FLOP/s of one device (see :func:`get_available_flops`); None: no ``mfu``.
        world_size: the number of devices; above 1 the global rates are added.
        window_size: how many of the latest updates the rates span (at least 2: a rate is a difference).
        separator: joins ``device`` and the rate's name.
    """

    def __init__(
        self,
        available_flops: float | None = None,
        world_size: int = 1,
        window_size: int = 100,
        separator: str = "/",
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(
                f"Throughput(world_size=...) must be a whole number of devices, at least 1; got {world_size!r}."
            )
        check_window_arguments("Throughput", window_size, separator)
        self.available_flops = available_flops
        self.world_size = world_size
        self.window_size = window_size
        self.separator = separator
        self._time: deque[float] = deque(maxlen=window_size)
        self._batches: deque[int] = deque(maxlen=window_size)
        self._samples: deque[int] = deque(maxlen=window_size)
        self._lengths: deque[int] = deque(maxlen=window_size)
        self._flops: deque[float] = deque(maxlen=window_size)  # per update, not a running total

    def update(
        self,
        *,
        time: float,
        batches: int,
        samples: int,
        lengths: int | None = None,
        flops: float | None = None,
    ) -> None:
        """Add one update: the running totals on this device, and the FLOPs done since the previous update.

        Args:
            time: seconds since a fixed start; larger at each update.
            batches: batches done so far; larger at each update.
            samples: samples done so far (at least ``batches``); larger at each update.
            lengths: items done so far (tokens, say; at least ``samples``), at every update or at none.
            flops: the FLOPs this device did since the previous update (e.g. ``measure_flops`` of one batch
                times the batches since); None: not counted this time.

        Raises:
            ValueError: a total that did not grow, or fewer samples than batches, or fewer items than samples.
            RuntimeError: ``lengths`` given at some updates and not at others.
        """
        if samples < batches:
            raise ValueError(f"Throughput.update: samples ({samples}) must be at least batches ({batches}).")
        if lengths is not None and lengths < samples:
            raise ValueError(f"Throughput.update: lengths ({lengths}) must be at least samples ({samples}).")
        if self._time and (lengths is not None) != bool(self._lengths):
            before, now = ("given" if self._lengths else "not given"), ("" if lengths is not None else " not")
            raise RuntimeError(
                f"Throughput.update: pass lengths at every update or at none (they were {before} before, and are{now} "
                "now)."
            )
        _check_grows("time", self._time, time)
        _check_grows("batches", self._batches, batches)
        _check_grows("samples", self._samples, samples)
        if lengths is not None:
            _check_grows("lengths", self._lengths, lengths)
            self._lengths.append(lengths)
        self._time.append(time)
        self._batches.append(batches)
        self._samples.append(samples)
        if flops is not None:
            self._flops.append(flops)

    def compute(self) -> Metrics:
        """The newest totals, and the rates over the window once it is full (keys: see the class).

        Raises:
            RuntimeError: before the first :meth:`update`.
        """
        if not self._time:
            raise RuntimeError("Throughput.compute() needs at least one update() first.")
        sep, n = self.separator, self.world_size
        out: Metrics = {"time": self._time[-1], "batches": self._batches[-1], "samples": self._samples[-1]}
        if self._lengths:
            out["lengths"] = self._lengths[-1]
        if len(self._time) < self.window_size:
            return out
        # Strictly growing times (update checks) make the span positive.
        span = self._time[-1] - self._time[0]
        rates = {
            "batches_per_sec": (self._batches[-1] - self._batches[0]) / span,
            "samples_per_sec": (self._samples[-1] - self._samples[0]) / span,
        }
        if len(self._lengths) == self.window_size:
            rates["items_per_sec"] = (self._lengths[-1] - self._lengths[0]) / span
        if len(self._flops) == self.window_size:
            # The window's first update counts the work before the span starts.
            rates["flops_per_sec"] = (sum(self._flops) - self._flops[0]) / span
        for name, per_device in rates.items():
            out[f"device{sep}{name}"] = per_device
            if n > 1:
                out[name] = per_device * n
        if "flops_per_sec" in rates and self.available_flops:
            out[f"device{sep}mfu"] = rates["flops_per_sec"] / self.available_flops
        return out

    def reset(self) -> None:
        """Forget every update (the next one may start the totals from anywhere)."""
        for window in (self._time, self._batches, self._samples, self._lengths, self._flops):
            window.clear()


def check_window_arguments(owner: str, window_size: Any, separator: Any) -> None:
    """Raise what is wrong with ``window_size`` or ``separator`` as ``owner``'s arguments (also ThroughputMonitor's)."""
    if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 2:
        raise ValueError(
            f"{owner}(window_size=...) must be a whole number, at least 2 (a rate is the difference between the "
            f"window's first and last update); got {window_size!r}."
        )
    if not isinstance(separator, str):
        raise TypeError(f"{owner}(separator=...) must be a string, got {separator!r}.")


def _check_grows(name: str, window: deque, value: float) -> None:
    if window and value <= window[-1]:
        raise ValueError(
            f"Throughput.update: {name} must grow at each update (it is a running total), but went from "
            f"{window[-1]} to {value}."
        )


# Peak dense (no sparsity) FLOP/s per GPU, from NVIDIA's data sheets, for the GPUs most often met; "tf32" is
# float32 matmuls on tensor cores. The first pattern found in the lower-cased device name wins (so the more
# specific ones come first). A GPU not listed gives None: no MFU.
_F64, _F32, _BF16, _F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
_HOPPER: dict[torch.dtype | str, float] = {_F64: 34e12, _F32: 67e12, "tf32": 495e12, _BF16: 989e12, _F16: 989e12}
_GPU_PEAK_FLOPS: tuple[tuple[str, dict[torch.dtype | str, float]], ...] = (
    (r"h200.*nvl", {_F64: 30e12, _F32: 60e12, "tf32": 418e12, _BF16: 836e12, _F16: 836e12}),
    (r"h200", _HOPPER),
    (r"h100.*pcie", {_F64: 26e12, _F32: 51e12, "tf32": 378e12, _BF16: 756e12, _F16: 756e12}),
    (r"h100.*hbm3", _HOPPER),  # the SXM card
    (r"a100", {_F64: 9.7e12, _F32: 19.5e12, "tf32": 156e12, _BF16: 312e12, _F16: 312e12}),
    (r"l40s", {_F32: 91.6e12, "tf32": 183e12, _BF16: 362e12, _F16: 362e12}),
    (r"\bl4\b", {_F32: 30.3e12, "tf32": 60e12, _BF16: 121e12, _F16: 121e12}),
    (r"\bt4\b", {_F32: 8.1e12, _F16: 65e12}),
    (r"v100-sxm", {_F64: 7.8e12, _F32: 15.7e12, _F16: 125e12}),
    (r"v100-pcie", {_F64: 7e12, _F32: 14e12, _F16: 112e12}),
)


def get_available_flops(device: torch.device, dtype: torch.dtype) -> int | None:
    """The peak FLOP/s of ``device`` computing in ``dtype``: the ceiling an MFU is measured against.

    None on the CPU (as Lightning) and on a GPU this table does not know (with a warning): H200, H100 (SXM,
    PCIe), A100, L40S, L4, T4 and V100, by NVIDIA's dense figures. Lightning's table is longer (consumer
    cards, TPUs); for another device, compute the figure yourself and pass it to :class:`Throughput`.
    float32 counts as TF32 on GPUs that have it (compute capability 8 and above) unless
    ``torch.get_float32_matmul_precision()`` is "highest".

    Args:
        device: the device computing.
        dtype: the dtype its matmuls run in (bfloat16 under ``bf16-mixed``, say).
    """
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    lowered = name.lower()
    peaks = next((p for pattern, p in _GPU_PEAK_FLOPS if re.search(pattern, lowered)), None)
    if peaks is None:
        rank_zero_warn(f"No peak FLOP/s known for {name!r}: MFU is not logged.", stacklevel=user_stacklevel() + 3)
        return None
    key: torch.dtype | str = dtype
    if dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest":
        if torch.cuda.get_device_capability(device)[0] >= 8:
            key = "tf32"
    if key not in peaks:
        rank_zero_warn(
            f"No peak FLOP/s known for {name!r} in {dtype}: MFU is not logged.", stacklevel=user_stacklevel() + 3
        )
        return None
    return int(peaks[key])
