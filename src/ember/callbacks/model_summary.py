"""ModelSummary: a table of the module's layers and parameter counts, printed at fit start."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


def summary_data(module: torch.nn.Module, max_depth: int = 1) -> list[tuple[str, list[str]]]:
    """The table's columns, as Lightning hands them to ``ModelSummary.summarize``: ``(header, cells)``
    for each column, one cell per sub-module down to ``max_depth`` (-1: all)."""
    depth_limit = 10**9 if max_depth == -1 else max_depth
    rows = []
    for name, sub in module.named_modules():
        depth = name.count(".") + 1 if name else 0
        if not name or depth > depth_limit:
            continue
        trainable, frozen = _count(list(sub.parameters()))
        rows.append(
            (
                name,
                type(sub).__name__,
                _human(trainable + frozen),
                _human(trainable),
                _human(frozen),
                "train" if sub.training else "eval",
            )
        )
    headers = ("Name", "Type", "Params", "Trainable", "Frozen", "Mode")
    return [(" ", [str(i) for i in range(len(rows))])] + [(h, [r[c] for r in rows]) for c, h in enumerate(headers)]


def format_summary_table(
    summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int, model_size: float
) -> str:
    """The printed table: the columns of :func:`summary_data`, then the totals (``model_size`` in MB)."""
    lines = []
    n_rows = len(summary_data[0][1]) if summary_data else 0
    if n_rows:
        table = [tuple(h.strip() for h, _ in summary_data)] + [
            tuple(cells[i] for _, cells in summary_data) for i in range(n_rows)
        ]
        widths = [max(len(r[c]) for r in table) for c in range(len(summary_data))]
        fmt = lambda r: " | ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
        rule = "-" * len(fmt(["-" * w for w in widths]))
        lines += [fmt(table[0]), rule] + [fmt(r) for r in table[1:]] + [rule]
    lines += [
        f"{_human(trainable_parameters):<10} Trainable params",
        f"{_human(total_parameters - trainable_parameters):<10} Non-trainable params",
        f"{_human(total_parameters):<10} Total params",
        f"{model_size:<10.3f} Total estimated model size (MB, parameters and buffers)",
    ]
    return "\n".join(lines)


def _totals(module: torch.nn.Module) -> tuple[int, int, float, dict[str, int]]:
    """(total parameters, trainable parameters, size in MB of parameters and buffers, sub-modules per mode)."""
    trainable, frozen = _count(list(module.parameters()))
    size_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())
    size_bytes += sum(b.numel() * b.element_size() for b in module.buffers())
    subs = [m for name, m in module.named_modules() if name]
    modes = {"train": sum(m.training for m in subs), "eval": sum(not m.training for m in subs)}
    return trainable + frozen, trainable, size_bytes / 1e6, modes


def summarize(module: torch.nn.Module, max_depth: int = 1) -> str:
    """The summary table of ``module``: one row per sub-module down to ``max_depth``, then totals.

    Args:
        module: the model.
        max_depth: how deep to list sub-modules (1: direct children only; 0: totals only; -1: all).
    """
    total, trainable, size, _ = _totals(module)
    return format_summary_table(summary_data(module, max_depth), total, trainable, size)


class ModelSummary(Callback):
    """Print the module's summary table when fitting starts (global rank zero only).

    Override :meth:`summarize` to show or record the summary another way (as in Lightning).

    Args:
        max_depth: how deep to list sub-modules (1: direct children; -1: all; 0: no summary, as Lightning).
        **summarize_kwargs: passed on to :meth:`summarize`.
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise ValueError(
                f"ModelSummary max_depth must be an int >= -1 (-1: every level, 0: off), got {max_depth!r}."
            )
        self.max_depth = max_depth
        self._summarize_kwargs = summarize_kwargs

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        if not self.max_depth:
            return
        data = summary_data(module, self.max_depth)
        total, trainable, size, modes = _totals(module)
        if trainer.is_global_zero:
            self.summarize(data, total, trainable, size, modes, total_flops=0, **self._summarize_kwargs)

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int = 0,
        **summarize_kwargs: Any,
    ) -> None:
        """Show the summary (default: print the table). Arguments as Lightning's: the table's columns as
        ``(header, cells)``, the parameter counts, the size in MB (ember counts buffers too), the number
        of sub-modules in train and eval mode, and FLOPs (ember does not count them: 0)."""
        print(format_summary_table(summary_data, total_parameters, trainable_parameters, model_size), flush=True)
