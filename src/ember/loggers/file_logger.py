"""FileLogger: what every file-writing logger shares (CSVLogger and TensorBoardLogger derive from it).

The ``<save_dir>/<name>/version_N/`` directory scheme, agreed across processes, and
``hparams.yaml`` (written with ``ember/yaml.py``, because PyYAML is not a dependency).

A fit resumed from a checkpoint continues in the run directory of the run that wrote it
(``trainer/locate.py``), and that run may have gone on past the checkpoint before it was stopped
(killed, preempted). What it logged from the checkpoint's step on describes steps the resumed fit
runs again, so the logger drops it (``rewind``): CSVLogger rewrites ``metrics.csv`` without those
rows, TensorBoardLogger starts its next event file with TensorBoard's purge marker. Each step then
has one set of values however often the run was resumed. What was logged before a checkpoint is
on disk when the checkpoint is written (``on_save_checkpoint`` flushes), so a kill loses nothing
a resume does not log again.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ember.loggers.logger import Logger, hparams_dict
from ember.yaml import to_yaml

if TYPE_CHECKING:
    from argparse import Namespace

    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer
    from ember.types import Stage

HPARAMS_FILE = "hparams.yaml"


# ---------------------------------------------------------------------------------------- directory scheme
class FileLogger(Logger):
    """A logger writing into ``<save_dir>/<name>/version_<N>/`` on global rank zero.

    Args:
        save_dir: the root directory; defaults to the Trainer's ``default_root_dir``.
        name: sub-directory for this experiment ("" for none).
        version: an int (``version_<int>``), a string (used as the directory name), or None for
            the next free ``version_<N>`` (one above the highest present).
        prefix: put in front of every metric name, joined with ``LOGGER_JOIN_CHAR`` (``"train"`` gives
            ``train-loss``, as Lightning's loggers).
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        save_dir: str | os.PathLike[str] | None = None,
        name: str = "ember_logs",
        version: int | str | None = None,
        prefix: str = "",
    ) -> None:
        if version is not None and (isinstance(version, bool) or not isinstance(version, (int, str))):
            raise TypeError(f"version must be an int, a str or None, got {type(version).__name__}.")
        self._save_dir = os.fspath(save_dir) if save_dir is not None else None
        self._name = name or ""
        self._version = version
        self._fixed_version = version is not None
        self.prefix = prefix
        self.hparams: dict[str, Any] = {}
        self._rank = 0
        # The step a resumed fit restarts at: what was logged from there on is dropped before the next write.
        self._rewind_step: int | None = None

    def prefixed(self, key: str) -> str:
        """``key`` as written: with ``prefix`` and ``LOGGER_JOIN_CHAR`` in front when a prefix is set."""
        return f"{self.prefix}{self.LOGGER_JOIN_CHAR}{key}" if self.prefix else key

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
        """``<save_dir>/<name>``, with the ``name`` property (a subclass may override it)."""
        name = self.name
        return os.path.join(self.save_dir, name) if name else self.save_dir

    @property
    def log_dir(self) -> str:
        """``<root_dir>/<version>``, with the ``version`` property (an int ``N`` is ``version_N``)."""
        version = self.version
        return os.path.join(self.root_dir, version if isinstance(version, str) else f"version_{version}")

    def _next_version(self) -> int:
        root = self.root_dir
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return 0
        found = [
            int(n[8:])
            for n in names
            if n.startswith("version_") and n[8:].isdigit() and os.path.isdir(os.path.join(root, n))
        ]
        return max(found) + 1 if found else 0

    def run_dirs(self, default_root_dir: str) -> list[str]:
        """The directories of this logger's runs: its own version's when the version is chosen,
        else every run directory under ``root_dir`` (without choosing a version)."""
        if self._fixed_version or self._version is not None:
            return [self.log_dir]
        root = self.runs_root(default_root_dir)
        try:
            names = sorted(os.listdir(root))
        except OSError:
            return []
        return [os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n))]

    def runs_root(self, default_root_dir: str) -> str:
        """The directory holding this logger's run directories (``<save_dir>/<name>``)."""
        return os.path.join(self._save_dir if self._save_dir is not None else default_root_dir, self.name)

    def continue_run(self, run_dir: str, default_root_dir: str) -> bool:
        """Write into ``run_dir`` (one of ``run_dirs``), if this logger's version is not fixed."""
        if self._fixed_version:
            return False
        root = os.path.join(self._save_dir if self._save_dir is not None else default_root_dir, self.name)
        if os.path.abspath(os.path.dirname(run_dir)) != os.path.abspath(root):
            return False
        name = os.path.basename(run_dir)
        self._version = int(name[8:]) if name.startswith("version_") and name[8:].isdigit() else name
        return True

    @property
    def _writes(self) -> bool:
        return self._rank == 0

    def setup(self, trainer: Trainer, module: TrainModule, stage: Stage) -> None:
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

    def on_save_checkpoint(self, trainer: Trainer, module: TrainModule, checkpoint: dict[str, Any]) -> None:
        # Before the checkpoint file is written: a run killed after it resumes with every row logged
        # before it on disk (the rows of a flush interval would otherwise be lost with the process).
        self.save()

    def on_load_checkpoint(self, trainer: Trainer, module: TrainModule, checkpoint: dict[str, Any]) -> None:
        # Only a fit continues the run: validate / test(ckpt_path=...) log beside what is there.
        if trainer.state == "fitting":
            self.rewind(int(checkpoint.get("global_step", 0)))

    def rewind(self, step: int) -> None:
        """Drop what was logged at ``step`` and later (the next write does it): a fit resumes from a
        checkpoint saved after ``step`` optimizer steps, and logs those steps again.

        The resumed fit may also log ``step - 1`` again (the end of an epoch whose last batch the
        checkpoint follows): those values take the place of the ones the stopped run wrote there
        after the checkpoint (CSVLogger: in that step's row; TensorBoardLogger: when the checkpoint
        holds what it had written at that step, ``TensorBoardLogger.state_dict``).

        Args:
            step: the optimizer steps the checkpoint was saved after (its ``global_step``).
        """
        self._rewind_step = step

    def log_hyperparams(
        self,
        params: dict[str, Any] | Namespace | None = None,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> None:
        """Remember ``params`` (a dict, a Namespace or None) and write them to ``hparams.yaml`` (``metrics``
        are logged as usual, at ``step``, default 0)."""
        if not self._writes:
            return
        self.hparams.update(hparams_dict(params))
        write_hparams_file(self.log_dir, self.hparams)
        if metrics:
            self.log_metrics(metrics, 0 if step is None else step)

    def _state_key_args(self) -> dict[str, Any]:
        return {"name": self._name, "version": self._version}


def write_hparams_file(log_dir: str, hparams: dict[str, Any]) -> None:
    """Write ``hparams`` to ``<log_dir>/hparams.yaml`` atomically (a reader never sees half a file)."""
    os.makedirs(log_dir, exist_ok=True)
    tmp = os.path.join(log_dir, HPARAMS_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(to_yaml(hparams))
    os.replace(tmp, os.path.join(log_dir, HPARAMS_FILE))
