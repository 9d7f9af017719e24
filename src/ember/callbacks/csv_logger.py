"""CSVLogger: ``metrics.csv`` and ``hparams.yaml`` under ``<save_dir>/<name>/version_N/``.

Also home of what every file-writing logger shares (the TensorBoard logger imports it from here,
because this module needs nothing beyond the standard library): the ``version_N`` directory
scheme, agreed across processes, and a small YAML emitter for ``hparams.yaml`` (PyYAML is not
a dependency).
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
from typing import TYPE_CHECKING, Any

from ember.callbacks.logger import Logger

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer

HPARAMS_FILE = "hparams.yaml"

# ---------------------------------------------------------------------------------------- YAML
_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "~"}


def _yaml_scalar(value: Any) -> str:
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d tensor or numpy scalar
        value = value.item()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        return repr(value)
    text = value if isinstance(value, str) else str(value)
    if _PLAIN.match(text) and text.lower() not in _RESERVED:
        return text
    # A JSON string is a valid YAML double-quoted scalar.
    return json.dumps(text, ensure_ascii=False)


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, (dict, list, tuple, set, frozenset))


def _inline(value: Any) -> bool:
    """Scalars, empty containers and flat lists of scalars fit on one line (``[1, 2]``)."""
    if _is_scalar(value) or not value:
        return True
    return not isinstance(value, dict) and all(_is_scalar(v) for v in value)


def _yaml_lines(obj: Any, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            k = _yaml_scalar(key if isinstance(key, str) else str(key))
            if _inline(value):
                lines.append(f"{pad}{k}: {_yaml_inline(value)}")
            else:
                lines.append(f"{pad}{k}:")
                lines.extend(_yaml_lines(value, indent + 2))
    else:
        for item in obj:
            if _inline(item):
                lines.append(f"{pad}- {_yaml_inline(item)}")
            else:
                lines.append(f"{pad}-")
                lines.extend(_yaml_lines(item, indent + 2))
    return lines


def _yaml_inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{}" if not value else "{" + ", ".join(f"{_yaml_scalar(str(k))}: {_yaml_inline(v)}"
                                                        for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple, set, frozenset)):
        return "[" + ", ".join(_yaml_inline(v) for v in value) + "]"
    return _yaml_scalar(value)


def to_yaml(data: dict[str, Any]) -> str:
    """Block-style YAML for a dict of numbers, strings, bools, None, lists and dicts.

    Anything else is written as its ``str()``, quoted, so the file always parses.
    """
    if not data:
        return "{}\n"
    return "\n".join(_yaml_lines(data, 0)) + "\n"


# ---------------------------------------------------------------------------------------- directory scheme
class FileLogger(Logger):
    """A logger writing into ``<save_dir>/<name>/version_<N>/`` on global rank zero.

    Args:
        save_dir: the root directory; defaults to the Trainer's ``default_root_dir``.
        name: sub-directory for this experiment ("" for none).
        version: an int (``version_<int>``), a string (used as the directory name), or None for
            the next free ``version_<N>`` (one above the highest present).
        prefix: put in front of every metric name.
    """

    def __init__(self, save_dir: str | os.PathLike[str] | None = None, name: str = "ember_logs",
                 version: int | str | None = None, prefix: str = "") -> None:
        if version is not None and (isinstance(version, bool) or not isinstance(version, (int, str))):
            raise TypeError(f"version must be an int, a str or None, got {type(version).__name__}.")
        self._save_dir = os.fspath(save_dir) if save_dir is not None else None
        self._name = name or ""
        self._version = version
        self._fixed_version = version is not None
        self.prefix = prefix
        self.hparams: dict[str, Any] = {}
        self._rank = 0

    @property
    def save_dir(self) -> str:
        return self._save_dir if self._save_dir is not None else os.getcwd()

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = self._next_version()
        return self._version

    @property
    def root_dir(self) -> str:
        return os.path.join(self.save_dir, self._name) if self._name else self.save_dir

    @property
    def log_dir(self) -> str:
        version = self.version
        return os.path.join(self.root_dir, version if isinstance(version, str) else f"version_{version}")

    def _next_version(self) -> int:
        root = self.root_dir
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return 0
        found = [int(n[8:]) for n in names
                 if n.startswith("version_") and n[8:].isdigit() and os.path.isdir(os.path.join(root, n))]
        return max(found) + 1 if found else 0

    def run_dirs(self, default_root_dir: str) -> list[str]:
        """The directories of this logger's runs: its own version's when the version is chosen,
        else every run directory under ``root_dir`` (without choosing a version)."""
        if self._fixed_version or self._version is not None:
            return [self.log_dir]
        root = os.path.join(self._save_dir if self._save_dir is not None else default_root_dir, self._name)
        try:
            names = sorted(os.listdir(root))
        except OSError:
            return []
        return [os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n))]

    def continue_run(self, run_dir: str, default_root_dir: str) -> bool:
        """Write into ``run_dir`` (one of ``run_dirs``), if this logger's version is not fixed."""
        if self._fixed_version:
            return False
        root = os.path.join(self._save_dir if self._save_dir is not None else default_root_dir, self._name)
        if os.path.abspath(os.path.dirname(run_dir)) != os.path.abspath(root):
            return False
        name = os.path.basename(run_dir)
        self._version = int(name[8:]) if name.startswith("version_") and name[8:].isdigit() else name
        return True

    @property
    def _writes(self) -> bool:
        return self._rank == 0

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if self._save_dir is None:
            self._save_dir = trainer.default_root_dir
        self._rank = trainer.global_rank
        if not self._fixed_version:
            # Resolved here at the latest, before anything is written, so that several loggers of one
            # run pick the same free version_N; rank zero's choice is broadcast (even if another
            # process already resolved its own, e.g. for a checkpoint path), so every process agrees
            # on trainer.log_dir.
            mine = self.version if self._rank == 0 else None
            self._version = trainer.strategy.broadcast(mine) if trainer.world_size > 1 else mine

    def log_hyperparams(self, params: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        """Remember ``params`` and write them to ``hparams.yaml`` (``metrics`` are logged as usual)."""
        if not self._writes:
            return
        self.hparams.update(params)
        os.makedirs(self.log_dir, exist_ok=True)
        tmp = os.path.join(self.log_dir, HPARAMS_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(to_yaml(self.hparams))
        os.replace(tmp, os.path.join(self.log_dir, HPARAMS_FILE))
        if metrics:
            self.log_metrics(metrics, 0)

    def _state_key_args(self) -> dict[str, Any]:
        return {"name": self._name, "version": self._version}


# ---------------------------------------------------------------------------------------- CSV
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

    def __init__(self, save_dir: str | os.PathLike[str] | None = None, name: str = "ember_logs",
                 version: int | str | None = None, prefix: str = "", flush_logs_every_n_steps: int = 100) -> None:
        super().__init__(save_dir, name, version, prefix)
        if not isinstance(flush_logs_every_n_steps, int) or flush_logs_every_n_steps < 1:
            raise ValueError(f"flush_logs_every_n_steps must be a positive int, got {flush_logs_every_n_steps!r}.")
        self.flush_logs_every_n_steps = flush_logs_every_n_steps
        self._rows: list[dict[str, Any]] = []
        self._header: list[str] | None = None  # the header of the file on disk

    @property
    def metrics_file(self) -> str:
        return os.path.join(self.log_dir, self.METRICS_FILE)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self._writes:
            return
        row = {self.prefix + k: v for k, v in metrics.items()}
        last = self._rows[-1] if self._rows else None
        if last is not None and last["step"] == step and all(last.get(k, v) == v for k, v in row.items()):
            last.update(row)
            return
        if len(self._rows) >= self.flush_logs_every_n_steps:
            self.save()
        self._rows.append({"step": step, **row})

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
