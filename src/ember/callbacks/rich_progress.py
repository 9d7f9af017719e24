"""RichProgressBar: the progress bar drawn with ``rich``, under Lightning's name and arguments.

It is ember's ``ProgressBar`` with another display: the same bars (one per training epoch, one per
validation, test or predict run), updated at the same points and showing the same ``prog_bar`` metrics;
only the drawing is rich's (a live display refreshed ``refresh_rate`` times a second by rich's thread,
as in Lightning, where the tqdm bar counts batches). ``rich`` is an optional dependency
(``pip install 'ember[rich]'``), imported when the first bar of a run is drawn.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

from ember.callbacks.progress_bar import ProgressBar
from ember.types import Stage


@dataclass
class RichProgressBarTheme:
    """Styles of the bar's parts (rich style strings, https://rich.readthedocs.io/en/stable/style.html),
    with Lightning's fields and defaults."""

    description: Any = ""
    progress_bar: Any = "#6206E0"
    progress_bar_finished: Any = "#6206E0"
    progress_bar_pulse: Any = "#6206E0"
    batch_progress: Any = ""
    time: Any = "dim"
    processing_speed: Any = "dim underline"
    metrics: Any = "italic"
    metrics_text_delimiter: str = " "
    metrics_format: str = ".3f"


class _Task:
    """One bar as the ``ProgressBar`` logic drives a tqdm bar (``n``, ``total``, ``update``, ``set_postfix``,
    ``refresh``, ``close``), drawn as a task of rich's live ``Progress``."""

    mininterval = 0.0  # rich's thread paces the drawing: every metrics update is handed over

    def __init__(self, owner: RichProgressBar, total: float, desc: str, leave: bool) -> None:
        self.owner, self.leave = owner, leave
        self.total = None if total == math.inf else int(total)
        self.n = 0
        self._metrics = ""
        progress = owner.progress
        assert progress is not None
        style = owner.theme.description
        self.task_id = progress.add_task(f"[{style}]{desc}" if style else desc, total=self.total, metrics="")

    def update(self, n: int = 1) -> None:
        self.n += n
        self.refresh()

    def set_postfix(self, values: dict[str, str], refresh: bool = True) -> None:
        self._metrics = self.owner.theme.metrics_text_delimiter.join(f"{k}: {v}" for k, v in values.items())
        if refresh:
            self.refresh()

    def refresh(self) -> None:
        if self.owner.progress is not None:
            self.owner.progress.update(self.task_id, completed=self.n, metrics=self._metrics)

    def close(self) -> None:
        progress = self.owner.progress
        if progress is None:
            return
        self.refresh()
        if not self.leave:
            progress.update(self.task_id, visible=False)


class RichProgressBar(ProgressBar):
    """Progress drawn with ``rich`` (Lightning's ``RichProgressBar``, same arguments).

    Args:
        refresh_rate: redraws per second (0 turns progress output off).
        leave: keep each finished epoch's bar on screen.
        theme: the styles of the bar's parts.
        console_kwargs: arguments for the ``rich.console.Console`` it draws on (``file``, ``width``,
            ``force_terminal``, ...); by default rich's console on stdout.

    Raises:
        ImportError: when ``rich`` is not installed.
    """

    def __init__(
        self,
        refresh_rate: int = 100,
        leave: bool = False,
        theme: RichProgressBarTheme | None = None,
        console_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if importlib.util.find_spec("rich") is None:
            raise ImportError(
                "RichProgressBar needs the rich package, which is not installed. Install it with "
                "`pip install 'ember[rich]'` (or `pip install rich`), or use TQDMProgressBar."
            )
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ValueError(
                f"refresh_rate (redraws per second) must be a non-negative int (0 turns progress off), "
                f"got {refresh_rate!r}."
            )
        if console_kwargs is not None and not isinstance(console_kwargs, dict):
            raise TypeError(f"console_kwargs must be a dict of rich Console arguments, got {console_kwargs!r}.")
        # Every batch goes to the bar; rich's thread redraws `refresh_rate` times a second.
        super().__init__(refresh_rate=1 if refresh_rate else 0, leave=leave, mode="bar")
        self.rich_refresh_rate = refresh_rate
        self.theme = theme if theme is not None else RichProgressBarTheme()
        self.console_kwargs = dict(console_kwargs or {})
        self.progress: Any = None  # rich's Progress while a run draws
        self._standalone = False  # the bar being made belongs to a validate / test / predict run

    def __deepcopy__(self, memo: dict[int, Any]) -> RichProgressBar:
        new = super().__deepcopy__(memo)
        assert isinstance(new, RichProgressBar)
        new.progress = None
        return new

    def setup(self, trainer: Any, module: Any, stage: Stage) -> None:
        super().setup(trainer, module, stage)
        self._lines = False  # rich decides itself how to draw on a terminal or a file

    def _start(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            ProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        theme = self.theme

        class Speed(ProgressColumn):
            def render(self, task: Any) -> Text:
                return Text(f"{task.speed:>.2f}it/s" if task.speed else "", style=theme.processing_speed)

        self.progress = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(
                complete_style=theme.progress_bar,
                finished_style=theme.progress_bar_finished,
                pulse_style=theme.progress_bar_pulse,
            ),
            TextColumn("{task.completed}/{task.total}", style=theme.batch_progress),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            Speed(),
            TextColumn("{task.fields[metrics]}", style=theme.metrics),
            console=Console(**self.console_kwargs),
            auto_refresh=True,
            refresh_per_second=max(self.rich_refresh_rate, 1),
        )
        self.progress.start()

    def _eval_start(self, trainer: Any, desc: str, total: float) -> None:
        # As Lightning's rich bar: a validate / test / predict run's bar stays on screen when it ends.
        self._standalone = trainer.state != "fitting"  # not a validation (or sanity check) inside a fit
        super()._eval_start(trainer, desc, total)

    def _bar(self, total: float, desc: str, leave: bool, position: int = 0) -> Any:
        if self.progress is None:
            self._start()
        standalone, self._standalone = self._standalone, False
        return _Task(self, total, desc, leave or standalone)

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """``print`` (as Lightning's rich bar): while the live display draws, rich puts stdout above it."""
        print(*args, sep=sep, **kwargs)

    def _close(self, trainer: Any) -> None:
        # Stop the live display first, so its last frame (the finished bars) stays on screen.
        progress, self.progress = self.progress, None
        if progress is not None:
            progress.refresh()
            progress.stop()
        super()._close(trainer)
