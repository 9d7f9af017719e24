"""Checkpoint contents, saving, and resuming (files themselves: ``ember/checkpoint_io.py``).

A checkpoint is a dict of tensors, numbers, strings, lists and dicts only, so it loads with
``torch.load(path, weights_only=True)`` and loading a file never runs code. Keys:

=====================  ==================================================================
``format``             ``"ember.checkpoint"``; ``format_version`` and ``ember_version`` beside it
``state_dict``         the module's weights (unwrapped from any strategy wrapper)
``hyper_parameters``   what ``save_hyperparameters`` stored (entries that are not plain data are dropped)
``module_class``       ``"package.module.ClassName"`` of the module, for messages
``weights_only``       True when only the above was saved (``save_weights_only``)
``optimizer_states``   one ``state_dict`` per optimizer
``lr_schedulers``      one ``state_dict`` per LR scheduler
``precision``          GradScaler state (empty unless 16-mixed)
``progress``           epoch, global step, batches consumed in the epoch, validation progress
``sampler``            ``{"seed", "epoch", "position"}`` of the training sampler, or None
``callbacks``          ``{callback.state_key: callback.state_dict()}``
``callback_metrics``   the latest logged values (what monitors compare against)
``rng``                torch / CUDA / Python / NumPy generator states, one entry per rank
``strategy``           strategy name, world size
=====================  ==================================================================

``TrainModule.on_save_checkpoint`` and callbacks' ``on_save_checkpoint`` may add keys of their
own, with the same plain-data rule (checked before anything is written).

Writes are atomic and durable: the file is written under a temporary name in the same directory,
flushed and fsynced, then renamed over the target, and the directory is fsynced. A crash at any
moment leaves either the previous file or the new one under the checkpoint's name, never a
truncated one. Only global rank zero writes; the others wait at a barrier.

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

import copy
import glob
import math
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.callback import Callback
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
from ember.strategies.resumable import SkipFirstBatches, resumable_sampler_of
from ember.trainer import checkpoint_check
from ember.trainer.metrics import _Entry
from ember.version import __version__

if TYPE_CHECKING:
    from ember.data import DataModule
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer


def _plain_hparams(module: TrainModule) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in dict(module.hparams).items():
        try:
            check_plain_data(v)
        except CheckpointError:
            warnings.warn(f"Hyper-parameter {k!r} ({type(v).__name__}) is not plain data and is left out of the "
                          f"checkpoint. Pass ignore=[{k!r}] to save_hyperparameters to silence this.", UserWarning)
            continue
        out[k] = v
    return out


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
        "weights_only": weights_only,
        "epoch": trainer.progress.current_epoch,
        "global_step": trainer.progress.global_step,
        "strategy": {"name": strategy.strategy_name, "world_size": strategy.world_size},
    }
    if not weights_only:
        ckpt["optimizer_states"] = [opt.state_dict() for opt in trainer._optim.optimizers]
        ckpt["lr_schedulers"] = [cfg.scheduler.state_dict() for cfg in trainer._optim.schedulers]
        ckpt["precision"] = trainer._precision.state_dict()
        ckpt["progress"] = trainer.progress.state_dict()
        if trainer.state == "fitting" and trainer._metrics.stage == "validate":  # inside a validation not yet counted
            ckpt["progress"]["val_checks_in_epoch"] += 1
        ckpt["sampler"] = _sampler_state(trainer)
        ckpt["callbacks"] = {cb.state_key: cb.state_dict() for cb in trainer.callbacks}
        if trainer.datamodule is not None:
            ckpt["datamodule"] = trainer.datamodule.state_dict()
        ckpt["callback_metrics"] = {k: (v.detach().to("cpu") if isinstance(v, torch.Tensor) else v)
                                    for k, v in trainer.callback_metrics.items()}
        ckpt["epoch_metrics"] = _train_accumulators(trainer)
        ckpt["rng"] = _gather_rng(strategy)
        for cb in trainer.callbacks:
            if type(cb).on_save_checkpoint is not Callback.on_save_checkpoint:
                cb.on_save_checkpoint(trainer, module, ckpt)
    module.on_save_checkpoint(ckpt)
    return ckpt


def save(trainer: Trainer, filepath: str, weights_only: bool = False,
         before_rename: Callable[[str], None] | None = None) -> str:
    """Write ``trainer``'s checkpoint to ``filepath`` (rank zero writes, every rank returns the path)."""
    if trainer.module is None:
        raise RuntimeError("save_checkpoint needs a module: call it during or after trainer.fit(...).")
    strategy = trainer.strategy
    filepath = strategy.broadcast(os.path.abspath(os.fspath(filepath)))
    ckpt = dump(trainer, weights_only)
    check_plain_data(ckpt)

    def writer(obj: dict[str, Any], path: str) -> None:
        write_atomic(obj, path, before_rename)

    strategy.save_checkpoint(ckpt, filepath, writer)
    strategy.barrier("save_checkpoint")
    return filepath


def _sampler_state(trainer: Trainer) -> dict[str, Any] | None:
    loader = trainer._train_loader
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


_ENTRY_FIELDS = ("name", "prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "sync_dist")


def _train_accumulators(trainer: Trainer) -> list[dict[str, Any]]:
    """The running sums behind this epoch's ``on_epoch`` training metrics, so that a mid-epoch resume
    logs the same epoch values. Single-process only: other ranks' sums are not gathered."""
    p = trainer.progress
    if trainer.strategy.world_size != 1 or not p.batch_in_epoch or p.epoch_finished:
        return []
    out = []
    for e in trainer._metrics._stages.get("train", {}).values():
        d = {f: getattr(e, f) for f in _ENTRY_FIELDS}
        d["total"] = e.total.detach().to("cpu") if isinstance(e.total, torch.Tensor) else e.total
        d["weight"] = e.weight.detach().to("cpu") if isinstance(e.weight, torch.Tensor) else e.weight
        out.append(d)
    return out


def _restore_train_accumulators(trainer: Trainer, saved: list[dict[str, Any]]) -> None:
    if not saved or trainer.strategy.world_size != 1:
        return
    device = trainer.strategy.root_device
    stage = {}
    for d in saved:
        e = _Entry(*(d[f] for f in _ENTRY_FIELDS))
        e.total = d["total"].to(device) if isinstance(d["total"], torch.Tensor) else d["total"]
        e.weight = d["weight"].to(device) if isinstance(d["weight"], torch.Tensor) else d["weight"]
        stage[e.name] = e
    trainer._metrics._stages["train"] = stage


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
    gathered = strategy.all_gather(flat.to(strategy.root_device)).to("cpu")
    return {"world_size": world, "per_rank": [rng_from_tensor(gathered[r], mine) for r in range(world)]}


# ---------------------------------------------------------------------------------------------- resuming
def _checkpoint_callbacks(trainer: Trainer) -> list[Any]:
    return [cb for cb in trainer.callbacks if hasattr(cb, "best_model_path") and hasattr(cb, "dirpath")]


def _default_dirs(trainer: Trainer) -> list[str]:
    """Where a ModelCheckpoint without a ``dirpath`` writes: ``<log dir>/checkpoints``, for every run
    directory of the first logger when its version is not chosen yet."""
    for lg in trainer.loggers:
        if isinstance(lg, FileLogger):
            return [os.path.join(d, "checkpoints") for d in lg.run_dirs(trainer.default_root_dir)]
        if lg.log_dir is not None:
            return [os.path.join(lg.log_dir, "checkpoints")]
    return [os.path.join(trainer.default_root_dir, "checkpoints")]


def default_dir(trainer: Trainer) -> str:
    return os.path.join(trainer.default_root_dir, "checkpoints")


def find_last(trainer: Trainer) -> tuple[str | None, list[str]]:
    """The most recently written ``last*.ckpt`` where this Trainer's checkpoints go, and the
    directories searched (with the default logger: every ``version_N`` of ``default_root_dir``)."""
    dirs: list[str] = []
    callbacks = _checkpoint_callbacks(trainer)
    for cb in callbacks:
        given = getattr(cb, "_dirpath_given", True) and cb.dirpath
        for d in ([cb.dirpath] if given else _default_dirs(trainer)):
            if os.path.abspath(d) not in dirs:
                dirs.append(os.path.abspath(d))
    for d in _default_dirs(trainer) + [default_dir(trainer)]:
        if os.path.abspath(d) not in dirs:
            dirs.append(os.path.abspath(d))
    found = [p for d in dirs for p in glob.glob(os.path.join(glob.escape(d), "last*.ckpt"))]
    if not found:
        return None, dirs
    return max(found, key=os.path.getmtime), dirs


def _continue_run(trainer: Trainer, path: str) -> None:
    """Loggers whose version is not chosen continue the run ``path`` belongs to
    (``<root>/<version>/checkpoints/last.ckpt``), so its curves and checkpoints carry on there."""
    checkpoints = os.path.dirname(os.path.abspath(path))
    if os.path.basename(checkpoints) != "checkpoints":
        return
    for lg in trainer.loggers:
        if isinstance(lg, FileLogger):
            lg.continue_run(os.path.dirname(checkpoints), trainer.default_root_dir)


def resolve(trainer: Trainer, ckpt_path: str | os.PathLike, continue_run: bool = False) -> str | None:
    """Turn ``"last"``, ``"best"`` or a path into a file path (None: start fresh).

    With ``continue_run`` (fit), a ``"last"`` found in a logger's run directory makes the loggers
    whose version is not chosen write into that run directory again. Call before the loggers' setup.
    """
    strategy = trainer.strategy
    if ckpt_path == "last":
        found, dirs = find_last(trainer) if strategy.is_global_zero else (None, [])
        found = strategy.broadcast(found)
        if found is None:
            if strategy.is_global_zero:
                warnings.warn(f"ckpt_path='last' found no checkpoint (searched {dirs}); starting from scratch.",
                              UserWarning, stacklevel=5)
            return None
        if continue_run:
            _continue_run(trainer, found)
        return found
    if ckpt_path == "best":
        best = [cb.best_model_path for cb in _checkpoint_callbacks(trainer) if cb.best_model_path]
        if not best:
            raise CheckpointError("ckpt_path='best' but no ModelCheckpoint of this Trainer has saved a best "
                                  "checkpoint yet. Pass a path, or 'last'.")
        return best[0]
    return os.fspath(ckpt_path)


def restore_weights(trainer: Trainer, path: str) -> tuple[dict[str, Any], Callable[[], None]]:
    """A fit resume's first part, before ``configure_optimizers`` (as in Lightning): the module's
    ``on_load_checkpoint`` and its weights. Returns the checkpoint and a function that puts the
    previous weights back, which ``restore(..., early=...)`` calls should the rest not fit."""
    ckpt = load(path)
    module = trainer.module
    assert module is not None
    if ckpt.get("weights_only") or "progress" not in ckpt:
        raise CheckpointError(f"{path!r} holds weights only (save_weights_only=True), not the optimizer and progress "
                              "state a fit resumes from. Start a new fit from it with "
                              f"{type(module).__name__}.load_from_checkpoint(path), or resume from a full checkpoint.")
    checkpoint_check.validate(trainer, ckpt, path, before_optimizers=True)
    module.on_load_checkpoint(ckpt)
    check_state_dict(module, ckpt["state_dict"], path, exact_dtype=True)
    previous = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
    module.load_state_dict(ckpt["state_dict"], strict=True)  # by keyword, as Lightning

    def undo() -> None:
        module.load_state_dict(previous)
    return ckpt, undo


def restore_weights_only(trainer: Trainer, path: str) -> dict[str, Any]:
    """validate / test / predict with ``ckpt_path``: the module's weights only."""
    ckpt = load(path)
    module = trainer.module
    assert module is not None  # restored at the start of a run, with the module attached
    module.on_load_checkpoint(ckpt)
    check_state_dict(module, ckpt["state_dict"], path)
    module.load_state_dict(ckpt["state_dict"])
    trainer.ckpt_path = path
    return ckpt


def restore(trainer: Trainer, path: str, early: tuple[dict[str, Any], Callable[[], None]]) -> dict[str, Any]:
    """A fit resume's second part, after ``on_fit_start`` and the loaders: everything but the weights.

    ``early`` is what ``restore_weights`` returned. Transactional: every remaining entry is
    validated against this run (``checkpoint_check``) before anything changes; should a callback's
    own ``load_state_dict`` (or anything else) still fail while applying, the optimizers,
    schedulers, callbacks, progress and RNG states are put back, and so are the previous weights.
    """
    ckpt, undo_weights = early
    try:
        checkpoint_check.validate(trainer, ckpt, path)
        for cb in trainer.callbacks:
            if type(cb).on_load_checkpoint is not Callback.on_load_checkpoint:
                cb.on_load_checkpoint(trainer, trainer.module, ckpt)  # type: ignore[arg-type]
        undo = _snapshot(trainer)
        try:
            _apply(trainer, ckpt, path)
        except BaseException:
            undo()
            raise
    except BaseException:
        undo_weights()
        raise
    trainer.ckpt_path = path
    return ckpt


def _apply(trainer: Trainer, ckpt: dict[str, Any], path: str) -> None:
    """Everything but the weights, user callbacks (the likeliest to fail) first."""
    for cb in trainer.callbacks:
        state = (ckpt.get("callbacks") or {}).get(cb.state_key)
        if state:
            cb.load_state_dict(state)
    for opt, state in zip(trainer._optim.optimizers, ckpt["optimizer_states"]):
        opt.load_state_dict(state)
        if ckpt["progress"].get("global_step", 0) > 0:
            # The optimizer has stepped in the saved run: keep torch's "scheduler stepped before the optimizer"
            # warning quiet when a resumed epoch end steps a scheduler first.
            opt._opt_called = True  # type: ignore[attr-defined]
    for cfg, state in zip(trainer._optim.schedulers, ckpt["lr_schedulers"]):
        cfg.scheduler.load_state_dict(state)
    if trainer.datamodule is not None and ckpt.get("datamodule"):
        trainer.datamodule.load_state_dict(ckpt["datamodule"])
    trainer._precision.load_state_dict(ckpt.get("precision") or {})
    trainer.progress.load_state_dict(ckpt["progress"])
    trainer._metrics.callback_metrics.update(ckpt.get("callback_metrics") or {})
    _restore_train_accumulators(trainer, ckpt.get("epoch_metrics") or [])
    _restore_data_position(trainer, ckpt, path)
    _restore_rng(trainer, ckpt)


def _snapshot(trainer: Trainer) -> Callable[[], None]:
    """What ``_apply`` may change, and a function that puts it back. At the start of a fit the
    optimizers hold no state yet, so their copies are small."""
    # Callbacks, and the datamodule: both restore through state_dict / load_state_dict.
    callbacks: list[tuple[Callback | DataModule, dict[str, Any]]] = [
        (cb, copy.deepcopy(cb.state_dict())) for cb in trainer.callbacks]
    if trainer.datamodule is not None:
        callbacks.append((trainer.datamodule, copy.deepcopy(trainer.datamodule.state_dict())))
    optimizers = [(opt, copy.deepcopy(opt.state_dict())) for opt in trainer._optim.optimizers]
    schedulers = [(cfg.scheduler, copy.deepcopy(cfg.scheduler.state_dict())) for cfg in trainer._optim.schedulers]
    precision = copy.deepcopy(trainer._precision.state_dict())
    progress = trainer.progress.state_dict()
    metrics = dict(trainer._metrics.callback_metrics)
    stages = dict(trainer._metrics._stages)
    loader, offset = trainer._train_loader, trainer._position_offset
    sampler = resumable_sampler_of(loader)
    sampler_state = sampler.state_dict() if sampler is not None else None
    rng = capture_rng()

    def undo() -> None:
        for cb, state in callbacks:
            try:
                cb.load_state_dict(state)
            except Exception:  # the callback that failed to load fails again: the first error is the one to see
                pass
        for opt, state in optimizers:
            opt.load_state_dict(state)
        for sched, state in schedulers:
            sched.load_state_dict(state)
        trainer._precision.load_state_dict(precision)
        trainer.progress.load_state_dict(progress)
        trainer._metrics.callback_metrics = metrics
        trainer._metrics._stages = stages
        trainer._train_loader, trainer._position_offset = loader, offset
        if sampler is not None:
            sampler.load_state_dict(sampler_state)
        apply_rng(rng)
    return undo


def _restore_data_position(trainer: Trainer, ckpt: dict[str, Any], path: str) -> None:
    progress = trainer.progress
    saved = ckpt.get("sampler")
    saved_world = int(ckpt.get("strategy", {}).get("world_size", 1))
    world = trainer.strategy.world_size
    loader = trainer._train_loader
    sampler = resumable_sampler_of(loader)
    new_world = saved is not None and saved_world != world and progress.batch_in_epoch and not progress.epoch_finished
    if new_world and saved is not None:
        # Continue from the next unseen sample of the global order, counted in this run's batches.
        batch_size = getattr(loader, "batch_size", None) or saved.get("batch_size", 1)
        progress.batch_in_epoch = math.ceil(saved["position"] / (batch_size * world))
    if sampler is not None:
        if saved is not None:
            full = _len_or_none(loader)
            # An epoch whose end already ran continues with the next epoch, from its first sample.
            position = 0 if progress.epoch_finished else saved["position"]
            sampler.load_state_dict({"seed": saved["seed"], "epoch": saved["epoch"], "position": position})
            left = _len_or_none(loader)
            if new_world:
                if full is not None and left is not None:
                    # What is left of the epoch is padded to a multiple of this run's ranks (see
                    # ShardedSampler._end): count as done what this run's epoch length leaves over,
                    # so the loop runs exactly the batches the sampler still yields on every rank.
                    progress.batch_in_epoch = max(0, full - left)
                # How far that count is from the global position, so checkpoints written later in
                # this epoch record where it really is.
                trainer._position_offset = (progress.current_epoch,
                                            saved["position"] - progress.batch_in_epoch * batch_size * world)
        return
    if progress.batch_in_epoch and not progress.epoch_finished:
        warnings.warn(f"Resuming mid-epoch from {path!r} with a train loader ember cannot resume at the sampler level: "
                      f"the first {progress.batch_in_epoch} batches of the epoch are loaded again and skipped, and the "
                      "order matches the interrupted run only if the loader's order is deterministic. Use a plain "
                      "DataLoader (map-style dataset, default sampler) for an exact resume.", UserWarning)
        trainer._train_loader = SkipFirstBatches(loader, progress.batch_in_epoch)


def _len_or_none(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _restore_rng(trainer: Trainer, ckpt: dict[str, Any]) -> None:
    rng = ckpt.get("rng")
    if not rng:
        return
    rank, world = trainer.strategy.global_rank, trainer.strategy.world_size
    per_rank = rng["per_rank"]
    if world != rng.get("world_size", len(per_rank)) and trainer.strategy.is_global_zero:
        warnings.warn(f"The checkpoint was written by {len(per_rank)} process(es) and this run has {world}: per-rank "
                      "random streams cannot carry over exactly; ranks that did not exist keep their current streams.",
                      UserWarning)
    if rank < len(per_rank):
        apply_rng(per_rank[rank])
