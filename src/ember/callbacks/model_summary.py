"""ModelSummary: a table of the module's layers and parameter counts, printed at fit start."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer


def _human(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def _count(params: list[torch.nn.Parameter]) -> tuple[int, int]:
    """(trainable, frozen) element counts, each shared parameter once."""
    seen: set[int] = set()
    trainable = frozen = 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen


def summarize(module: torch.nn.Module, max_depth: int = 1) -> str:
    """The summary table of ``module``: one row per sub-module down to ``max_depth``, then totals.

    Args:
        module: the model.
        max_depth: how deep to list sub-modules (1: direct children only; 0: totals only).
    """
    rows = []
    for name, sub in module.named_modules():
        depth = name.count(".") + 1 if name else 0
        if not name or depth > max_depth:
            continue
        trainable, frozen = _count(list(sub.parameters()))
        rows.append((name, type(sub).__name__, _human(trainable + frozen), _human(trainable), _human(frozen),
                     "train" if sub.training else "eval"))
    lines = []
    if rows:
        header = ("", "Name", "Type", "Params", "Trainable", "Frozen", "Mode")
        table = [header] + [(str(i), *r) for i, r in enumerate(rows)]
        widths = [max(len(r[c]) for r in table) for c in range(len(header))]
        fmt = lambda r: " | ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
        rule = "-" * len(fmt(["-" * w for w in widths]))
        lines += [fmt(header), rule] + [fmt(r) for r in table[1:]] + [rule]
    trainable, frozen = _count(list(module.parameters()))
    size_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())
    size_bytes += sum(b.numel() * b.element_size() for b in module.buffers())
    total = trainable + frozen
    lines += [
        f"{_human(trainable):<10} Trainable params",
        f"{_human(frozen):<10} Non-trainable params",
        f"{_human(total):<10} Total params",
        f"{size_bytes / 1e6:<10.3f} Total estimated model size (MB, parameters and buffers)",
    ]
    return "\n".join(lines)


class ModelSummary(Callback):
    """Print :func:`summarize` of the module when fitting starts (global rank zero only).

    Args:
        max_depth: how deep to list sub-modules (1: direct children; -1: all; 0: totals only).
    """

    def __init__(self, max_depth: int = 1) -> None:
        if not isinstance(max_depth, int) or max_depth < -1:
            raise ValueError(f"max_depth must be an int >= -1, got {max_depth!r}.")
        self.max_depth = max_depth

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        if trainer.is_global_zero:
            depth = 10**9 if self.max_depth == -1 else self.max_depth
            print(summarize(module, depth), flush=True)
