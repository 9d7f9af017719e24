"""CSVLogger: ``metrics.csv`` and ``hparams.yaml`` under ``<save_dir>/<name>/version_N/``."""

from __future__ import annotations

import csv
import io
import os
from typing import Any

import torch

from ember.loggers.file_logger import FileLogger


class CSVLogger(FileLogger):
    """Write metrics to ``<save_dir>/<name>/version_N/metrics.csv``, one row per logged step.

    Columns are ``step`` then every metric name in the order it first appeared. When a new name
    appears mid-run the file is rewritten with the wider header, so earlier rows are kept (their
    new cells empty). Several ``log_metrics`` calls at one step (step metrics, validation, epoch
    metrics) fill one row, even when the row was already written: the file's last row is then
    rewritten with the merged values. A fit resumed from a checkpoint drops the rows from the
    checkpoint's step on (``FileLogger.rewind``), so each step keeps one row however often the run
    was killed and resumed. A rewrite that could lose rows if the process died halfway (a wider
    header, dropped rows, a last row that gets shorter) goes to a temporary file renamed over
    ``metrics.csv`` once complete; the others append or extend the file's end.

    Args:
        save_dir, name, version, prefix: see the directory scheme of ``FileLogger`` (a ``prefix`` is
            joined to each name with ``LOGGER_JOIN_CHAR``, as Lightning's: ``prefix="train"`` gives
            ``train-loss``).
        flush_logs_every_n_steps: as Lightning's: the rows are written to disk when a ``log_metrics``
            call's step is one before a multiple of it (``(step + 1) % n == 0``), and always at the end
            of a run or on an error, or when ``save()`` is called.
    """

    METRICS_FILE = "metrics.csv"

    def __init__(
        self,
        save_dir: str | os.PathLike[str] | None = None,
        name: str = "ember_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        super().__init__(save_dir, name, version, prefix)
        if not isinstance(flush_logs_every_n_steps, int) or flush_logs_every_n_steps < 1:
            raise ValueError(f"flush_logs_every_n_steps must be a positive int, got {flush_logs_every_n_steps!r}.")
        self.flush_logs_every_n_steps = flush_logs_every_n_steps
        self._rows: list[dict[str, Any]] = []  # rows not on disk yet
        self._header: list[str] | None = None  # the header of the file on disk
        # The file's last row, where it starts (bytes), and whether a later call at its step merged values
        # into it: a step's values can arrive after its row was written (a validation, the epoch's end).
        self._tail: dict[str, Any] | None = None
        self._tail_offset = 0
        self._tail_changed = False
        self._row_count = 0  # rows added by this logger: the step of a log_metrics call that gives none
        # After a rewind, the step of the file's last row, whose values the resumed fit may log again:
        # they replace the killed run's rather than start a second row of that step.
        self._replace_at: int | None = None

    @property
    def metrics_file(self) -> str:
        return os.path.join(self.log_dir, self.METRICS_FILE)

    @property
    def experiment(self) -> CSVExperiment:
        """What Lightning's ``CSVLogger.experiment`` offers (its experiment writer): ``metrics_file_path``,
        ``log_dir``, the rows not written yet (``metrics``), ``log_metrics``, ``log_hparams``, ``save``."""
        return CSVExperiment(self)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Add ``metrics`` (numbers or scalar tensors) to the row of ``step``; without a step, a new row numbered
        by the rows this logger has added so far (0, 1, ...)."""
        if not self._writes:
            return
        if self._rewind_step is not None:
            self._drop_rows_from(self._rewind_step)
        row = {self.prefixed(k): (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
        last = self._rows[-1] if self._rows else self._tail
        if step is None:
            step = self._row_count
            self._append(step, row)
        elif (
            last is not None
            and last["step"] == step
            and (step == self._replace_at or all(last.get(k, v) == v for k, v in row.items()))
        ):
            last.update(row)
            self._tail_changed = self._tail_changed or not self._rows
        else:
            self._append(step, row)
        if (step + 1) % self.flush_logs_every_n_steps == 0:
            self.save()

    def pending_rows(self) -> list[dict[str, Any]]:
        """The rows logged and not yet written to the file, as dicts with their ``step``."""
        return [dict(row) for row in self._rows]

    def _append(self, step: int, row: dict[str, Any]) -> None:
        self._rows.append({"step": step, **row})
        self._row_count += 1
        self._replace_at = None

    def save(self) -> None:
        if not self._writes or not (self._rows or self._tail_changed):
            return
        rows = ([self._tail] if self._tail_changed and self._tail is not None else []) + self._rows
        path = self.metrics_file
        if self._header is None and os.path.exists(path):
            with open(path, newline="", encoding="utf-8") as fh:
                self._header = next(csv.reader(fh), None)
        header = list(self._header or ["step"])
        for row in rows:
            header.extend(k for k in row if k not in header)
        os.makedirs(self.log_dir, exist_ok=True)
        data, last_start = _encode_rows(header, rows)
        written = False
        if self._header is not None and header == self._header:
            with open(path, "r+b") as fh:
                end = fh.seek(0, os.SEEK_END)
                start = self._tail_offset if self._tail_changed else end
                # In place only when the new bytes cover everything after ``start``: a kill halfway then
                # leaves the rows that were there, never a cut-off row (no truncation needed).
                if start + len(data) >= end:
                    fh.seek(start)
                    fh.write(data)
                    self._tail_offset, written = start + last_start, True
        if not written:
            old: list[dict[str, str]] = []
            if self._header is not None:
                with open(path, newline="", encoding="utf-8") as fh:
                    old = list(csv.DictReader(fh))
                if self._tail_changed:
                    old = old[:-1]  # the last row is written again, with the values merged into it since
            self._tail_offset = _replace_file(path, header, old, data, last_start)
            self._header = header
        self._tail, self._tail_changed = rows[-1], False
        self._rows = []

    def _drop_rows_from(self, step: int) -> None:
        """Rewrite ``metrics.csv`` without its rows at ``step`` and later (``rewind``); its last row stays
        open for the values the resumed fit logs at that row's step."""
        self._rewind_step = None
        self.save()  # rows of this process not written yet are dropped from the file like the others
        path = self.metrics_file
        try:
            with open(path, newline="", encoding="utf-8") as fh:
                reader = csv.DictReader(fh)
                header = list(reader.fieldnames or [])
                rows = list(reader)
        except FileNotFoundError:
            return
        if "step" not in header:
            return  # not a file this logger wrote: left alone
        kept: list[dict[str, Any]] = []
        last_step: int | None = None
        for row in rows:
            row_step = _int_or_none(row.get("step"))  # (None for a row a kill cut off before its step)
            if row_step is not None and row_step < step:
                cells = {k: v for k, v in row.items() if k is not None and v not in (None, "")}
                kept.append({**cells, "step": row_step})
                last_step = row_step
        data, last_start = _encode_rows(header, kept)
        self._tail_offset = _replace_file(path, header, [], data, last_start)
        self._header, self._tail, self._tail_changed = header, (kept[-1] if kept else None), False
        self._replace_at = last_step

    def finalize(self, status: str) -> None:
        self.save()


class CSVExperiment:
    """A view of a ``CSVLogger`` under the names of Lightning's experiment writer, for code that reaches
    ``logger.experiment``. Every call goes to the logger.

    Args:
        logger: the logger it shows.
    """

    NAME_METRICS_FILE = CSVLogger.METRICS_FILE

    def __init__(self, logger: CSVLogger) -> None:
        self._logger = logger

    @property
    def log_dir(self) -> str:
        return self._logger.log_dir

    @property
    def metrics_file_path(self) -> str:
        return self._logger.metrics_file

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The rows logged and not yet written to the file (each with its ``step``)."""
        return self._logger.pending_rows()

    @property
    def hparams(self) -> dict[str, Any]:
        return self._logger.hparams

    def log_metrics(self, metrics_dict: dict[str, Any], step: int | None = None) -> None:
        self._logger.log_metrics(metrics_dict, step)

    def log_hparams(self, params: dict[str, Any]) -> None:
        self._logger.log_hyperparams(params)

    def save(self) -> None:
        self._logger.save()


def _encode_rows(header: list[str], rows: list[dict[str, Any]]) -> tuple[bytes, int]:
    """``rows`` as CSV bytes under ``header``, and where the last row starts in them (0 without rows)."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, header)
    writer.writerows(rows[:-1])
    last_start = len(text.getvalue().encode("utf-8"))
    writer.writerows(rows[-1:])
    return text.getvalue().encode("utf-8"), last_start


def _replace_file(path: str, header: list[str], old: list[dict[str, str]], data: bytes, last_start: int) -> int:
    """Write ``header``, the rows ``old`` and the encoded rows ``data`` to a temporary file, flushed to disk, then
    rename it over ``path``: a kill at any moment leaves the old file or the new one, whole. Returns where the last
    row of ``data`` starts in the new file."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, header)
        writer.writeheader()
        writer.writerows(old)
        head = text.getvalue().encode("utf-8")
        fh.write(head + data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return len(head) + last_start


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
