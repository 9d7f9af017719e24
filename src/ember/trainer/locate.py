"""Which checkpoint a run resumes from: ``ckpt_path`` as ``"last"``, ``"best"``, ``"auto"`` or a path.

``"last"`` is the most recently written ``last*.ckpt`` where this Trainer's checkpoints go: every
ModelCheckpoint's directory and, with a logger that numbers its runs (``version_N``), every run
directory of ``default_root_dir``; a fit resuming from a run's ``last.ckpt`` continues writing into
that run's directory. ``"best"`` is the first ModelCheckpoint's ``best_model_path``. ``"auto"`` and
restarts of a torchrun or SLURM job go through ``auto_resume.py``.

Loggers are recognised by what they can do (a file logger has ``run_dirs``, ``runs_root`` and
``continue_run``), checkpoint callbacks by ``best_model_path`` and ``dirpath`` (a user's own included).
This module is the trainer's: where a Trainer's checkpoints are is a question about the Trainer (its
callbacks, loggers and ``default_root_dir``), and ``ember.checkpoint`` only reads the files.
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from ember.checkpoint import auto_resume
from ember.checkpoint.format import CheckpointError, CheckpointNotFoundError
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


class _RunLogger(Protocol):
    @property
    def log_dir(self) -> str: ...
    def run_dirs(self, default_root_dir: str) -> list[str]: ...
    def runs_root(self, default_root_dir: str) -> str: ...
    def continue_run(self, run_dir: str, default_root_dir: str) -> bool: ...


def _has_runs(logger: Any) -> TypeGuard[_RunLogger]:
    """A logger that numbers its runs in directories (``FileLogger``: TensorBoard, CSV)."""
    return hasattr(type(logger), "log_dir") and all(  # (on the type: the property would choose a version)
        callable(getattr(logger, name, None)) for name in ("run_dirs", "runs_root", "continue_run")
    )


def _checkpoint_callbacks(trainer: Trainer) -> list[Any]:
    return [cb for cb in trainer.callbacks if hasattr(cb, "best_model_path") and hasattr(cb, "dirpath")]


def _default_dirs(trainer: Trainer) -> list[str]:
    """Where a ModelCheckpoint without a ``dirpath`` writes: ``<log dir>/checkpoints``, for every run
    directory of the first logger when its version is not chosen yet."""
    if not trainer.loggers:
        return [os.path.join(trainer.default_root_dir, "checkpoints")]
    first = trainer.loggers[0]  # as ModelCheckpoint._resolve_dirpath
    if _has_runs(first):
        return [os.path.join(d, "checkpoints") for d in first.run_dirs(trainer.default_root_dir)]
    return [os.path.join(first.log_dir or first.run_dir(trainer.default_root_dir), "checkpoints")]


def default_dir(trainer: Trainer) -> str:
    return os.path.join(trainer.default_root_dir, "checkpoints")


def search_dirs(trainer: Trainer) -> list[str]:
    """Where this Trainer's checkpoints go (with the default logger: every run directory of
    ``default_root_dir``), absolute, without repeats."""
    dirs: list[str] = []
    for cb in _checkpoint_callbacks(trainer):
        for d in _dirs_of(trainer, cb):
            if os.path.abspath(d) not in dirs:
                dirs.append(os.path.abspath(d))
    for d in _default_dirs(trainer) + [default_dir(trainer)]:
        if os.path.abspath(d) not in dirs:
            dirs.append(os.path.abspath(d))
    return dirs


def _dirs_of(trainer: Trainer, callback: Any) -> list[str]:
    given = getattr(callback, "dirpath_given", True) and callback.dirpath
    return [callback.dirpath] if given else _default_dirs(trainer)


def search_patterns(trainer: Trainer) -> list[str]:
    """Glob patterns of this Trainer's checkpoint files: ``*.ckpt`` in each of :func:`search_dirs`, and
    in the sub-folders a ModelCheckpoint's ``filename`` names (``"sub/{epoch}"``, ``"{epoch}/w"``)."""
    patterns = [os.path.join(glob.escape(d), "*.ckpt") for d in search_dirs(trainer)]
    for cb in _checkpoint_callbacks(trainer):
        folder = os.path.dirname(str(getattr(cb, "filename", None) or ""))
        if folder:
            sub = re.sub(r"\{[^{}]*\}", "*", glob.escape(folder))  # each {field} may be anything
            patterns += [os.path.join(glob.escape(os.path.abspath(d)), sub, "*.ckpt") for d in _dirs_of(trainer, cb)]
    return list(dict.fromkeys(patterns))


def find_last(trainer: Trainer) -> tuple[str | None, list[str]]:
    """The most recently written ``last*.ckpt`` where this Trainer's checkpoints go, and the
    directories searched (with the default logger: every ``version_N`` of ``default_root_dir``)."""
    dirs = search_dirs(trainer)
    callbacks = _checkpoint_callbacks(trainer)
    found = [p for d in dirs for p in glob.glob(os.path.join(glob.escape(d), "last*.ckpt"))]
    broken = [p for p in found if not os.path.exists(p)]  # symbolic links to removed files (save_last="link")
    found = [p for p in found if p not in broken]
    for p in broken:
        why = f"a symbolic link to {os.readlink(p)!r}, which does not exist (the checkpoint it pointed to was removed)"
        if not found:
            raise CheckpointNotFoundError(
                f"ckpt_path='last': {p} is {why}, and there is no other last checkpoint. "
                "Pass the path of a checkpoint to resume from, or remove the link to start "
                "from scratch."
            )
        warnings.warn(f"ckpt_path='last' skips {p}, {why}.", UserWarning, stacklevel=user_stacklevel())
    if not found:
        # Say where a checkpoint would have been found, run directories that do not exist yet included.
        first = trainer.loggers[0] if trainer.loggers else None
        if _has_runs(first) and not any(cb.dirpath and getattr(cb, "dirpath_given", False) for cb in callbacks):
            runs = os.path.abspath(first.runs_root(trainer.default_root_dir))
            dirs = [os.path.join(runs, "*", "checkpoints")] + [d for d in dirs if not d.startswith(runs + os.sep)]
        return None, dirs
    return max(found, key=os.path.getmtime), dirs


def _continue_run(trainer: Trainer, path: str) -> None:
    """Loggers whose version is not chosen continue the run ``path`` belongs to
    (``<root>/<version>/checkpoints/last.ckpt``), so its curves and checkpoints carry on there."""
    checkpoints = os.path.dirname(os.path.abspath(path))
    while os.path.basename(checkpoints) != "checkpoints":  # from a filename folder (``"sub/{epoch}"``) up
        parent = os.path.dirname(checkpoints)
        if parent == checkpoints:
            return
        checkpoints = parent
    for lg in trainer.loggers:
        if _has_runs(lg):
            lg.continue_run(os.path.dirname(checkpoints), trainer.default_root_dir)


#: In a run directory made by a job of a launcher (torchrun, SLURM): which job (``auto_resume.job_key``).
JOB_FILE = ".ember_job"


def mark_job_runs(trainer: Trainer) -> None:
    """Under torchrun or SLURM, record in each run directory of this fit (loggers that number their runs)
    which job it belongs to, so that a restart of the job that finds no checkpoint of its own yet still
    continues that run rather than starting another. Global rank zero, after the loggers' setup."""
    job = auto_resume.job_key()
    if job is None or not trainer.is_global_zero:
        return
    for lg in trainer.loggers:
        if _has_runs(lg):
            os.makedirs(lg.log_dir, exist_ok=True)
            marker = os.path.join(lg.log_dir, JOB_FILE)
            with open(marker + ".tmp", "w", encoding="utf-8") as fh:
                fh.write(job + "\n")
            os.replace(marker + ".tmp", marker)


def _job_run(trainer: Trainer) -> str | None:
    """The run directory an earlier attempt of this job marked (:func:`mark_job_runs`), if any (the
    newest when several are)."""
    job = auto_resume.job_key()
    first = trainer.loggers[0] if trainer.loggers else None
    if job is None or not _has_runs(first):
        return None
    mine = []
    for run in first.run_dirs(trainer.default_root_dir):
        try:
            with open(os.path.join(run, JOB_FILE), encoding="utf-8") as fh:
                if fh.read().strip() == job:
                    mine.append(run)
        except OSError:
            continue
    return max(mine, key=os.path.getmtime) if mine else None


def resolve(trainer: Trainer, ckpt_path: str | os.PathLike | None, continue_run: bool = False) -> str | None:
    """Turn ``"last"``, ``"best"``, ``"auto"`` or a path into a file path (None: start fresh).

    With ``continue_run`` (fit), a restarted job resumes from its own latest checkpoint whatever
    ``ckpt_path`` says (``auto_resume.py``), and a checkpoint found in a logger's run directory
    makes the loggers whose version is not chosen write into that run directory again. Call before
    the loggers' setup.
    """
    strategy = trainer.strategy
    if continue_run and auto_resume.applies(ckpt_path):  # fit: a restarted job, or "auto" (auto_resume.py)
        chosen, found_here, run = None, False, None
        if strategy.is_global_zero:
            chosen, found_here = auto_resume.choose(ckpt_path, search_patterns(trainer))
            if not found_here:  # a restart with no checkpoint yet: the run its first attempt began, if any
                run = _job_run(trainer)
        chosen, found_here, run = strategy.broadcast((chosen, found_here, run))
        if found_here:
            if chosen is not None:
                _continue_run(trainer, chosen)
            return chosen
        if run is not None:
            for lg in trainer.loggers:
                if _has_runs(lg):
                    lg.continue_run(run, trainer.default_root_dir)
    elif ckpt_path == auto_resume.AUTO:
        raise ValueError(
            "ckpt_path='auto' applies to fit (resume when a checkpoint exists); for validate, "
            "test and predict pass 'last', 'best' or a path."
        )
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        found: str | None = None
        dirs: list[str] = []
        problem: str | None = None
        if strategy.is_global_zero:
            try:
                found, dirs = find_last(trainer)
            except CheckpointError as err:
                problem = str(err)
        found, problem = strategy.broadcast((found, problem))
        if problem is not None:  # on every rank
            raise CheckpointNotFoundError(problem)
        if found is None:
            if strategy.is_global_zero:
                warnings.warn(
                    f"ckpt_path='last' found no checkpoint (searched {dirs}); starting from scratch.",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
            return None
        if continue_run:
            _continue_run(trainer, found)
        return found
    if ckpt_path == "best":
        best = [cb.best_model_path for cb in _checkpoint_callbacks(trainer) if cb.best_model_path]
        if not best:
            raise CheckpointError(
                "ckpt_path='best' but no ModelCheckpoint of this Trainer has saved a best "
                "checkpoint yet. Pass a path, or 'last'."
            )
        return best[0]
    return os.fspath(ckpt_path)
