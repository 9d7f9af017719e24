"""Progress on global rank zero: tqdm bars in a terminal, compact timed lines everywhere else.

When stdout is a terminal, tqdm bars show the epoch, the step, it/s and the ``prog_bar`` metrics,
with a separate validation bar that fills up before it goes. When stdout is a file or a pipe (CI,
SLURM, ``nohup``), redrawing a bar would fill the log with carriage returns, so instead one
compact line is printed every ``line_interval`` seconds, plus one at the end of each epoch.

Inside ``fit`` each epoch ends in ONE line, "Epoch 3/9 done ...", which carries the validation
metrics of the validation that closed the epoch (its own "Validation done" line is folded into it).
A validation in the middle of an epoch (``val_check_interval`` < 1) keeps its own line, and so does
a standalone ``validate`` / ``test`` / ``predict``. An epoch that did not validate shows no
validation metric: the values of an earlier validation are left out rather than shown as new.

Epochs are numbered from 0, as ``trainer.current_epoch`` and the ``epoch=N`` of checkpoint names,
in both modes: "Epoch 3/9" is epoch 3 of 0..9, so the last of 10 epochs reads "Epoch 9/9" (as
Lightning's rich bar; without an epoch limit, just "Epoch 3").

Per-step cost is a counter and, at most every ``refresh_rate`` batches, a clock read. The
metrics (which live on the device) are converted to numbers only when something is printed.

A bar can be pickled (inside a pickled or ``torch.save``-d Trainer): its settings go along, the bars of
a run and its stream do not (neither can be pickled); once loaded it writes to ``sys.stdout``.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from typing import Any, ClassVar, TextIO

from ember.callbacks.progress_members import ProgressBarMembers
from ember.metric_values import to_floats
from ember.types import Stage

_MODES = ("auto", "bar", "lines")
_SHARED = ("_given_stream", "_stream", "_trainer")  # a copy writes where the original does, for the same trainer
RUN_ATTRS = ("_train", "_eval", "_val_pending")  # the bars of a running loop (subclasses add theirs)


def _fmt(value: Any) -> str:
    """A float to 4 significant digits; an int ("v_num"), a string or anything else as it is."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _rate(rate: float) -> str:
    return f"{rate:.2f}" if rate < 10 else f"{rate:.1f}" if rate < 100 else f"{rate:.0f}"


def _epoch_desc(trainer: Any) -> str:
    """ "Epoch 3/9": epoch 3 of 0..9 (0-based, as ``current_epoch``); "Epoch 3" without an epoch limit."""
    last = f"/{trainer.max_epochs - 1}" if trainer.max_epochs is not None and trainer.max_epochs > 0 else ""
    return f"Epoch {trainer.current_epoch}{last}"


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


_TQDM: Any = None


def _tqdm_class() -> Any:
    """tqdm without its monitor thread (it tunes ``miniters``; this callback paces redraws itself)."""
    global _TQDM
    if _TQDM is None:
        from tqdm.auto import tqdm

        class _Tqdm(tqdm):
            monitor_interval = 0

        _TQDM = _Tqdm
    return _TQDM


class _Span:
    """Line-mode state of one running loop (a training epoch, or one evaluation)."""

    __slots__ = ("head", "total", "t0", "n0", "last_t", "last_n", "next_t", "n")

    def __init__(self, head: str, total: float, n: int, interval: float) -> None:
        now = time.monotonic()
        self.head, self.total, self.n, self.n0 = head, total, n, n  # n0 > 0 when resuming mid-epoch
        self.t0 = self.last_t = now
        self.last_n = n
        self.next_t = now + interval

    def due(self, now: float) -> bool:
        return now >= self.next_t

    def line(self, now: float, metrics: dict[str, str], interval: float, done: bool = False) -> str:
        n, total = self.n, self.total
        known = total != math.inf and total > 0
        count = f"{n}/{int(total)} ({100 * n / total:.0f}%)" if known else f"{n}"
        # the rate since the previous line (the whole span's rate for the closing line)
        since_t, since_n = (self.t0, self.n0) if done else (self.last_t, self.last_n)
        dt = now - since_t
        rate = (n - since_n) / dt if dt > 0 else 0.0
        eta = f"<{_hms((total - n) / rate)}" if known and rate > 0 and not done else ""
        parts = [self.head + (" done" if done else ""), count, f"{_rate(rate)} it/s", _hms(now - self.t0) + eta]
        if metrics:
            parts.append(" ".join(f"{k}={v}" for k, v in metrics.items()))
        self.last_t, self.last_n, self.next_t = now, n, now + interval
        return "  ".join(parts)


class ProgressBar(ProgressBarMembers):
    """Progress for training, validation, testing and prediction.

    Args:
        refresh_rate: update the display every n batches (0 disables progress output).
        leave: keep each finished epoch's bar on screen (bar mode).
        mode: "bar" (tqdm redraws), "lines" (one line every ``line_interval`` seconds) or "auto":
            bars when the output stream is a terminal, lines otherwise.
        line_interval: seconds between two progress lines in line mode.
        stream: where to write; the ``sys.stdout`` of the moment a run starts by default.
    """

    uses_step_outputs = False  # the loop need not build {"loss": ...} for this callback
    # Its epoch-end line runs with the callbacks that watch metrics, after the epoch's values are reduced
    # (across processes too): it shows this epoch's ``*_epoch`` values, the ones callback_metrics holds.
    monitors_metrics = True
    # What belongs to a run, not to the settings: a copy or a pickle starts without them (subclasses add theirs).
    _RUN_ATTRS: ClassVar[tuple[str, ...]] = RUN_ATTRS

    def __init__(
        self,
        refresh_rate: int = 1,
        leave: bool = True,
        mode: str = "auto",
        line_interval: float = 10.0,
        stream: TextIO | None = None,
    ) -> None:
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ValueError(f"refresh_rate must be a non-negative int (0 turns progress off), got {refresh_rate!r}.")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}.")
        if line_interval < 0:
            raise ValueError(f"line_interval must be >= 0 seconds, got {line_interval!r}.")
        self.refresh_rate = refresh_rate
        self.leave = leave
        self.mode = mode
        self.line_interval = line_interval
        self._given_stream = stream
        self._stream: TextIO = stream or sys.stdout
        self._lines = False
        self._enabled = True  # disable() / enable(); off on the ranks other than zero
        self._alive = True  # the stream accepts writes (False once it went away)
        self._trainer: Any = None
        self._current_eval_dataloader_idx: int | None = None
        self._train: Any = None  # a tqdm bar, or a _Span in line mode
        self._last_draw = 0.0
        self._eval: Any = None
        # Line mode inside fit: the validation that ends an epoch is folded into the epoch's line.
        self._val_pending: tuple[_Span, float, dict[str, Any]] | None = None  # its line, printed if batches follow
        self._validated = False  # this epoch validated
        self._before_val: dict[str, Any] = {}  # the progress-bar metrics when the validation started
        self._val_values: dict[str, Any] = {}  # the values the last validation set (left out once stale)

    def __deepcopy__(self, memo: dict[int, Any]) -> ProgressBar:
        """A copy (``copy.deepcopy(trainer.callbacks)``, as Lightning's bars allow) that writes to the same stream
        (a stream cannot be copied) and has no bar open: the original's bars belong to its own run."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key in _SHARED:
                new.__dict__[key] = value
            elif key in self._RUN_ATTRS:
                new.__dict__[key] = None
            else:
                new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    def __copy__(self) -> ProgressBar:
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)  # a shallow copy shares all, the stream and open bars too
        return new

    def __getstate__(self) -> dict[str, Any]:
        """The settings, without the run's bars and the stream: neither can be pickled."""
        state = {k: None if k in self._RUN_ATTRS else v for k, v in self.__dict__.items()}
        state["_given_stream"] = state["_stream"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stream = sys.stdout

    @property
    def is_line_mode(self) -> bool:
        """Whether this run prints timed lines (True) or tqdm bars (False)."""
        return self._lines

    def setup(self, trainer: Any, module: Any, stage: Stage) -> None:
        self._trainer = trainer
        self._stream = self._given_stream or sys.stdout
        self._alive = True
        if not trainer.is_global_zero:
            self.disable()
        if self.mode == "auto":
            isatty = getattr(self._stream, "isatty", None)
            try:
                self._lines = not (callable(isatty) and isatty())
            except (ValueError, OSError):  # a closed or detached stream
                self._lines = True
        else:
            self._lines = self.mode == "lines"

    @property
    def _batch_interval(self) -> int:
        """Batches between two updates of a bar (``refresh_rate`` here; rich's bar counts seconds instead)."""
        return self.refresh_rate

    @property
    def _shows(self) -> bool:
        """Whether new output is drawn: enabled, ``refresh_rate`` above 0, and the stream still there."""
        return self._enabled and self._alive and self.refresh_rate > 0

    def _postfix(self, trainer: Any, raw: dict[str, Any] | None = None) -> dict[str, str]:
        """The items shown, from ``get_metrics`` (an override takes effect). ``raw``, line mode's snapshot or
        selection of the ``prog_bar`` metrics, replaces those metrics: its values, and none that it leaves out."""
        items: dict[str, Any] = self.get_metrics(trainer, trainer.lightning_module)
        if raw is not None:
            current = trainer.progress_bar_metrics
            snapshot = to_floats(raw)
            items = {k: snapshot.get(k, v) for k, v in items.items() if k in snapshot or k not in current}
        return {k: _fmt(v) for k, v in items.items()}

    def _flush_validation(self, trainer: Any) -> None:
        """Print the line of a validation that training continued after (one in mid-epoch)."""
        pending, self._val_pending = self._val_pending, None
        if pending is not None and self._shows:
            span, now, raw = pending
            self._print(span.line(now, self._postfix(trainer, raw), self.line_interval, done=True))

    def _print(self, line: str) -> None:
        try:
            self._stream.write(line + "\n")
            self._stream.flush()
        except (ValueError, OSError):  # the stream went away (a closed pipe): progress is not worth a crash
            self._alive = False

    def _bar(self, stage: str, total: float, desc: str, leave: bool, position: int = 0) -> Any:
        """A new bar for ``stage`` ("train", "sanity", "validate", "test" or "predict"), bar mode only."""
        return _tqdm_class()(
            total=None if total == math.inf else int(total),
            desc=desc,
            leave=leave,
            position=position,
            dynamic_ncols=True,
            file=self._stream,
            mininterval=0.1,
            smoothing=0,
        )

    # ------------------------------------------------------------------ training
    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if not self._shows:
            return
        if self._lines:
            self._val_pending, self._validated = None, False
            self._train = _Span(
                _epoch_desc(trainer), trainer.num_training_batches, trainer.progress.batch_in_epoch, self.line_interval
            )
            return
        total, desc, bar = trainer.num_training_batches, _epoch_desc(trainer), self._train
        if bar is not None and not self.leave:  # without `leave`, one bar for the whole fit, reset each epoch
            bar.set_description(desc, refresh=False)
            bar.reset(total=total)  # tqdm's reset: an infinite total is "unknown"
        else:
            if bar is not None:
                bar.close()
            bar = self._train = self._bar("train", total, desc, self.leave)
        bar.update(trainer.progress.batch_in_epoch)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._val_pending is not None:  # a validation in mid-epoch: training went on, so it gets its line
            self._flush_validation(trainer)
        bar = self._train
        if bar is None or not self._enabled or (batch_idx + 1) % self._batch_interval:
            return
        if self._lines:
            bar.n = batch_idx + 1
            now = time.monotonic()
            if now >= bar.next_t:  # bar.due(now), inlined: this runs every batch
                self._print(bar.line(now, self._postfix(trainer), self.line_interval))
            return
        bar.n = batch_idx + 1
        # Redraw at most every `mininterval` seconds; only then are metrics converted to numbers.
        # (tqdm's own `last_print_t` is not advanced by refresh(), so it cannot be the clock here.)
        now = time.monotonic()
        if now - self._last_draw >= bar.mininterval:
            self._last_draw = now
            bar.set_postfix(self._postfix(trainer), refresh=False)
            bar.refresh()

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        bar = self._train
        if bar is None or not self._shows:
            if self._val_pending is not None:  # no epoch line (an epoch resumed in its middle): its own line
                self._flush_validation(trainer)
            return
        bar.n = trainer.progress.batch_in_epoch
        if self._lines:
            self._val_pending = None  # the epoch's line below carries that validation's metrics
            raw = trainer.progress_bar_metrics
            if not self._validated and self._val_values:  # leave out an earlier validation's values
                raw = {k: v for k, v in raw.items() if k not in self._val_values or v is not self._val_values[k]}
            self._print(bar.line(time.monotonic(), self._postfix(trainer, raw), self.line_interval, done=True))
            self._train = None
            return
        bar.set_postfix(self._postfix(trainer), refresh=False)
        bar.refresh()

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self._close(trainer)

    # ------------------------------------------------------------------ evaluation
    def _eval_start(self, trainer: Any, stage: str, desc: str, total: float) -> None:
        self._current_eval_dataloader_idx = None
        if not self._shows:
            return
        if self._lines:
            self._eval = _Span(desc, total, 0, self.line_interval)
            if _in_fit(trainer):
                self._before_val = dict(trainer.progress_bar_metrics)
            return
        # Inside fit the validation bar sits under the epoch's bar and goes away once full.
        # The sanity check's bar goes too; a standalone validate/test/predict bar stays if ``leave``.
        leave = self.leave and trainer.state != "fitting"
        self._eval = self._bar(stage, total, desc, leave=leave, position=1 if _in_fit(trainer) else 0)

    def _eval_step(self, trainer: Any, batch_idx: int) -> None:
        bar = self._eval
        every = self._batch_interval
        if bar is None or not self._enabled or (batch_idx + 1) % every:
            return
        if self._lines:
            bar.n += every
            now = time.monotonic()
            if now >= bar.next_t:  # bar.due(now), inlined: this runs every batch
                self._print(bar.line(now, {}, self.line_interval))
            return
        bar.update(every)

    def _eval_end(self, trainer: Any, show_metrics: bool) -> None:
        self._current_eval_dataloader_idx = None
        bar = self._eval
        if bar is None:
            return
        self._eval = None
        if self._lines:
            if bar.total != math.inf:
                bar.n = int(bar.total)
            if _in_fit(trainer):  # a validation inside fit: its line waits (see on_train_epoch_end)
                raw = trainer.progress_bar_metrics
                before, self._before_val = self._before_val, {}
                self._val_values = {k: v for k, v in raw.items() if k not in before or before[k] is not v}
                self._validated = True
                self._val_pending = (bar, time.monotonic(), dict(raw))
            elif not trainer.sanity_checking and self._shows:
                metrics = self._postfix(trainer) if show_metrics else {}
                self._print(bar.line(time.monotonic(), metrics, self.line_interval, done=True))
            return
        if bar.total is not None:
            bar.n = bar.total  # a finished evaluation shows a full bar
        bar.refresh()
        bar.close()

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        if trainer.sanity_checking:
            self._eval_start(trainer, "sanity", self._sanity_desc(), sum(trainer.num_sanity_val_batches))
        else:
            self._eval_start(trainer, "validate", self.validation_description, sum(trainer.num_val_batches))

    def _sanity_desc(self) -> str:
        """ember's "Sanity check", or the ``sanity_check_description`` of a subclass that overrides it."""
        overridden = type(self).sanity_check_description is not ProgressBarMembers.sanity_check_description
        return self.sanity_check_description if overridden else "Sanity check"

    def on_validation_batch_start(
        self, trainer: Any, module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.has_dataloader_changed(dataloader_idx)

    def on_validation_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._eval_step(trainer, batch_idx)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        self._eval_end(trainer, show_metrics=True)

    def on_test_start(self, trainer: Any, module: Any) -> None:
        self._eval_start(trainer, "test", self.test_description, sum(trainer.num_test_batches))

    def on_test_batch_start(
        self, trainer: Any, module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.has_dataloader_changed(dataloader_idx)

    def on_test_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._eval_step(trainer, batch_idx)

    def on_test_end(self, trainer: Any, module: Any) -> None:
        self._eval_end(trainer, show_metrics=True)

    def on_predict_start(self, trainer: Any, module: Any) -> None:
        self._eval_start(trainer, "predict", self.predict_description, sum(trainer.num_predict_batches))

    def on_predict_batch_start(
        self, trainer: Any, module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.has_dataloader_changed(dataloader_idx)

    def on_predict_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._eval_step(trainer, batch_idx)

    def on_predict_end(self, trainer: Any, module: Any) -> None:
        self._eval_end(trainer, show_metrics=False)

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """Print without breaking a bar being drawn (through ``tqdm.write``); to the bar's stream otherwise."""
        kwargs.setdefault("file", self._stream)
        bar = next((b for b in (self._train, self._eval) if b is not None and not self._lines), None)
        if bar is not None and hasattr(bar, "write"):  # a tqdm bar (rich's bar prints through its console)
            bar.write(sep.join(map(str, args)), **kwargs)
        else:
            print(*args, sep=sep, **kwargs)

    def _close(self, trainer: Any) -> None:
        if self._val_pending is not None:  # a validation whose epoch did not end (a failure right after it)
            self._flush_validation(trainer)
        for bar in (self._train, self._eval):
            if bar is not None and not self._lines:
                bar.close()
        self._train = self._eval = None

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        self._close(trainer)

    def teardown(self, trainer: Any, module: Any, stage: Stage) -> None:
        self._close(trainer)


def _in_fit(trainer: Any) -> bool:
    """In a fit, not its sanity check (a validation inside fit included: ``trainer.training`` is False there)."""
    return trainer.state == "fitting" and not trainer.sanity_checking
