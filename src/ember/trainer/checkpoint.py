"""Checkpoint contents, saving, and resuming (files themselves: ``ember/checkpoint_io.py``).

A checkpoint is a dict of tensors, numbers, strings, lists and dicts only, so it loads with
``torch.load(path, weights_only=True)`` and loading a file never runs code. Keys:

=====================  ==================================================================
``format``             ``"ember.checkpoint"``; ``format_version`` and ``ember_version`` beside it
``state_dict``         the module's weights (unwrapped from any strategy wrapper)
``hyper_parameters``   what ``save_hyperparameters`` stored (entries that are not plain data are dropped)
``hparams_name``       the argument a config object was saved from (``save_hyperparameters(cfg)``), or None
``datamodule_hyper_parameters``, ``datamodule_hparams_name``  the same for the datamodule, when it saved some
``module_class``       ``"package.module.ClassName"`` of the module, for messages
``weights_only``       True when only the above was saved (``save_weights_only``)
``optimizer_states``   one ``state_dict`` per optimizer
``lr_schedulers``      one ``state_dict`` per LR scheduler
``precision``          GradScaler state (empty unless 16-mixed)
``progress``           epoch, global step, batches consumed in the epoch, validation progress
``sampler``            ``{"seed", "epoch", "position"}`` of the training sampler, or None
``loader``             a train loader's own ``state_dict()`` (a ``CombinedLoader``: each inner loader's), or None
``callbacks``          ``{callback.state_key: callback.state_dict()}``
``callback_metrics``   the latest logged values (what monitors compare against)
``rng``                torch / CUDA / Python / NumPy generator states, one entry per rank
``strategy``           strategy name, world size
``job``                the torchrun or SLURM job that wrote it, or None (a restart resumes its own job's only)
=====================  ==================================================================

``TrainModule.on_save_checkpoint`` and callbacks' ``on_save_checkpoint`` may add keys of their
own, with the same plain-data rule (checked before anything is written).

Writes are atomic and durable: the file is written under a temporary name in the same directory,
flushed and fsynced, then renamed over the target, and the directory is fsynced. A crash at any
moment leaves either the previous file or the new one under the checkpoint's name, never a
truncated one. Only global rank zero writes; the others wait at a barrier. With
``ModelCheckpoint(async_save=True)`` rank zero copies the state and a background thread writes the
same file (``ember/callbacks/checkpoint_writer.py``); every other save waits for that write first.

A resume is exact from the points where ModelCheckpoint and preemption write: a step boundary
(after the optimizer step, step-interval schedulers and any validation of that batch; callbacks get
it as ``on_train_step_boundary(trainer, module)``), the end of a validation, or the end of a
training epoch. ``trainer.save_checkpoint`` called from another hook (say ``on_train_batch_end``,
before the step is counted) records the state of that moment, which a resume does not replay
exactly. Partial gradients of an open accumulation window are not saved.

Resuming under a different world size continues the epoch from the first sample of the global
order that no rank has seen. What cannot carry over is each rank's RNG stream: ranks that did not
exist in the saved run keep the stream ``seed_everything`` gave them.
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.callback import overrides
from ember.callbacks.checkpoint_writer import writers_of
from ember.callbacks.file_logger import FileLogger
from ember.checkpoint_io import (  # noqa: F401  (file-level API, re-exported here)
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointNotFoundError,
    check_plain_data,
    check_state_dict,
    load,
    read_for_module,
    write_atomic,
)
from ember.rng import apply_rng, capture_rng, rng_from_tensor, rng_to_tensor  # noqa: F401 (re-exported)
from ember.strategies.resumable import resumable_sampler_of
from ember.trainer import auto_resume
from ember.version import __version__

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


def _plain_hparams(module: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in dict(module.hparams).items():
        try:
            check_plain_data(v)
        except CheckpointError:
            warnings.warn(
                f"Hyper-parameter {k!r} ({type(v).__name__}) is not plain data and is left out of the "
                "checkpoint (ember's checkpoints load with torch.load(weights_only=True)); load_from_checkpoint "
                f"then uses the constructor's default unless given {k}=... . Pass ignore=[{k!r}] to "
                "save_hyperparameters to silence this.",
                UserWarning,
            )
            continue
        out[k] = v
    return out


def _datamodule_hparams(datamodule: Any) -> dict[str, Any]:
    """As Lightning: a datamodule's saved hyper-parameters, for ``DataModule.load_from_checkpoint``."""
    if datamodule is None or not datamodule.__dict__.get("_hparams"):
        return {}
    return {
        "datamodule_hyper_parameters": _plain_hparams(datamodule),
        "datamodule_hparams_name": getattr(datamodule, "_hparams_name", None),
    }


def _put_datamodule_state(ckpt: dict[str, Any], datamodule: Any) -> None:
    """As Lightning: a datamodule's non-empty ``state_dict()`` under its class's ``__qualname__``."""
    state = datamodule.state_dict()
    if not state:
        return
    key = type(datamodule).__qualname__
    if key in ckpt:
        raise ValueError(
            f"{key}.state_dict() would be saved under the checkpoint key {key!r} (a datamodule's state is saved "
            "under its class name, as in Lightning), which the checkpoint already uses for its own entry. Rename "
            "the datamodule class."
        )
    ckpt[key] = state


def dump(trainer: Trainer, weights_only: bool = False) -> dict[str, Any]:
    """Everything needed to resume ``trainer``'s fit (or only the weights). Runs on every rank."""
    module = trainer.module
    assert module is not None  # checkpoints are written during a run, with the module attached
    strategy = trainer.strategy
    ckpt: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "ember_version": __version__,
        "torch_version": str(torch.__version__),
        "module_class": f"{type(module).__module__}.{type(module).__qualname__}",
        "state_dict": strategy.model_state_dict(),
        "hyper_parameters": _plain_hparams(module),
        # As Lightning: the argument a single config object (dict, Namespace) was saved from, so that
        # load_from_checkpoint passes it back as that argument.
        "hparams_name": getattr(module, "_hparams_name", None),
        **_datamodule_hparams(trainer.datamodule),
        "weights_only": weights_only,
        "epoch": trainer.progress.current_epoch,
        "global_step": trainer.progress.global_step,
        "strategy": {"name": strategy.strategy_name, "world_size": strategy.world_size},
        "job": auto_resume.job_key(),
    }
    if not weights_only:
        ckpt["optimizer_states"] = [opt.state_dict() for opt in trainer._optim.optimizers]
        ckpt["lr_schedulers"] = [cfg.scheduler.state_dict() for cfg in trainer._optim.schedulers]
        ckpt["precision"] = trainer._precision.state_dict()
        ckpt["progress"] = trainer.progress.state_dict()
        if trainer.state == "fitting" and trainer._metrics.stage == "validate":  # inside a validation not yet counted
            ckpt["progress"]["val_checks_in_epoch"] += 1
        ckpt["sampler"] = _sampler_state(trainer)
        ckpt["loader"] = _loader_state(trainer) if ckpt["sampler"] is None else None
        ckpt["callbacks"] = {cb.state_key: cb.state_dict() for cb in trainer.callbacks}
        if trainer.datamodule is not None:
            _put_datamodule_state(ckpt, trainer.datamodule)
        ckpt["callback_metrics"] = {
            k: (v.detach().to("cpu") if isinstance(v, torch.Tensor) else v) for k, v in trainer.callback_metrics.items()
        }
        ckpt["epoch_metrics"] = _train_accumulators(trainer)
        ckpt["rng"] = _gather_rng(strategy)
        for cb in trainer.callbacks:
            if overrides(cb, "on_save_checkpoint"):
                cb.on_save_checkpoint(trainer, module, ckpt)
    module.on_save_checkpoint(ckpt)
    return ckpt


def save(
    trainer: Trainer, filepath: str, weights_only: bool = False, before_rename: Callable[[str], None] | None = None
) -> str:
    """Write ``trainer``'s checkpoint to ``filepath`` (rank zero writes, every rank returns the path).

    Waits for a checkpoint being written in the background first (raising its error, if it failed).
    The write itself is synchronous, unless the save is one a ``BackgroundWriter`` claimed (see
    ``ember/callbacks/checkpoint_writer.py``): then rank zero copies the tensors and returns while a
    thread writes them.
    """
    if trainer.module is None:
        raise RuntimeError("save_checkpoint needs a module: call it during or after trainer.fit(...).")
    strategy = trainer.strategy
    filepath = strategy.broadcast(os.path.abspath(os.fspath(filepath)))
    # A write in flight on a background thread (ModelCheckpoint(async_save=True)) completes, and a failure of
    # it is raised, before this save reads the state: files land in the order the saves were made, and
    # the callbacks' lists of files (published when their write completes) are those of the files on disk.
    background = None
    for pending in writers_of(trainer.callbacks):
        pending.wait()
        background = background or pending.take(filepath)
    ckpt = dump(trainer, weights_only)
    check_plain_data(ckpt)

    def writer(obj: dict[str, Any], path: str) -> None:
        if background is not None:  # the callback that asked for this save writes it in the background
            background(obj, path, before_rename)
        else:
            write_atomic(obj, path, before_rename)

    strategy.save_checkpoint(ckpt, filepath, writer)
    strategy.barrier("save_checkpoint")
    return filepath


def _sampler_state(trainer: Trainer) -> dict[str, Any] | None:
    loader = trainer._data.train_loader
    sampler = resumable_sampler_of(loader)
    if sampler is None:
        return None
    state = dict(sampler.state_dict())
    # Batches the loop consumed, not what the sampler handed out: workers prefetch ahead.
    batch_size = getattr(loader, "batch_size", None) or 1
    consumed = trainer.progress.batch_in_epoch * batch_size * trainer.strategy.world_size
    offset = trainer._position_offset
    if offset is not None and offset[0] == trainer.progress.current_epoch:
        consumed += offset[1]  # this epoch was resumed from a checkpoint of another number of ranks
    total = _dataset_len(loader)
    state["position"] = min(consumed, total) if total is not None else consumed
    state["epoch"] = trainer.progress.current_epoch
    state["batch_size"] = batch_size
    return state


def _loader_state(trainer: Trainer) -> dict[str, Any] | None:
    """The state of a train loader that keeps its own position (a ``CombinedLoader``: each inner loader's),
    when it has a length: then the loop takes exactly the batches it yields (no look-ahead), so its
    count is the loop's."""
    loader = trainer._data.train_loader
    if not callable(getattr(loader, "state_dict", None)) or not callable(getattr(loader, "load_state_dict", None)):
        return None
    try:
        len(loader)
    except TypeError:
        return None
    return loader.state_dict()


def _train_accumulators(trainer: Trainer) -> list[dict[str, Any]]:
    """The running sums of this epoch's ``on_epoch`` training metrics, mid-epoch only. Single-process
    only: other ranks' sums are not gathered."""
    p = trainer.progress
    if trainer.strategy.world_size != 1 or not p.batch_in_epoch or p.epoch_finished:
        return []
    return trainer._metrics.state_dict()


def _dataset_len(loader: Any) -> int | None:
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------- RNG
def _gather_rng(strategy: Any) -> dict[str, Any]:
    mine = capture_rng()
    world = strategy.world_size
    if world == 1:
        return {"world_size": 1, "per_rank": [mine]}
    # Every rank's state travels as fixed-shape tensors through all_gather (one collective each).
    flat = rng_to_tensor(mine)
    gathered = strategy.gather_per_rank(flat.to(strategy.root_device)).to("cpu")
    return {"world_size": world, "per_rank": [rng_from_tensor(gathered[r], mine) for r in range(world)]}


# ---------------------------------------------------------------------------------------------- resuming
def _checkpoint_callbacks(trainer: Trainer) -> list[Any]:
    return [cb for cb in trainer.callbacks if hasattr(cb, "best_model_path") and hasattr(cb, "dirpath")]


def _default_dirs(trainer: Trainer) -> list[str]:
    """Where a ModelCheckpoint without a ``dirpath`` writes: ``<log dir>/checkpoints``, for every run
    directory of the first logger when its version is not chosen yet."""
    if not trainer.loggers:
        return [os.path.join(trainer.default_root_dir, "checkpoints")]
    first = trainer.loggers[0]  # as ModelCheckpoint._resolve_dirpath
    if isinstance(first, FileLogger):
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
    given = getattr(callback, "_dirpath_given", True) and callback.dirpath
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
        warnings.warn(f"ckpt_path='last' skips {p}, {why}.", UserWarning, stacklevel=4)
    if not found:
        # Say where a checkpoint would have been found, run directories that do not exist yet included.
        first = trainer.loggers[0] if trainer.loggers else None
        if isinstance(first, FileLogger) and not any(
            cb.dirpath and getattr(cb, "_dirpath_given", False) for cb in callbacks
        ):
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
        if isinstance(lg, FileLogger):
            lg.continue_run(os.path.dirname(checkpoints), trainer.default_root_dir)


def resolve(trainer: Trainer, ckpt_path: str | os.PathLike | None, continue_run: bool = False) -> str | None:
    """Turn ``"last"``, ``"best"``, ``"auto"`` or a path into a file path (None: start fresh).

    With ``continue_run`` (fit), a restarted job resumes from its own latest checkpoint whatever
    ``ckpt_path`` says (``auto_resume.py``), and a checkpoint found in a logger's run directory
    makes the loggers whose version is not chosen write into that run directory again. Call before
    the loggers' setup.
    """
    strategy = trainer.strategy
    if continue_run and auto_resume.applies(ckpt_path):  # fit: a restarted job, or "auto" (auto_resume.py)
        chosen, found_here = (
            auto_resume.choose(trainer, ckpt_path, search_patterns(trainer))
            if strategy.is_global_zero
            else (None, False)
        )
        chosen, found_here = strategy.broadcast((chosen, found_here))
        if found_here:
            if chosen is not None:
                _continue_run(trainer, chosen)
            return chosen
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
                    stacklevel=5,
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
