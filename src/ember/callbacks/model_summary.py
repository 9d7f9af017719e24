"""ModelSummary: a table of the module's layers, parameter counts and FLOPs, printed at fit start."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer


_NOT_APPLICABLE = "n/a"
_UNKNOWN_SIZE = "?"


def _human(n: float) -> str:
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(int(n))


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


def _listed(module: torch.nn.Module, max_depth: int) -> list[tuple[str, torch.nn.Module]]:
    """The sub-modules in the table: down to ``max_depth`` (-1: all), the module itself excluded."""
    depth_limit = 10**9 if max_depth == -1 else max_depth
    return [(name, sub) for name, sub in module.named_modules() if name and name.count(".") < depth_limit]


def _shape(value: Any) -> Any:
    """An input's or output's shape as Lightning's summary shows it: a list of sizes, nested for tuples and
    lists, ``?`` for anything without a shape."""
    if hasattr(value, "shape"):
        return list(value.shape)
    if isinstance(value, (list, tuple)):
        return [_shape(v) for v in value]
    return _UNKNOWN_SIZE


def _run_example(
    module: torch.nn.Module, listed: list[tuple[str, torch.nn.Module]]
) -> tuple[dict[str, int], int, dict[str, tuple[Any, Any]]] | None:
    """Run ``module.example_input_array`` through the module (in eval mode, without gradients, every
    ``training`` flag put back after), counting FLOPs with torch's ``FlopCounterMode`` and recording each
    listed sub-module's first input and output shapes, as Lightning's summary does. Returns (FLOPs per
    listed name, total FLOPs, (in, out) shapes per listed name), or None without an example input."""
    sample = getattr(module, "example_input_array", None)
    if sample is None:
        return None
    from torch.utils.flop_counter import FlopCounterMode  # imported where used: only with an example input

    hooks: Any = module
    if hasattr(hooks, "transfer_batch_to_device"):  # a TrainModule: the batch hooks, as a real batch
        sample = hooks.on_before_batch_transfer(sample, 0)
        sample = hooks.transfer_batch_to_device(sample, hooks.device, 0)
        sample = hooks.on_after_batch_transfer(sample, 0)
    sizes: dict[str, tuple[Any, Any]] = {}
    handles = []
    for name, sub in listed:

        def hook(sub: torch.nn.Module, args: Any, kwargs: Any, out: Any, name: str = name) -> None:
            if name not in sizes:  # the first call (a module used twice keeps its first shapes)
                inp = (*args, *kwargs.values())
                sizes[name] = (_shape(inp[0] if len(inp) == 1 else inp), _shape(out))

        handles.append(sub.register_forward_hook(hook, with_kwargs=True))
    modes = [(m, m.training) for m in module.modules()]
    counter = FlopCounterMode(display=False)
    try:
        module.eval()
        with torch.no_grad(), counter:
            if isinstance(sample, (list, tuple)):
                module(*sample)
            elif isinstance(sample, dict):
                module(**sample)
            else:
                module(sample)
    finally:
        for handle in handles:
            handle.remove()
        for m, flag in modes:
            m.training = flag
    counts = counter.get_flop_counts()
    root = type(module).__name__
    flops = {name: sum(counts.get(f"{root}.{name}", {}).values()) for name, _ in listed}
    return flops, counter.get_total_flops(), sizes


def _table(module: torch.nn.Module, max_depth: int) -> tuple[list[tuple[str, list[str]]], int]:
    """(the columns of the table, total FLOPs): see :func:`summary_data`."""
    listed = _listed(module, max_depth)
    counts = [_count(list(sub.parameters())) for _, sub in listed]
    example = _run_example(module, listed)
    columns: list[tuple[str, list[str]]] = [
        (" ", [str(i) for i in range(len(listed))]),
        ("Name", [name for name, _ in listed]),
        ("Type", [type(sub).__name__ for _, sub in listed]),
        ("Params", [_human(t + f) for t, f in counts]),
        ("Mode", ["train" if sub.training else "eval" for _, sub in listed]),
        ("FLOPs", [_human(example[0][name]) if example else "0" for name, _ in listed]),
    ]
    if example is not None:
        shapes = [example[2].get(name, (_UNKNOWN_SIZE, _UNKNOWN_SIZE)) for name, _ in listed]
        columns += [("In sizes", [str(i) for i, _ in shapes]), ("Out sizes", [str(o) for _, o in shapes])]
    columns += [("Trainable", [_human(t) for t, _ in counts]), ("Frozen", [_human(f) for _, f in counts])]
    # As Lightning: parameters no listed sub-module holds (the module's own) get a row of their own.
    trainable, frozen = _count(list(module.parameters()))
    left_trainable = trainable - sum(t for t, _ in counts)
    left_frozen = frozen - sum(f for _, f in counts)
    if left_trainable + left_frozen > 0:
        extra = {" ": " ", "Name": "other params", "Params": _human(left_trainable + left_frozen)}
        extra.update(Trainable=_human(max(left_trainable, 0)), Frozen=_human(max(left_frozen, 0)))
        for header, cells in columns:
            cells.append(extra.get(header, _NOT_APPLICABLE))
    return columns, example[1] if example else 0


def summary_data(module: torch.nn.Module, max_depth: int = 1) -> list[tuple[str, list[str]]]:
    """The table's columns, as Lightning hands them to ``ModelSummary.summarize``: ``(header, cells)``
    for each column, one cell per sub-module down to ``max_depth`` (-1: all).

    The columns are Lightning's, in its order: `` ``, ``Name``, ``Type``, ``Params``, ``Mode``,
    ``FLOPs`` (counted when the module has an ``example_input_array``, which is run through it once;
    else 0), then ``In sizes`` and ``Out sizes`` with an example input; ember adds ``Trainable`` and
    ``Frozen`` last. Parameters held by no listed sub-module get an ``other params`` row.
    """
    return _table(module, max_depth)[0]


def format_summary_table(
    summary_data: list[tuple[str, list[str]]],
    total_parameters: int,
    trainable_parameters: int,
    model_size: float,
    total_training_modes: dict[str, int] | None = None,
    total_flops: int | None = None,
) -> str:
    """The printed table: the columns of :func:`summary_data`, then the totals (``model_size`` in MB), and,
    when given, the number of sub-modules in train and eval mode and the total FLOPs (as Lightning's)."""
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
    if total_training_modes is not None:
        lines += [
            f"{total_training_modes['train']:<10} Modules in train mode",
            f"{total_training_modes['eval']:<10} Modules in eval mode",
        ]
    if total_flops is not None:
        lines.append(f"{_human(total_flops):<10} Total Flops")
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
    total, trainable, size, modes = _totals(module)
    columns, flops = _table(module, max_depth) if max_depth else ([], 0)
    return format_summary_table(columns, total, trainable, size, modes, flops)


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
        data, flops = _table(module, self.max_depth)
        total, trainable, size, modes = _totals(module)
        if trainer.is_global_zero:
            self.summarize(data, total, trainable, size, modes, total_flops=flops, **self._summarize_kwargs)

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
        ``(header, cells)`` (see :func:`summary_data`), the parameter counts, the size in MB (ember counts
        buffers too), the number of sub-modules in train and eval mode, and the FLOPs of one forward pass of
        the module's ``example_input_array`` (0 without one)."""
        table = format_summary_table(
            summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, total_flops
        )
        print(table, flush=True)
