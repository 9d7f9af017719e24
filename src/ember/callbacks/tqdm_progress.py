"""TQDMProgressBar: ember's progress bar under the name, arguments and tqdm hooks of Lightning's default bar.

A Lightning script that builds ``TQDMProgressBar(refresh_rate=10)`` runs unchanged; the display is
ember's ``ProgressBar`` (tqdm in a terminal, timed lines in a log file). What Lightning's class adds
on top is the way to restyle its tqdm bars: each bar of a run comes from one ``init_*_tqdm`` method
(training, sanity check, validation, test, predict), and the bar it returns is the one the callback
updates. A subclass that overrides one of them asks for tqdm bars, so ``mode="auto"`` draws bars
even when the output is not a terminal (as Lightning always does).

The callback still owns what a bar *says*: the description (the ``*_description`` words, "Epoch 3/9"
for training) and the count are set on the returned bar when it opens and at each epoch. Override the
``*_description`` properties to change the words, ``init_*_tqdm`` to change the bar.

``train_progress_bar`` and friends give the bar of the last run of their stage, open or finished, as
Lightning's do; they are left out of a pickle (tqdm bars cannot be pickled).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from ember.callbacks.progress_bar import RUN_ATTRS, ProgressBar, _tqdm_class
from ember.types import Stage

# The hooks a subclass overrides to restyle the bars, and the reference each stage's bar is kept in.
_INIT = {
    "train": "init_train_tqdm",
    "sanity": "init_sanity_tqdm",
    "validate": "init_validation_tqdm",
    "test": "init_test_tqdm",
    "predict": "init_predict_tqdm",
}
_KEPT = {
    "train": "_train_progress_bar",
    "sanity": "_val_progress_bar",  # as Lightning: the sanity check draws on the validation bar's reference
    "validate": "_val_progress_bar",
    "test": "_test_progress_bar",
    "predict": "_predict_progress_bar",
}


def _minimum_refresh_rate(refresh_rate: int) -> int:
    """``refresh_rate`` raised to ``TQDM_MINITERS`` (tqdm's own variable for "update every n iterations") when set.

    Unlike Lightning, a bar turned off with ``refresh_rate=0`` stays off: the variable paces bars, it does not
    turn them on.
    """
    value = os.environ.get("TQDM_MINITERS")
    if value is None or refresh_rate == 0:
        return refresh_rate
    try:
        minimum = int(value)
    except ValueError:
        raise ValueError(
            f"The TQDM_MINITERS environment variable must be a whole number of batches, got {value!r}: "
            "set it to e.g. 10, or unset it."
        ) from None
    return max(refresh_rate, minimum)


class TQDMProgressBar(ProgressBar):
    """ember's ``ProgressBar`` with Lightning's ``TQDMProgressBar`` arguments and hooks.

    Args:
        refresh_rate: update the bars every n batches (0 disables progress output). When the
            ``TQDM_MINITERS`` environment variable is set, the bars update at most every that many batches.
        process_position: how many runs' bars are drawn above this one's: each run takes two lines (its
            training bar and, under it, the validation bar), so the bars start on line ``2 * process_position``.
        leave: keep each finished epoch's bar on screen (a new bar per epoch); by default (Lightning's: False)
            one training bar is reset at each epoch, and the last epoch's stays when the fit ends.
        **kwargs: ``ProgressBar``'s other arguments (``mode``, ``line_interval``, ``stream``).

    Example::

        class WideBars(TQDMProgressBar):
            def init_train_tqdm(self):
                bar = super().init_train_tqdm()
                bar.bar_format = "{desc}: {n_fmt}/{total_fmt} {bar} {postfix}"
                return bar
    """

    # Lightning's layout: the rate always in it/s (tqdm's default flips to s/it on slow steps).
    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"
    _RUN_ATTRS: ClassVar[tuple[str, ...]] = (*RUN_ATTRS, *dict.fromkeys(_KEPT.values()))

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False, **kwargs: Any) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave, **kwargs)
        if isinstance(process_position, bool) or not isinstance(process_position, int) or process_position < 0:
            raise ValueError(f"process_position must be a non-negative int, got {process_position!r}.")
        self.refresh_rate = _minimum_refresh_rate(refresh_rate)
        self.process_position = process_position
        self._train_progress_bar: Any = None
        self._val_progress_bar: Any = None
        self._test_progress_bar: Any = None
        self._predict_progress_bar: Any = None

    def setup(self, trainer: Any, module: Any, stage: Stage) -> None:
        super().setup(trainer, module, stage)
        if self.mode == "auto" and self.is_line_mode and self._restyles_bars():
            self._lines = False  # the subclass asked for tqdm bars: draw them, terminal or not

    def _restyles_bars(self) -> bool:
        cls = type(self)
        return any(getattr(cls, name) is not getattr(TQDMProgressBar, name) for name in _INIT.values())

    # ------------------------------------------------------------------ the bars of a run
    def _tqdm(self, desc: str, line: int, leave: bool) -> Any:
        return _tqdm_class()(
            desc=desc,
            position=2 * self.process_position + line,
            leave=leave,
            dynamic_ncols=True,
            file=self._stream,
            mininterval=0.1,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def init_sanity_tqdm(self) -> Any:
        """The bar of the sanity check (under the training bar's line, gone when the check ends).

        Override it to restyle that bar; the bar it returns is the one the check updates.
        """
        return self._tqdm(self._sanity_desc(), line=0, leave=False)

    def init_train_tqdm(self) -> Any:
        """The training bar: one per fit, reset at each epoch (one per epoch with ``leave=True``).

        Override it to restyle the bar; the bar it returns is the one training updates.
        """
        return self._tqdm(self.train_description, line=0, leave=True)

    def init_validation_tqdm(self) -> Any:
        """The validation bar: under the training bar and gone when it is full inside a fit; on the first line
        and kept on screen in ``trainer.validate``.

        Override it to restyle the bar; the bar it returns is the one validation updates.
        """
        in_fit = self.trainer.state == "fitting"
        return self._tqdm(self.validation_description, line=int(in_fit), leave=not in_fit)

    def init_test_tqdm(self) -> Any:
        """The bar of ``trainer.test``, kept on screen when it ends.

        Override it to restyle the bar; the bar it returns is the one testing updates.
        """
        return self._tqdm(self.test_description, line=0, leave=True)

    def init_predict_tqdm(self) -> Any:
        """The bar of ``trainer.predict``, kept on screen when it ends.

        Override it to restyle the bar; the bar it returns is the one prediction updates.
        """
        return self._tqdm(self.predict_description, line=0, leave=True)

    def _bar(self, stage: str, total: float, desc: str, leave: bool, position: int = 0) -> Any:
        # The stage's init_*_tqdm decides the bar's look, place and `leave`; the callback sets its words and count.
        bar = getattr(self, _INIT[stage])()
        bar.set_description(desc, refresh=False)
        bar.reset(total=total)  # tqdm's reset: an infinite total is "unknown"
        setattr(self, _KEPT[stage], bar)
        return bar

    # ------------------------------------------------------------------ Lightning's references to the bars
    def _kept(self, name: str) -> Any:
        bar = getattr(self, f"_{name}")
        if bar is None:
            raise TypeError(
                f"The `{type(self).__name__}._{name}` reference has not been set yet: the bar is made when a run "
                "draws it (in bar mode, with refresh_rate above 0, on global rank zero)."
            )
        return bar

    def _replace(self, name: str, bar: Any) -> None:
        """Set a reference; a bar being drawn now is replaced by the new one, which the run then updates."""
        old = getattr(self, f"_{name}")
        setattr(self, f"_{name}", bar)
        if old is not None and self._train is old:
            self._train = bar
        if old is not None and self._eval is old:
            self._eval = bar

    @property
    def train_progress_bar(self) -> Any:
        """The training bar of the last fit (open while it runs, closed after).

        Raises:
            TypeError: when no training bar has been drawn yet.
        """
        return self._kept("train_progress_bar")

    @train_progress_bar.setter
    def train_progress_bar(self, bar: Any) -> None:
        self._replace("train_progress_bar", bar)

    @property
    def val_progress_bar(self) -> Any:
        """The bar of the last validation, or of the sanity check while it runs.

        Raises:
            TypeError: when no validation bar has been drawn yet.
        """
        return self._kept("val_progress_bar")

    @val_progress_bar.setter
    def val_progress_bar(self, bar: Any) -> None:
        self._replace("val_progress_bar", bar)

    @property
    def test_progress_bar(self) -> Any:
        """The bar of the last ``trainer.test``.

        Raises:
            TypeError: when no test bar has been drawn yet.
        """
        return self._kept("test_progress_bar")

    @test_progress_bar.setter
    def test_progress_bar(self, bar: Any) -> None:
        self._replace("test_progress_bar", bar)

    @property
    def predict_progress_bar(self) -> Any:
        """The bar of the last ``trainer.predict``.

        Raises:
            TypeError: when no predict bar has been drawn yet.
        """
        return self._kept("predict_progress_bar")

    @predict_progress_bar.setter
    def predict_progress_bar(self, bar: Any) -> None:
        self._replace("predict_progress_bar", bar)
