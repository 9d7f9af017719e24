"""TQDMProgressBar: ember's progress bar under the name and arguments of Lightning's default bar.

A Lightning script that builds ``TQDMProgressBar(refresh_rate=10)`` runs unchanged; the display is
ember's ``ProgressBar`` (tqdm in a terminal, timed lines in a log file).
"""

from __future__ import annotations

from typing import Any

from ember.callbacks.progress_bar import ProgressBar


class TQDMProgressBar(ProgressBar):
    """ember's ``ProgressBar`` with Lightning's ``TQDMProgressBar`` arguments.

    Args:
        refresh_rate: update the bars every n batches (0 disables progress output).
        process_position: how many lines down the bars are drawn, to stack several runs' bars.
        leave: keep each finished epoch's bar on screen (Lightning's default: False).
        **kwargs: ``ProgressBar``'s other arguments (``mode``, ``line_interval``, ``stream``).
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False, **kwargs: Any) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave, **kwargs)
        if isinstance(process_position, bool) or not isinstance(process_position, int) or process_position < 0:
            raise ValueError(f"process_position must be a non-negative int, got {process_position!r}.")
        self.process_position = process_position

    def _bar(self, total: float, desc: str, leave: bool, position: int = 0) -> Any:
        return super()._bar(total, desc, leave, position + self.process_position)
