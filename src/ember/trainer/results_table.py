"""The table ``validate()`` and ``test()`` print on global rank zero when they end (``verbose=True``).

Laid out as Lightning prints it without ``rich``: a rule, a header of "<Stage> metric" and one
"DataLoader i" column per loader, then one row per logged key (sorted, the ``/dataloader_idx_i``
suffix dropped, a blank cell where a loader did not log the key), and a closing rule. A user moving
from Lightning sees the same table, and a script that parses it keeps working.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import torch


def format_results(results: list[dict[str, Any]], stage: str) -> str | None:
    """The table of ``results`` (one dict per loader), or None when nothing was logged."""
    results = [{k.split("/dataloader_idx_")[0]: v for k, v in r.items()} for r in results]
    names = sorted({k for r in results for k in r})
    if not names:
        return None
    headers = [f"DataLoader {i}" for i in range(len(results))]
    term = shutil.get_terminal_size(fallback=(120, 30)).columns or 120
    width = int(min(max(len(max(names, key=len)), len(max(headers, key=len)), 25), term / 2))
    rows = [[_cell(r.get(name)) for r in results] for name in names]
    try:
        "─".encode(sys.stdout.encoding or "utf-8")
        rule = "─" * term
    except UnicodeEncodeError:  # a terminal that cannot print the box character
        rule = "-" * term
    per_table = max(1, int((term - width) / width))
    half = int(term / 2)
    lines: list[str] = []
    for start in range(0, len(headers), per_table):
        cols = [f"{stage} metric".capitalize(), *headers[start : start + per_table]]
        row_format = f"{{:^{width}}}" * len(cols)
        lines += [rule, row_format.format(*cols).rstrip(), rule]
        for name, row in zip(names, rows):
            cells = row[start : start + per_table]
            if len(name) > half:  # a long name wraps over several lines, exactly as Lightning's
                while len(name) > half:
                    lines.append(row_format.format(name[:half], *cells).rstrip())
                    name = name[half:]
                lines.append(row_format.format(name, " ").rstrip())
            else:
                lines.append(row_format.format(name, *cells).rstrip())
        lines.append(rule)
    return os.linesep.join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return " "
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    return f"{value}"


def print_results(results: list[dict[str, Any]], stage: str) -> None:
    table = format_results(results, stage)
    if table is not None:
        print(table, flush=True)
