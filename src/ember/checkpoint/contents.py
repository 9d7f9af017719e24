"""What a checkpoint holds, and saving one: the fit's state (``ember/state.py``) -> a dict -> the strategy's
writer. Files themselves: ``atomic.py`` and ``reading.py``; resuming: ``restore.py``.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts only, so it loads with
``torch.load(path, weights_only=True)`` and loading a file never runs code. Its keys, and the part of the
fit's state each comes from (the parts are registered by the Trainer, ``ember/trainer/state.py``):

================================  ===================================================================  ==========
key                               what                                                                 part
================================  ===================================================================  ==========
``format``                        ``"ember.checkpoint"``; ``format_version``, ``ember_version`` and    (header)
                                  ``torch_version`` beside it
``module_class``                  ``"package.module.ClassName"`` of the module, for messages           module
``state_dict``                    the module's weights (unwrapped from any strategy wrapper)           module
``hyper_parameters``              what ``save_hyperparameters`` stored (entries that are not plain     module
                                  data are dropped)
``hparams_name``                  the argument a config object was saved from                          module
                                  (``save_hyperparameters(cfg)``), or None
``datamodule_hyper_parameters``   the same for the datamodule, when it saved some (and                 datamodule
                                  ``datamodule_hparams_name``)
``weights_only``                  True when only the above was saved (``save_weights_only``)           (header)
``epoch``, ``global_step``        the progress, for readers that restore nothing (auto-resume)         progress
``strategy``                      strategy name, world size                                            (header)
``job``                           the torchrun or SLURM job that wrote it, or None (a restart          (header)
                                  resumes its own job's only)
``optimizer_states``              one ``state_dict`` per optimizer, its class under                    optimizers
                                  ``optimizer_class``
``lr_schedulers``                 one ``state_dict`` per LR scheduler                                  optimizers
``precision``                     GradScaler state (empty unless 16-mixed)                             precision
``progress``                      epoch, global step, batches consumed in the epoch, validation        progress
                                  progress
``sampler``                       ``{"seed", "epoch", "position"}`` of the training sampler, or None   position
``loader``                        a train loader's own ``state_dict()`` (a ``CombinedLoader``: each    position
                                  inner loader's), or None
``callbacks``                     ``{callback.state_key: callback.state_dict()}``                      callbacks
<DataModule qualname>             the datamodule's ``state_dict()`` when not empty, under its          datamodule
                                  class's ``__qualname__`` (Lightning's key; ``"datamodule"`` in
                                  files of earlier versions is still read)
``callback_metrics``              the latest logged values (what monitors compare against)             metrics
``epoch_metrics``                 mid-epoch in one process, the running sums of the epoch's values     metrics
``rng``                           torch / CUDA / Python / NumPy generator states, one per rank         rng
================================  ===================================================================  ==========

A weights-only checkpoint holds the entries down to ``job`` (the parts registered with
``weights=True`` and every part's ``summary()``). ``TrainModule.on_save_checkpoint`` and callbacks'
``on_save_checkpoint`` may add keys of their own, with the same plain-data rule (checked before anything is
written).

:func:`dump` builds the dict from the parts alone: the header above, every part's ``summary()``, every
part's ``state_dict()`` side by side, then the parts' ``on_save_checkpoint`` hooks (the callbacks', then
the module's). Writes are atomic and durable: the file is written under a temporary name in the same
directory, flushed and fsynced, then renamed over the target, and the directory is fsynced. A crash at any
moment leaves either the previous file or the new one under the checkpoint's name, never a truncated one.
Only global rank zero writes, through the strategy's writer (``writer.py``); the others wait at a barrier.
A save that passes a ``BackgroundSave`` (``ModelCheckpoint(async_save=True)``) is written by the strategy's
background writer: rank zero copies the state and a thread writes the same file (``background.py``); every
save waits for the write in flight first.

A resume is exact from the points where ModelCheckpoint and preemption write: a step boundary (after the
optimizer step, step-interval schedulers and any validation of that batch; callbacks get it as
``on_train_step_boundary(trainer, module)``), the end of a validation, or the end of a training epoch.
``trainer.save_checkpoint`` called from another hook (say ``on_train_batch_end``, before the step is
counted) records the state of that moment, which a resume does not replay exactly. Partial gradients of an
open accumulation window are not saved.

Resuming under a different world size continues the epoch from the first sample of the global order that
no rank has seen. What cannot carry over is each rank's RNG stream: ranks that did not exist in the saved
run keep the stream ``seed_everything`` gave them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from ember.checkpoint import auto_resume
from ember.checkpoint.format import FORMAT, FORMAT_VERSION, check_plain_data
from ember.checkpoint.writer import BackgroundSave
from ember.version import __version__

if TYPE_CHECKING:
    from collections.abc import Callable

    from ember.state import State
    from ember.strategies.strategy import Strategy

#: The keys the table above names: a key of a part's own choosing (a datamodule's class name) must not be one
#: of them. (``"datamodule"``, the key of earlier versions, is not: a class of that name saves under it.)
ENTRIES = frozenset(
    (
        "format",
        "format_version",
        "ember_version",
        "torch_version",
        "module_class",
        "state_dict",
        "hyper_parameters",
        "hparams_name",
        "datamodule_hyper_parameters",
        "datamodule_hparams_name",
        "weights_only",
        "epoch",
        "global_step",
        "strategy",
        "job",
        "optimizer_states",
        "lr_schedulers",
        "precision",
        "progress",
        "sampler",
        "loader",
        "callbacks",
        "callback_metrics",
        "epoch_metrics",
        "rng",
    )
)


def dump(state: State, strategy: Strategy, weights_only: bool = False) -> dict[str, Any]:
    """Everything needed to resume the fit ``state`` describes (or only the weights). Runs on every rank:
    some parts gather from every rank (the RNG states).

    Args:
        state: the fit's parts (``trainer.fit_state``).
        strategy: the run's strategy (its name and world size are recorded).
        weights_only: the parts registered with ``weights=True`` (the module's weights) only.
    """
    ckpt: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "ember_version": __version__,
        "torch_version": str(torch.__version__),
    }
    for _, part in state.parts():
        summary = getattr(part, "summary", None)
        if summary is not None:
            ckpt.update(summary())
    ckpt["weights_only"] = weights_only
    ckpt["strategy"] = {"name": strategy.strategy_name, "world_size": strategy.world_size}
    ckpt["job"] = auto_resume.job_key()
    parts = state.parts(weights_only=weights_only)
    for name, part in parts:
        entries = part.state_dict()
        taken = [key for key in entries if key in ckpt]
        if taken:
            raise ValueError(f"The {name!r} part's state would overwrite the checkpoint's entries {taken}.")
        ckpt.update(entries)
    for _, part in reversed(parts):  # the module, registered first, has the last word (as Lightning)
        hook = getattr(part, "on_save_checkpoint", None)
        if hook is not None:
            hook(ckpt)
    return ckpt


def save(
    state: State,
    strategy: Strategy,
    filepath: str | os.PathLike,
    weights_only: bool = False,
    storage_options: BackgroundSave | None = None,
    before_rename: Callable[[str], None] | None = None,
) -> str:
    """Write the fit's checkpoint to ``filepath`` (rank zero writes, every rank returns the path).

    Waits for the write in flight on the strategy's background writer first (raising its error, if it
    failed), so files land in the order the saves were made and the callbacks' lists of files (published
    when their write completes) are those of the files on disk. The write itself is synchronous, unless
    ``storage_options`` is a :class:`BackgroundSave`: then rank zero copies the tensors and returns while
    a thread writes them (``background.py``).

    Args:
        state: the fit's parts (``trainer.fit_state``).
        strategy: the run's strategy, whose writer writes the file.
        filepath: the file to write.
        weights_only: the weights and hyper-parameters only.
        storage_options: None, or a ``BackgroundSave`` (Lightning's argument for how to save to storage).
        before_rename: passed to ``write_atomic`` (tests use it to stop at the worst moment).
    """
    if storage_options is not None and not isinstance(storage_options, BackgroundSave):
        raise TypeError(
            "Trainer.save_checkpoint(storage_options=...) takes None or an ember.checkpoint.BackgroundSave "
            f"(write on a background thread), got {type(storage_options).__name__}. ember writes checkpoints "
            "to the local filesystem only; pass storage_options=None."
        )
    filepath = strategy.broadcast(os.path.abspath(os.fspath(filepath)))
    strategy.background_writer.wait()
    ckpt = dump(state, strategy, weights_only)
    check_plain_data(ckpt)
    strategy.save_checkpoint(ckpt, filepath, storage_options, before_rename)
    strategy.barrier("save_checkpoint")
    return filepath
