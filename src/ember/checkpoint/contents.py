"""Checkpoint contents and saving (files themselves: ``io.py``; resuming: ``restore.py``).

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
``optimizer_states``   one ``state_dict`` per optimizer, with its class under ``optimizer_class``
``lr_schedulers``      one ``state_dict`` per LR scheduler
``precision``          GradScaler state (empty unless 16-mixed)
``progress``           epoch, global step, batches consumed in the epoch, validation progress
``sampler``            ``{"seed", "epoch", "position"}`` of the training sampler, or None
``loader``             a train loader's own ``state_dict()`` (a ``CombinedLoader``: each inner loader's), or None
``callbacks``          ``{callback.state_key: callback.state_dict()}``
<DataModule qualname>  the datamodule's ``state_dict()`` when not empty, under its class's ``__qualname__``
                       (Lightning's key; ``"datamodule"`` in files of earlier versions is still read)
``callback_metrics``   the latest logged values (what monitors compare against)
``rng``                torch / CUDA / Python / NumPy generator states, one entry per rank
``strategy``           strategy name, world size
``job``                the torchrun or SLURM job that wrote it, or None (a restart resumes its own job's only)
=====================  ==================================================================

``TrainModule.on_save_checkpoint`` and callbacks' ``on_save_checkpoint`` may add keys of their
own, with the same plain-data rule (checked before anything is written).

The fit's own state comes from ``trainer.fit_state`` (``ember/trainer/state.py``), each part through
its ``state_dict``; the module's weights, the callbacks', the datamodule's and the RNG states from
their owners. Writes are atomic and durable: the file is written under a temporary name in the same
directory, flushed and fsynced, then renamed over the target, and the directory is fsynced. A crash
at any moment leaves either the previous file or the new one under the checkpoint's name, never a
truncated one. Only global rank zero writes, through the strategy's writer (``writer.py``); the
others wait at a barrier. A save that passes a ``BackgroundSave`` (``ModelCheckpoint(async_save=True)``)
is written by the strategy's background writer: rank zero copies the state and a thread writes the
same file (``background.py``); every save waits for the write in flight first.

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

import os
import warnings
from typing import TYPE_CHECKING, Any

import torch

from ember.checkpoint import auto_resume
from ember.checkpoint.io import FORMAT, FORMAT_VERSION, CheckpointError, check_plain_data
from ember.checkpoint.writer import BackgroundSave
from ember.rng import capture_rng, rng_from_tensor, rng_to_tensor
from ember.utils import defines_hook
from ember.version import __version__

if TYPE_CHECKING:
    from collections.abc import Callable

    from ember.strategies.strategy import Strategy
    from ember.trainer.state import FitState
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


def overrides(obj: Any, name: str) -> bool:
    """Whether ``obj`` (a callback) runs hook ``name``: ``ember.utils.defines_hook`` against the class
    highest in its MRO that declares ``name`` (``Callback`` for a callback), as
    ``ember.callbacks.callback.overrides`` decides; this package sits below the callbacks and does not
    import their base. ``None`` on the instance turns the hook off."""
    declaring = [k for k in type(obj).__mro__ if name in vars(k)]
    return bool(declaring) and defines_hook(name, obj, declaring[-1])


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


def dump(trainer: Trainer, state: FitState, weights_only: bool = False) -> dict[str, Any]:
    """Everything needed to resume ``trainer``'s fit (or only the weights). Runs on every rank.

    Args:
        trainer: the Trainer, with its module attached (its public attributes only are read).
        state: the fit's state (``trainer.fit_state``).
        weights_only: the weights and hyper-parameters only.
    """
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
        "epoch": state.progress.current_epoch,
        "global_step": state.progress.global_step,
        "strategy": {"name": strategy.strategy_name, "world_size": strategy.world_size},
        "job": auto_resume.job_key(),
    }
    if not weights_only:
        fit = state.state_dict(fitting=trainer.state == "fitting")
        for key in ("optimizer_states", "lr_schedulers", "precision", "progress", "sampler", "loader"):
            ckpt[key] = fit[key]
        ckpt["callbacks"] = {cb.state_key: cb.state_dict() for cb in trainer.callbacks}
        if trainer.datamodule is not None:
            _put_datamodule_state(ckpt, trainer.datamodule)
        ckpt["callback_metrics"] = fit["callback_metrics"]
        ckpt["epoch_metrics"] = fit["epoch_metrics"]
        ckpt["rng"] = _gather_rng(strategy)
        for cb in trainer.callbacks:
            if overrides(cb, "on_save_checkpoint"):
                cb.on_save_checkpoint(trainer, module, ckpt)
    module.on_save_checkpoint(ckpt)
    return ckpt


def save(
    trainer: Trainer,
    state: FitState,
    filepath: str | os.PathLike,
    weights_only: bool = False,
    storage_options: BackgroundSave | None = None,
    before_rename: Callable[[str], None] | None = None,
) -> str:
    """Write ``trainer``'s checkpoint to ``filepath`` (rank zero writes, every rank returns the path).

    Waits for the write in flight on the strategy's background writer first (raising its error, if it
    failed), so files land in the order the saves were made and the callbacks' lists of files (published
    when their write completes) are those of the files on disk. The write itself is synchronous, unless
    ``storage_options`` is a :class:`BackgroundSave`: then rank zero copies the tensors and returns while
    a thread writes them (``background.py``).

    Args:
        trainer: the Trainer, with its module attached.
        state: the fit's state (``trainer.fit_state``).
        filepath: the file to write.
        weights_only: the weights and hyper-parameters only.
        storage_options: None, or a ``BackgroundSave`` (Lightning's argument for how to save to storage).
        before_rename: passed to ``write_atomic`` (tests use it to stop at the worst moment).
    """
    if trainer.module is None:
        raise RuntimeError("save_checkpoint needs a module: call it during or after trainer.fit(...).")
    if storage_options is not None and not isinstance(storage_options, BackgroundSave):
        raise TypeError(
            "Trainer.save_checkpoint(storage_options=...) takes None or an ember.checkpoint.BackgroundSave "
            f"(write on a background thread), got {type(storage_options).__name__}. ember writes checkpoints "
            "to the local filesystem only; pass storage_options=None."
        )
    strategy = trainer.strategy
    filepath = strategy.broadcast(os.path.abspath(os.fspath(filepath)))
    strategy.background_writer.wait()
    ckpt = dump(trainer, state, weights_only)
    check_plain_data(ckpt)
    strategy.save_checkpoint(ckpt, filepath, storage_options, before_rename)
    strategy.barrier("save_checkpoint")
    return filepath


# ---------------------------------------------------------------------------------------------- RNG
def _gather_rng(strategy: Strategy) -> dict[str, Any]:
    mine = capture_rng()
    world = strategy.world_size
    if world == 1:
        return {"world_size": 1, "per_rank": [mine]}
    # Every rank's state travels as one fixed-shape CPU tensor through one all-gather, which a strategy does
    # on the host (ddp: its CPU control group), so a save under NCCL waits for no GPU work here.
    gathered = strategy.gather_per_rank(rng_to_tensor(mine))
    return {"world_size": world, "per_rank": [rng_from_tensor(gathered[r], mine) for r in range(world)]}
