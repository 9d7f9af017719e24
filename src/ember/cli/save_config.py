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

``multifile=True`` keeps the layout of the configs given: a part read from its own file (``--model
model.yaml``) is saved to its own file beside ``config.yaml``, which names it. Those files are never
overwritten either (they are written to a staging folder first, and a name already taken stops the run
as ``config.yaml`` would); a changed configuration saved beside a resumed run's is one file, so that it
cannot replace the parts the run's first configuration named.

After saving (or without saving, ``save_to_log_dir=False``), :meth:`SaveConfigCallback.save_config` runs
on global rank zero: a subclass overrides it to record the configuration elsewhere too, e.g. in a logger.
The whole setup runs once per callback: a ``test`` after a ``fit`` on the same Trainer saves nothing more.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import Callback
from ember.checkpoint import auto_resume
from ember.overrides import is_overridden

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer

__all__ = ["SaveConfigCallback"]

#: Top-level keys whose change does not make a resumed fit's configuration another run's.
RESUME_KEYS = ("ckpt_path",)


class SaveConfigCallback(Callback):
    """Saves the run's resolved configuration to ``<trainer.log_dir>/<config_filename>`` at setup, on
    global rank zero (see the module docstring for a file already there), then calls :meth:`save_config`.

    Args:
        parser: the parser that read the configuration (it writes it back in the same form).
        config: the resolved configuration.
        config_filename: the file's name in the log folder.
        overwrite: replace an existing file.
        multifile: save each part of the configuration that was read from its own file to its own file.
        save_to_log_dir: save to the log folder; False only with a subclass whose :meth:`save_config`
            saves it elsewhere.
        ignore_on_resume: top-level keys whose values may differ between a run's saved configuration
            and the one of a fit resuming it, without the resumed part counting as changed.
    """

    def __init__(
        self,
        parser: Any,
        config: Any,
        config_filename: str = "config.yaml",
        overwrite: bool = False,
        multifile: bool = False,
        save_to_log_dir: bool = True,
        ignore_on_resume: Sequence[str] = RESUME_KEYS,
    ) -> None:
        self.parser, self.config = parser, config
        self.config_filename, self.overwrite, self.multifile = config_filename, overwrite, multifile
        self.save_to_log_dir = save_to_log_dir
        self.ignore_on_resume = tuple(ignore_on_resume)
        #: Where this run's configuration is (written or kept) once setup has run on global rank zero.
        self.path: str | None = None
        #: Whether setup has run (it runs once: a later stage on the same Trainer saves nothing more).
        self.already_saved = False
        if not save_to_log_dir and not is_overridden("save_config", self, SaveConfigCallback):
            raise ValueError(
                "save_to_log_dir=False saves the configuration nowhere: subclass SaveConfigCallback and "
                "override save_config(trainer, pl_module, stage) to save it elsewhere, or keep save_to_log_dir=True."
            )

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            self._save_to_log_dir(trainer, stage)
        if trainer.is_global_zero:
            self.save_config(trainer, module, stage)
        self.already_saved = True

    def save_config(self, trainer: Trainer, pl_module: TrainModule, stage: str) -> None:
        """Override to save the configuration somewhere else as well (a logger, a database); runs at setup on
        global rank zero only, after the file in the log folder is saved, so it must not wait for other ranks.

        ``self.parser.dump(self.config, skip_none=False)`` gives the configuration as YAML text.

        Args:
            trainer: the Trainer.
            pl_module: the module.
            stage: what the Trainer runs: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``.
        """

    # ------------------------------------------------------------------ the file in the log folder
    def _save_to_log_dir(self, trainer: Trainer, stage: str) -> None:
        folder = trainer.log_dir or trainer.default_root_dir
        decision: tuple[str, str] = ("write", os.path.join(folder, self.config_filename))
        staged: str | None = None
        if trainer.is_global_zero:
            decision = self._decide(folder, resumes=stage == "fit" and self._resumes())
            if decision[0] == "write" and self.multifile and decision[1] == os.path.join(folder, self.config_filename):
                staged, taken = self._stage(folder)
                if taken is not None:
                    shutil.rmtree(staged, ignore_errors=True)
                    decision = ("refuse", taken)
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
            if staged is not None:
                for name in os.listdir(staged):
                    os.replace(os.path.join(staged, name), os.path.join(folder, name))
                os.rmdir(staged)
            elif what == "write":
                os.makedirs(folder, exist_ok=True)
                self.parser.save(
                    self.config, path, multifile=False, overwrite=True, skip_validation=True, **_keep_none()
                )
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
        if self._same_run(latest, folder):
            return "keep", latest
        return "write", os.path.join(folder, self._name(max(numbered, default=0) + 1))

    def _stage(self, folder: str) -> tuple[str, str | None]:
        """Save the configuration and its parts' files to a new folder inside ``folder``; return it, and the
        first of their names already taken in ``folder`` (None when none is, or with ``overwrite``)."""
        os.makedirs(folder, exist_ok=True)
        staged = tempfile.mkdtemp(prefix=".config-staged-", dir=folder)
        target = os.path.join(staged, self.config_filename)
        self.parser.save(self.config, target, multifile=True, overwrite=True, skip_validation=True, **_keep_none())
        taken = sorted(name for name in os.listdir(staged) if os.path.exists(os.path.join(folder, name)))
        return staged, (os.path.join(folder, taken[0]) if taken and not self.overwrite else None)

    def _name(self, number: int) -> str:
        """``config-<number>.yaml`` for ``config_filename="config.yaml"``."""
        stem, ext = os.path.splitext(self.config_filename)
        return f"{stem}-{number}{ext}"

    def _numbered(self, folder: str) -> list[int]:
        stem, ext = os.path.splitext(self.config_filename)
        pattern = re.compile(re.escape(stem) + r"-(\d+)" + re.escape(ext))
        return [int(m.group(1)) for name in os.listdir(folder) if (m := pattern.fullmatch(name))]

    def _same_run(self, path: str, folder: str) -> bool:
        """Whether the configuration saved at ``path`` is this one, but for ``ignore_on_resume``."""
        import yaml  # (PyYAML comes with jsonargparse, the cli extra: ``import ember.cli`` works without it)

        try:
            with open(path, encoding="utf-8") as fh:
                saved = yaml.safe_load(fh)
        except (OSError, yaml.YAMLError):
            return False  # unreadable: saved beside it, so that this run's is on record
        ours = yaml.safe_load(self.parser.dump(self.config, skip_validation=True, **_keep_none()))
        saved = _with_parts(saved, ours, folder)
        if not isinstance(saved, dict) or not isinstance(ours, dict):
            return saved == ours
        drop = set(self.ignore_on_resume)
        return {k: v for k, v in saved.items() if k not in drop} == {k: v for k, v in ours.items() if k not in drop}


def _with_parts(saved: Any, ours: Any, folder: str) -> Any:
    """``saved`` with each part that a multifile save put in its own file (the value is the file's name,
    where ``ours`` holds a mapping) read back from that file in ``folder``."""
    import yaml

    if isinstance(ours, dict) and isinstance(saved, str) and os.path.basename(saved) == saved:
        try:
            with open(os.path.join(folder, saved), encoding="utf-8") as fh:
                saved = yaml.safe_load(fh)
        except (OSError, yaml.YAMLError):
            return saved
    if isinstance(ours, dict) and isinstance(saved, dict):
        return {k: _with_parts(v, ours.get(k), folder) for k, v in saved.items()}
    if isinstance(ours, list) and isinstance(saved, list):
        return [_with_parts(s, o, folder) for s, o in zip(saved, ours)] + saved[len(ours) :]
    return saved


def _keep_none() -> dict[str, bool]:
    """The argument that keeps None values in a dump (``skip_unset`` from jsonargparse 4.49, ``skip_none`` before)."""
    import jsonargparse

    major, minor = (int(part) for part in re.findall(r"\d+", jsonargparse.__version__)[:2])
    return {"skip_unset": False} if (major, minor) >= (4, 49) else {"skip_none": False}
