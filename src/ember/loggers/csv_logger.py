"""CSVLogger: ``metrics.csv`` and ``hparams.yaml`` under ``<save_dir>/<name>/version_N/``."""

from __future__ import annotations

import csv
import os
from typing import Any

import torch

from ember.loggers.file_logger import FileLogger


class CSVLogger(FileLogger):
    """Write metrics to ``<save_dir>/<name>/version_N/metrics.csv``, one row per logged step.

    Columns are ``step`` then every metric name in the order it first appeared. When a new name
    appears mid-run the file is rewritten with the wider header, so earlier rows are kept (their
    new cells empty). Several ``log_metrics`` calls at one step (step metrics, validation, epoch
    metrics) fill one row.

    Args:
        save_dir, name, version, prefix: see the directory scheme of ``FileLogger``.
        flush_logs_every_n_steps: write buffered rows to disk after this many rows (and always at
            the end of a run or on an error).
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
        self._rows: list[dict[str, Any]] = []
        self._header: list[str] | None = None  # the header of the file on disk
        self._row_count = 0  # rows added by this logger: the step of a log_metrics call that gives none

    @property
    def metrics_file(self) -> str:
        return os.path.join(self.log_dir, self.METRICS_FILE)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Add ``metrics`` (numbers or scalar tensors) to the row of ``step``; without a step, a new row numbered
        by the rows this logger has added so far (0, 1, ...)."""
        if not self._writes:
            return
        row = {self.prefix + k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
        last = self._rows[-1] if self._rows else None
        if step is None:
            step = self._row_count
        elif last is not None and last["step"] == step and all(last.get(k, v) == v for k, v in row.items()):
            last.update(row)
            return
        if len(self._rows) >= self.flush_logs_every_n_steps:
            self.save()
        self._rows.append({"step": step, **row})
        self._row_count += 1

    def save(self) -> None:
        if not self._rows or not self._writes:
            return
        path = self.metrics_file
        if self._header is None and os.path.exists(path):
            with open(path, newline="", encoding="utf-8") as fh:
                self._header = next(csv.reader(fh), None)
        header = list(self._header or ["step"])
        for row in self._rows:
            header.extend(k for k in row if k not in header)
        os.makedirs(self.log_dir, exist_ok=True)
        if self._header is not None and header == self._header:
            with open(path, "a", newline="", encoding="utf-8") as fh:
                csv.DictWriter(fh, header).writerows(self._rows)
        else:
            old: list[dict[str, str]] = []
            if self._header is not None:
                with open(path, newline="", encoding="utf-8") as fh:
                    old = list(csv.DictReader(fh))
            tmp = path + ".tmp"
            with open(tmp, "w", newline="", encoding="utf-8") as fh:
                writer = csv.DictWriter(fh, header)
                writer.writeheader()
                writer.writerows(old)
                writer.writerows(self._rows)
            os.replace(tmp, path)
            self._header = header
        self._rows = []

    def finalize(self, status: str) -> None:
        self.save()
