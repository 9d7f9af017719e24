"""``SaveConfigCallback``: the run's resolved configuration, saved beside its logs and never lost.

At setup, on global rank zero, the configuration is written to ``<trainer.log_dir>/config.yaml``
(``<default_root_dir>`` without a logger). What happens when that file is already there depends on
whether the fit continues the run that wrote it:

- A fit asked to resume (``--ckpt_path last`` or a path, ``auto``, or a torchrun / SLURM restart of
  the job, see ``ember/checkpoint/auto_resume.py``) continues the run in its own directory, so the
  run's configuration is already there. When this fit's is the same (ignoring ``ckpt_path``, which
  only says where to resume from, and a ``seed_everything`` that EmberCLI drew at random for this
  process), the file is kept as it is. When it differs (``--trainer.max_epochs 20`` to train on),
  it is saved beside the earlier ones as ``config-1.yaml``, then ``config-2.yaml``...: each file
  records the settings of the part of the run that started with it, and none is overwritten.
- Any other run stops before training and says what to do: two runs' logs in one folder would be
  mixed up, and the earlier run's configuration would no longer describe its folder.

``overwrite=True`` replaces the file instead. Every rank takes the same branch: rank zero decides.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import Callback
from ember.checkpoint import auto_resume

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer

__all__ = ["SaveConfigCallback"]

#: Top-level keys whose change does not make a resumed fit's configuration another run's.
RESUME_KEYS = ("ckpt_path",)


class SaveConfigCallback(Callback):
    """Saves the run's resolved configuration to ``<trainer.log_dir>/<config_filename>`` at setup, on
    global rank zero (see the module docstring for a file already there).

    Args:
        parser: the parser that read the configuration (it writes it back in the same form).
        config: the resolved configuration.
        config_filename: the file's name in the log folder.
        overwrite: replace an existing file.
        ignore_on_resume: top-level keys whose values may differ between a run's saved configuration
            and the one of a fit resuming it, without the resumed part counting as changed.
    """

    def __init__(
        self,
        parser: Any,
        config: Any,
        config_filename: str = "config.yaml",
        overwrite: bool = False,
        ignore_on_resume: Sequence[str] = RESUME_KEYS,
    ) -> None:
        self.parser, self.config = parser, config
        self.config_filename, self.overwrite = config_filename, overwrite
        self.ignore_on_resume = tuple(ignore_on_resume)
        #: Where this run's configuration is (written or kept) once setup has run on global rank zero.
        self.path: str | None = None

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        folder = trainer.log_dir or trainer.default_root_dir
        decision: tuple[str, str] = ("write", os.path.join(folder, self.config_filename))
        if trainer.is_global_zero:
            decision = self._decide(folder, resumes=stage == "fit" and self._resumes())
        if trainer.world_size > 1:  # every rank stops, or none
            decision = trainer.strategy.broadcast(decision, src=0)
        what, path = decision
        if what == "refuse":
            raise RuntimeError(
                f"{path} already exists, and EmberCLI does not overwrite a saved configuration. Use "
                "another log folder (--trainer.default_root_dir, or a logger with a new version), "
                "resume the run that saved it (--ckpt_path last), remove the file, or pass "
                "save_config_kwargs={'overwrite': True}."
            )
        if trainer.is_global_zero:
            if what == "write":
                os.makedirs(folder, exist_ok=True)
                self.parser.save(self.config, path, skip_none=False, overwrite=True, skip_validation=True)
            self.path = path

    def _resumes(self) -> bool:
        """Whether this fit was asked to continue a run: a ``ckpt_path``, or a restart of the job."""
        return self.config.get("ckpt_path") is not None or auto_resume.restart() is not None

    def _decide(self, folder: str, resumes: bool) -> tuple[str, str]:
        """``("write" | "keep" | "refuse", path)``."""
        path = os.path.join(folder, self.config_filename)
        if self.overwrite or not os.path.exists(path):
            return "write", path
        if not resumes:
            return "refuse", path
        numbered = self._numbered(folder)
        latest = os.path.join(folder, self._name(max(numbered))) if numbered else path
        if self._same_run(latest):
            return "keep", latest
        return "write", os.path.join(folder, self._name(max(numbered, default=0) + 1))

    def _name(self, number: int) -> str:
        """``config-<number>.yaml`` for ``config_filename="config.yaml"``."""
        stem, ext = os.path.splitext(self.config_filename)
        return f"{stem}-{number}{ext}"

    def _numbered(self, folder: str) -> list[int]:
        stem, ext = os.path.splitext(self.config_filename)
        pattern = re.compile(re.escape(stem) + r"-(\d+)" + re.escape(ext))
        return [int(m.group(1)) for name in os.listdir(folder) if (m := pattern.fullmatch(name))]

    def _same_run(self, path: str) -> bool:
        """Whether the configuration saved at ``path`` is this one, but for ``ignore_on_resume``."""
        import yaml  # (PyYAML comes with jsonargparse, the cli extra: ``import ember.cli`` works without it)

        try:
            with open(path, encoding="utf-8") as fh:
                saved = yaml.safe_load(fh)
        except (OSError, yaml.YAMLError):
            return False  # unreadable: saved beside it, so that this run's is on record
        ours = yaml.safe_load(self.parser.dump(self.config, skip_none=False, skip_validation=True))
        if not isinstance(saved, dict) or not isinstance(ours, dict):
            return saved == ours
        drop = set(self.ignore_on_resume)
        return {k: v for k, v in saved.items() if k not in drop} == {k: v for k, v in ours.items() if k not in drop}
