"""Resuming a fit from a checkpoint, in Lightning's order and all or nothing.

Three parts, each where Lightning does it:

1. ``modules_and_callbacks`` (before ``configure_optimizers``): the module's ``on_load_checkpoint``
   and weights, the datamodule's state, the callbacks' ``on_load_checkpoint`` and state.
2. ``training_state`` (after ``on_fit_start``, before the loaders are requested): optimizers,
   schedulers, precision, progress, metrics and the training epoch's running sums.
3. ``data_position`` (once the train loader exists): where the sampler continues, and the RNG states.

Each part first validates the entries it applies (``checkpoint_check``), and a failure in any
part puts back everything the earlier parts changed, so a bad file leaves the run as it was.
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import Callback, overrides
from ember.checkpoint_io import CheckpointError, check_state_dict, load, match_compiled_keys
from ember.data import DataModule, saved_state
from ember.rng import apply_rng, capture_rng
from ember.strategies.resumable import SkipFirstBatches, resumable_sampler_of
from ember.trainer import checkpoint_check
from ember.utils import sized_len

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer

log = logging.getLogger(__name__)


class Resume:
    """One fit's resume from ``path``; the Trainer and the fit loop call its three parts in order.

    Args:
        trainer: the resuming Trainer, with its module (and datamodule) attached.
        path: the checkpoint file (``"last"`` / ``"best"`` already resolved).
    """

    def __init__(self, trainer: Trainer, path: str) -> None:
        self.trainer, self.path = trainer, path
        self.ckpt: dict[str, Any] = {}
        self._undo: list[Callable[[], None]] = []  # one per part applied, in order

    def _rollback(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _validate(self, part: str) -> None:
        try:
            checkpoint_check.validate(self.trainer, self.ckpt, self.path, part)
        except BaseException:
            self._rollback()
            raise

    def modules_and_callbacks(self, fit: bool = True) -> None:
        """The first part of a fit resume; with ``fit=False``, all that validate / test / predict restore
        from ``ckpt_path`` (as Lightning: the weights, the datamodule's and the callbacks' state)."""
        trainer, path = self.trainer, self.path
        self.ckpt = ckpt = load(path, purpose="fit" if fit else "evaluate")
        module = trainer.module
        assert module is not None
        if fit and (ckpt.get("weights_only") or "progress" not in ckpt):
            raise CheckpointError(
                f"{path!r} holds weights only (save_weights_only=True), not the optimizer and "
                "progress state a fit resumes from. Start a new fit from it with "
                f"{type(module).__name__}.load_from_checkpoint(path), or resume from a full "
                "checkpoint."
            )
        self._validate("modules" if fit else "evaluation")
        # A fit continues training in the saved dtype; evaluation may cast (a float64 file into float32).
        ckpt["state_dict"] = match_compiled_keys(module, ckpt["state_dict"])  # saved with or without torch.compile
        # A module with strict_loading=False (it saves part of its weights) loads the keys the file holds;
        # a shape mismatch still raises in load_state_dict, and the undo below puts the weights back.
        strict = module.strict_loading
        if strict:
            check_state_dict(module, ckpt["state_dict"], path, exact_dtype=fit)
        # Callbacks and the datamodule restore through their hooks (load_state_dict, on_load_checkpoint).
        # The copies to put back, should a later part fail, are of their attributes, taken without
        # calling any of their hooks: a Lightning user sees each hook called exactly as Lightning calls it.
        weights = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        saved = ckpt.get("callbacks") or {}
        touched: list[tuple[Callback | DataModule, dict[str, Any]]] = []
        shared = {id(o): o for o in (trainer, module, trainer.datamodule, *trainer.callbacks) if o is not None}

        def touch(owner: Callback | DataModule) -> None:
            if hasattr(owner, "__dict__") and all(owner is not o for o, _ in touched):
                touched.append((owner, _snapshot(vars(owner), shared)))

        def undo() -> None:
            module.load_state_dict(weights)
            for owner, attributes in reversed(touched):
                vars(owner).clear()
                vars(owner).update(attributes)

        self._undo.append(undo)
        try:
            module.on_load_checkpoint(ckpt)
            module.load_state_dict(ckpt["state_dict"], strict=strict)  # by keyword, as Lightning
            if not fit:
                trainer.ckpt_path = path
            dm = trainer.datamodule
            dm_state = None if dm is None else saved_state(ckpt, dm)
            if dm is not None and dm_state:
                touch(dm)
                dm.load_state_dict(dm_state)
            for cb in trainer.callbacks:
                if overrides(cb, "on_load_checkpoint"):
                    touch(cb)
                    cb.on_load_checkpoint(trainer, module, ckpt)
            for cb in trainer.callbacks:
                if saved.get(cb.state_key):
                    touch(cb)
                    cb.load_state_dict(saved[cb.state_key])
        except BaseException:
            self._rollback()
            raise

    def training_state(self) -> None:
        trainer, ckpt = self.trainer, self.ckpt
        self._validate("training")
        optim, metrics = trainer._optim, trainer._metrics
        # At the start of a fit the optimizers hold no state yet, so these copies are small.
        optimizers = [(opt, copy.deepcopy(opt.state_dict())) for opt in optim.optimizers]
        schedulers = [(cfg.scheduler, copy.deepcopy(cfg.scheduler.state_dict())) for cfg in optim.schedulers]
        precision = copy.deepcopy(trainer._precision.state_dict())
        progress = trainer.progress.state_dict()
        callback_metrics, stages = dict(metrics.callback_metrics), dict(metrics._stages)

        def undo() -> None:
            for opt, state in optimizers:
                opt.load_state_dict(state)
            for sched, state in schedulers:
                sched.load_state_dict(state)
            trainer._precision.load_state_dict(precision)
            trainer.progress.load_state_dict(progress)
            metrics.callback_metrics, metrics._stages = callback_metrics, stages

        self._undo.append(undo)
        try:
            for opt, state in zip(optim.optimizers, ckpt["optimizer_states"]):
                opt.load_state_dict(state)
                if ckpt["progress"].get("global_step", 0) > 0:
                    # The optimizer has stepped in the saved run: keep torch's "scheduler stepped before the
                    # optimizer" warning quiet when a resumed epoch end steps a scheduler first.
                    opt._opt_called = True  # type: ignore[attr-defined]
            for cfg, state in zip(optim.schedulers, ckpt["lr_schedulers"]):
                cfg.scheduler.load_state_dict(state)
            trainer._precision.load_state_dict(ckpt.get("precision") or {})
            trainer.progress.load_state_dict(ckpt["progress"])
            metrics.callback_metrics.update(ckpt.get("callback_metrics") or {})
            if ckpt.get("epoch_metrics") and trainer.strategy.world_size == 1:
                metrics.load_state_dict(ckpt["epoch_metrics"], trainer.strategy.root_device)
        except BaseException:
            self._rollback()
            raise

    def data_position(self) -> None:
        trainer, ckpt = self.trainer, self.ckpt
        self._validate("data")
        data = trainer._data
        loader, offset, progress = data.train_loader, trainer._position_offset, trainer.progress.state_dict()
        sampler = resumable_sampler_of(loader)
        sampler_state = sampler.state_dict() if sampler is not None else None
        rng = capture_rng()

        def undo() -> None:
            data.train_loader, trainer._position_offset = loader, offset
            trainer.progress.load_state_dict(progress)
            if sampler is not None:
                sampler.load_state_dict(sampler_state)
            apply_rng(rng)

        self._undo.append(undo)
        try:
            _restore_data_position(trainer, ckpt, self.path)
            _restore_rng(trainer, ckpt)
        except BaseException:
            self._rollback()
            raise
        self._undo.clear()  # done: nothing to put back any more
        trainer.ckpt_path = self.path
        if trainer.is_global_zero:  # as Lightning, which names the file (ember adds where the run continues)
            p = trainer.progress
            log.info(
                "Restored all states from the checkpoint at %s (epoch %d, global step %d%s)",
                self.path,
                p.current_epoch,
                p.global_step,
                f", batch {p.batch_in_epoch} of the epoch" if p.batch_in_epoch else "",
            )


def restore_for_evaluation(trainer: Trainer, path: str) -> None:
    """validate / test / predict with ``ckpt_path``, as Lightning: the module's ``on_load_checkpoint`` and
    weights, the datamodule's state, the callbacks' ``on_load_checkpoint`` and state (all or nothing)."""
    Resume(trainer, path).modules_and_callbacks(fit=False)
    if trainer.is_global_zero:
        log.info("Loaded model weights from the checkpoint at %s", path)


def _restore_data_position(trainer: Trainer, ckpt: dict[str, Any], path: str) -> None:
    progress = trainer.progress
    saved = ckpt.get("sampler")
    saved_world = int(ckpt.get("strategy", {}).get("world_size", 1))
    world = trainer.strategy.world_size
    loader = trainer._data.train_loader
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
                trainer._position_offset = (
                    progress.current_epoch,
                    saved["position"] - progress.batch_in_epoch * batch_size * world,
                )
        return
    saved_loader = ckpt.get("loader")
    if saved_loader is not None and callable(getattr(loader, "load_state_dict", None)):
        if progress.batch_in_epoch and not progress.epoch_finished:
            loader.load_state_dict(saved_loader)  # continues each inner loader where it was (CombinedLoader)
        return
    if progress.batch_in_epoch and not progress.epoch_finished:
        warnings.warn(
            f"Resuming mid-epoch from {path!r} with a train loader ember cannot resume at the sampler level: "
            f"the first {progress.batch_in_epoch} batches of the epoch are loaded again and skipped, and the "
            "order matches the interrupted run only if the loader's order is deterministic. Use a plain "
            "DataLoader (map-style dataset, default sampler) for an exact resume.",
            UserWarning,
        )
        trainer._data.train_loader = SkipFirstBatches(loader, progress.batch_in_epoch)


_len_or_none = sized_len


def _restore_rng(trainer: Trainer, ckpt: dict[str, Any]) -> None:
    rng = ckpt.get("rng")
    if not rng:
        return
    rank, world = trainer.strategy.global_rank, trainer.strategy.world_size
    per_rank = rng["per_rank"]
    if world != rng.get("world_size", len(per_rank)) and trainer.strategy.is_global_zero:
        warnings.warn(
            f"The checkpoint was written by {len(per_rank)} process(es) and this run has {world}: per-rank "
            "random streams cannot carry over exactly; ranks that did not exist keep their current streams.",
            UserWarning,
        )
    if rank < len(per_rank):
        apply_rng(per_rank[rank])


def _snapshot(attributes: dict[str, Any], shared: dict[int, Any]) -> dict[str, Any]:
    """A copy of an object's attributes to put back: deep where it can be (the trainer, the module and
    the callbacks it refers to stay shared), shallow for a value that cannot be copied (a lock, a file)."""
    out = {}
    for name, value in attributes.items():
        try:
            out[name] = copy.deepcopy(value, dict(shared))
        except Exception:
            out[name] = value
    return out
