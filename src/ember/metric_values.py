"""Reading logged values: ``torchmetrics`` Metrics recognised without importing torchmetrics, a Metric's
batch value, and a dict of values as Python floats with one device synchronisation.

A leaf, kept import-light: it is on ``import ember``'s path, and torchmetrics is an optional extra.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def to_floats(metrics: dict[str, Any]) -> dict[str, float]:
    """Convert a dict of scalar tensors / numbers to Python floats with one device synchronisation.

    Values on the CPU are read one by one (reading one waits for no device);
    values on an accelerator are stacked and copied together, so that reading several waits for
    the device once rather than once per value.
    """
    out: dict[str, float] = {}
    on_device: list[str] = []
    for k, v in metrics.items():
        if not isinstance(v, torch.Tensor):
            out[k] = float(v)
        elif v.is_cpu:
            out[k] = float(v.item())  # exact for every dtype a logged value can have (float32/64, bf16, ints)
        else:
            out[k] = 0.0  # placeholder, keeps the key order
            on_device.append(k)
    by_device: dict[torch.device, list[str]] = {}
    for k in on_device:
        by_device.setdefault(metrics[k].device, []).append(k)
    for keys in by_device.values():
        stacked = torch.stack([metrics[k].detach().to(torch.float64).reshape(()) for k in keys])
        out.update(zip(keys, stacked.tolist()))
    return out


def is_torchmetric(value: Any, kind: str = "Metric") -> bool:
    """Whether ``value`` is a ``torchmetrics.Metric`` (or the class ``kind`` names, e.g. "MetricCollection"),
    without importing torchmetrics (an optional extra).

    A Metric can only exist once torchmetrics is imported, so a plain tensor costs one dict lookup.
    """
    tm = sys.modules.get("torchmetrics")
    return tm is not None and isinstance(value, getattr(tm, kind))


def metric_batch_value(metric: Any) -> Any:
    """What a torchmetrics Metric's last ``forward`` returned for its batch: None after ``update`` alone."""
    # torchmetrics keeps it in this attribute and has no public reader; Lightning reads a Metric's step value here too.
    return metric._forward_cache  # noqa: SLF001
