"""RichModelSummary: the ``ModelSummary`` table drawn with ``rich``, under Lightning's name and arguments.

The rows, the columns and when it prints (at fit start, on global rank zero) are ``ModelSummary``'s; only
:meth:`RichModelSummary.summarize` differs: one rich table of the layers, then a grid of the totals.
``rich`` is an optional dependency (``pip install 'ember[rich]'``): the constructor checks that it is
there, so a missing package is reported when the callback is made, not in the middle of a fit.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from ember.callbacks.model_summary import ModelSummary, _human

# Columns of numbers, aligned on the right as in Lightning's rich table.
_NUMERIC = frozenset(("Params", "Params per Device", "FLOPs", "In sizes", "Out sizes", "Trainable", "Frozen"))


class RichModelSummary(ModelSummary):
    """Print the module's summary as a rich table when fitting starts (global rank zero only).

    Args:
        max_depth: how deep to list sub-modules (1: direct children; -1: all; 0: no summary).
        **summarize_kwargs: passed on to :meth:`summarize`; ``header_style`` (a rich style, default
            ``"bold magenta"``) styles the table's header, as in Lightning.

    Raises:
        ModuleNotFoundError: if ``rich`` is not installed.
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if importlib.util.find_spec("rich") is None:
            raise ModuleNotFoundError(
                "RichModelSummary needs the rich package, which is not installed. Install it with "
                "`pip install 'ember[rich]'` (or `pip install rich`), or use ModelSummary for a plain-text table."
            )
        super().__init__(max_depth, **summarize_kwargs)

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
        """Print the table with rich's console: the columns of ``summary_data`` (``(header, cells)`` each, as
        ``ModelSummary.summarize`` gets them), then the parameter counts, the size in MB, the sub-modules in
        train and eval mode and the FLOPs."""
        from rich import get_console
        from rich.table import Table

        console = get_console()
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for header, _ in summary_data:
            if header.strip() == "":
                table.add_column(header, style="dim")
            elif header == "Name":
                table.add_column(header, justify="left", no_wrap=True)
            else:
                table.add_column(header, justify="right" if header in _NUMERIC else "left")
        n_rows = len(summary_data[0][1]) if summary_data else 0
        for i in range(n_rows):
            table.add_row(*(cells[i] for _, cells in summary_data))
        if n_rows:
            console.print(table)

        totals = Table.grid(expand=True)
        totals.add_column()
        rows = [
            ("Trainable params", _human(trainable_parameters)),
            ("Non-trainable params", _human(total_parameters - trainable_parameters)),
            ("Total params", _human(total_parameters)),
            ("Total estimated model params size (MB)", f"{model_size:,.3f}"),
            ("Modules in train mode", str(total_training_modes["train"])),
            ("Modules in eval mode", str(total_training_modes["eval"])),
            ("Total FLOPs", _human(total_flops)),
        ]
        for label, value in rows:
            totals.add_row(f"[bold]{label}[/]: {value}")
        console.print(totals)
