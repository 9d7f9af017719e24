"""RichProgressBar: the progress bar drawn with ``rich``, under Lightning's name and arguments.

It is ember's ``ProgressBar`` with another display: the same bars, updated at the same points and
showing the same ``prog_bar`` metrics; only the drawing is rich's (a live display refreshed
``refresh_rate`` times a second by rich's thread, as in Lightning, where the tqdm bar counts batches).
``rich`` is an optional dependency (``pip install 'ember[rich]'``), imported when the first bar of a
run is drawn.

Each bar is a task of rich's ``Progress`` (``progress``), one task per stage: the training task is
reset at each epoch (as Lightning's) and the validation task at each validation, so a long fit does
not pile up hidden tasks. With ``leave=True`` a finished epoch stays on screen: the display that drew
it stops (its last frame stays) and the next epoch draws on a new one. ``progress`` and the tasks
(``train_progress_bar``, ..., and their ids) stay readable after the run, until the next run draws.
``configure_columns`` gives the columns (override it to change them); the metrics column follows them.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ember.callbacks.progress_bar import RUN_ATTRS, ProgressBar
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


# The id attribute of each stage's task (Lightning's names).
_TASK_IDS = {
    "train": "train_progress_bar_id",
    "sanity": "val_sanity_progress_bar_id",
    "validate": "val_progress_bar_id",
    "test": "test_progress_bar_id",
    "predict": "predict_progress_bar_id",
}


def _rich_total(total: float | None) -> int | None:
    return None if total is None or total == math.inf else int(total)


class _Task:
    """One stage's task of rich's ``Progress``, driven as the ``ProgressBar`` logic drives a tqdm bar (``n``,
    ``total``, ``update``, ``reset``, ``set_description``, ``set_postfix``, ``refresh``, ``close``)."""

    mininterval = 0.0  # rich's thread paces the drawing: every metrics update is handed over

    def __init__(
        self, progress: Any, task_id: Any, total: int | None, leave: bool, theme: RichProgressBarTheme
    ) -> None:
        self.progress, self.task_id, self.total, self.leave, self.theme = progress, task_id, total, leave, theme
        self.n = 0
        self._metrics = ""

    def update(self, n: int = 1) -> None:
        self.n += n
        self.refresh()

    def reset(self, total: float | None = None) -> None:
        self.n = 0
        if total is not None:
            self.total = _rich_total(total)
        self.progress.reset(self.task_id, total=self.total, visible=True)

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.progress.update(self.task_id, description=_styled(desc, self.theme), refresh=refresh)

    def set_postfix(self, values: dict[str, str], refresh: bool = True) -> None:
        self._metrics = self.theme.metrics_text_delimiter.join(f"{k}: {v}" for k, v in values.items())
        if refresh:
            self.refresh()

    def refresh(self) -> None:
        self.progress.update(self.task_id, completed=self.n, metrics=self._metrics)

    def close(self) -> None:
        self.refresh()
        if not self.leave:
            self.progress.update(self.task_id, visible=False)


def _styled(desc: str, theme: RichProgressBarTheme) -> str:
    return f"[{theme.description}]{desc}" if theme.description else desc


_SPEED: Any = None


def _speed_column() -> Any:
    """rich's column for batches a second ("12.34it/s"), built once rich is imported."""
    global _SPEED
    if _SPEED is None:
        from rich.progress import ProgressColumn
        from rich.text import Text

        class Speed(ProgressColumn):
            def __init__(self, style: Any) -> None:
                super().__init__()
                self.style = style

            def render(self, task: Any) -> Text:
                return Text(f"{task.speed:>.2f}it/s" if task.speed else "", style=self.style)

        _SPEED = Speed
    return _SPEED


class RichProgressBar(ProgressBar):
    """Progress drawn with ``rich`` (Lightning's ``RichProgressBar``, same arguments).

    Args:
        refresh_rate: redraws per second (0 turns progress output off).
        leave: keep each finished epoch's bar on screen; by default one training bar is reset at each epoch.
        theme: the styles of the bar's parts.
        console_kwargs: arguments for the ``rich.console.Console`` it draws on (``file``, ``width``,
            ``force_terminal``, ...); by default rich's console on stdout.

    Raises:
        ImportError: when ``rich`` is not installed.
    """

    _RUN_ATTRS: ClassVar[tuple[str, ...]] = (*RUN_ATTRS, "progress")

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
        super().__init__(refresh_rate=refresh_rate, leave=leave, mode="bar")
        self.theme = theme if theme is not None else RichProgressBarTheme()
        self.console_kwargs = dict(console_kwargs or {})
        self.progress: Any = None  # rich's Progress: drawing during a run, stopped (and still readable) after it
        self.train_progress_bar_id: Any = None
        self.val_sanity_progress_bar_id: Any = None
        self.val_progress_bar_id: Any = None
        self.test_progress_bar_id: Any = None
        self.predict_progress_bar_id: Any = None
        self._standalone = False  # the bar being made belongs to a validate / test / predict run

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # a console's file is a stream, which cannot be pickled: the loaded bar draws on stdout
        state["console_kwargs"] = {k: v for k, v in self.console_kwargs.items() if k != "file"}
        return state

    @property
    def refresh_rate(self) -> int:
        """Redraws per second (0: progress is off)."""
        return self._refresh_per_second

    @refresh_rate.setter
    def refresh_rate(self, value: int) -> None:
        self._refresh_per_second = value

    @property
    def _batch_interval(self) -> int:
        return 1  # every batch goes to the task; rich's thread redraws `refresh_rate` times a second

    def setup(self, trainer: Any, module: Any, stage: Stage) -> None:
        super().setup(trainer, module, stage)
        self._lines = False  # rich decides itself how to draw on a terminal or a file

    # ------------------------------------------------------------------ the display
    def configure_columns(self, trainer: Any) -> list[Any]:
        """The columns of every bar, before the metrics column: the description, the bar, "done/total", the
        elapsed and remaining time and the speed. Override it to draw other columns (rich ``ProgressColumn``s,
        or format strings such as ``"{task.completed} batches"``).

        Args:
            trainer: the trainer the bars are drawn for.
        """
        from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        theme = self.theme
        return [
            TextColumn("[progress.description]{task.description}"),
            BarColumn(
                complete_style=theme.progress_bar,
                finished_style=theme.progress_bar_finished,
                pulse_style=theme.progress_bar_pulse,
            ),
            TextColumn("{task.completed}/{task.total}", style=theme.batch_progress),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            _speed_column()(theme.processing_speed),
        ]

    @property
    def _drawing(self) -> bool:
        return self.progress is not None and self.progress.live.is_started

    def _start(self) -> None:
        from rich.console import Console
        from rich.progress import Progress, TextColumn

        self.progress = Progress(
            *self.configure_columns(self.trainer),
            TextColumn("{task.fields[metrics]}", style=self.theme.metrics),
            console=Console(**self.console_kwargs),
            auto_refresh=True,
            refresh_per_second=max(self.refresh_rate, 1),
        )
        for attr in _TASK_IDS.values():  # the tasks of the display before are not in this one
            setattr(self, attr, None)
        self.progress.start()

    def _stop(self) -> None:
        """Stop the live display (its last frame stays on screen); ``progress`` stays readable."""
        if self._drawing:
            self.progress.refresh()
            self.progress.stop()

    def refresh(self, hard: bool = False) -> None:
        """Redraw the display now rather than at rich's next tick (nothing when no run draws).

        Args:
            hard: accepted for Lightning's signature; ember's redraw is always a full one.
        """
        if self._drawing:
            self.progress.refresh()

    def _eval_start(self, trainer: Any, stage: str, desc: str, total: float) -> None:
        # As Lightning's rich bar: a validate / test / predict run's bar stays on screen when it ends.
        self._standalone = trainer.state != "fitting"  # not a validation (or sanity check) inside a fit
        super()._eval_start(trainer, stage, desc, total)

    def _bar(self, stage: str, total: float, desc: str, leave: bool, position: int = 0) -> Any:
        if stage == "train" and self.train_progress_bar_id is not None:
            self._stop()  # a new epoch under `leave`: the finished one stays on screen, the next draws below it
        if not self._drawing:
            self._start()
        standalone, self._standalone = self._standalone, False
        progress, attr, count = self.progress, _TASK_IDS[stage], _rich_total(total)
        task_id = getattr(self, attr)
        if task_id is None:  # the stage's first bar on this display
            task_id = progress.add_task(_styled(desc, self.theme), total=count, metrics="")
            setattr(self, attr, task_id)
        else:  # the stage's task again (the next validation): reset, not one more task
            progress.reset(task_id, total=count, description=_styled(desc, self.theme), visible=True)
        return _Task(progress, task_id, count, leave or standalone, self.theme)

    # ------------------------------------------------------------------ Lightning's references to the tasks
    def _task(self, task_id: Any, name: str) -> Any:
        if self.progress is not None and task_id is not None:
            for task in self.progress.tasks:
                if task.id == task_id:
                    return task
        raise TypeError(
            f"`{type(self).__name__}.{name}` is not there yet: the task is made when a run draws that bar (with "
            "refresh_rate above 0, on global rank zero), and a new run's display starts without the old tasks."
        )

    @property
    def train_progress_bar(self) -> Any:
        """rich's ``Task`` of the training bar (of the last fit, while its display is the latest).

        Raises:
            TypeError: when there is none.
        """
        return self._task(self.train_progress_bar_id, "train_progress_bar")

    @property
    def val_sanity_check_bar(self) -> Any:
        """rich's ``Task`` of the sanity check's bar.

        Raises:
            TypeError: when there is none.
        """
        return self._task(self.val_sanity_progress_bar_id, "val_sanity_check_bar")

    @property
    def val_progress_bar(self) -> Any:
        """rich's ``Task`` of the validation bar.

        Raises:
            TypeError: when there is none.
        """
        return self._task(self.val_progress_bar_id, "val_progress_bar")

    @property
    def test_progress_bar(self) -> Any:
        """rich's ``Task`` of the test bar.

        Raises:
            TypeError: when there is none.
        """
        return self._task(self.test_progress_bar_id, "test_progress_bar")

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """``print`` (as Lightning's rich bar): while the live display draws, rich puts stdout above it."""
        print(*args, sep=sep, **kwargs)

    def _close(self, trainer: Any) -> None:
        self._stop()  # first, so that its last frame (the finished bars) stays on screen
        super()._close(trainer)
