"""Resuming a fit from a checkpoint, in Lightning's order and all or nothing.

Three parts, each where Lightning does it:

1. ``modules_and_callbacks`` (before ``configure_optimizers``): the module's ``on_load_checkpoint``
   and weights, the datamodule's state, the callbacks' ``on_load_checkpoint`` and state.
2. ``training_state`` (after ``on_fit_start``, before the loaders are requested): optimizers,
   schedulers, precision, progress, metrics and the training epoch's running sums.
3. ``data_position`` (once the train loader exists): where the sampler continues, and the RNG states.

Each part first validates the entries it applies (``validation.py``), and a failure in any
part puts back everything the earlier parts changed, so a bad file leaves the run as it was. The
fit's own state is loaded through ``trainer.fit_state``'s parts (``ember/trainer/state.py``), each
with its ``load_state_dict``; the module, the datamodule and the callbacks through their hooks.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ember.checkpoint import validation
from ember.checkpoint.contents import overrides
from ember.checkpoint.io import CheckpointError, check_state_dict, load, match_compiled_keys
from ember.data.datamodule import saved_state
from ember.rng import apply_rng, capture_rng

if TYPE_CHECKING:
    from ember.callbacks.callback import Callback
    from ember.data import DataModule
    from ember.trainer.state import FitState
    from ember.trainer.trainer import Trainer

log = logging.getLogger(__name__)


class Resume:
    """One fit's resume from ``path``; the Trainer and the fit loop call its three parts in order.

    Args:
        trainer: the resuming Trainer, with its module (and datamodule) attached.
        state: the fit's state (``trainer.fit_state``), which the training and data parts load.
        path: the checkpoint file (``"last"`` / ``"best"`` already resolved).
    """

    def __init__(self, trainer: Trainer, state: FitState, path: str) -> None:
        self.trainer, self.state, self.path = trainer, state, path
        self.ckpt: dict[str, Any] = {}
        self._undo: list[Callable[[], None]] = []  # one per part applied, in order

    def _rollback(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _validate(self, part: str) -> None:
        try:
            validation.validate(self.trainer, self.ckpt, self.path, part)
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
        state, ckpt = self.state, self.ckpt
        self._validate("training")
        # At the start of a fit the optimizers hold no state yet, so these copies are small.
        before = state.snapshot_training()
        self._undo.append(lambda: state.restore_training(before))
        try:
            state.optim.load_state_dict(ckpt, stepped=ckpt["progress"].get("global_step", 0) > 0)
            state.precision.load_state_dict(ckpt.get("precision") or {})
            state.progress.load_state_dict(ckpt["progress"])
            state.metric_state.load_state_dict(ckpt)
        except BaseException:
            self._rollback()
            raise

    def data_position(self) -> None:
        trainer, state, ckpt = self.trainer, self.state, self.ckpt
        self._validate("data")
        position, progress, rng = state.position.snapshot(), state.progress.state_dict(), capture_rng()

        def undo() -> None:
            state.position.restore(position)
            state.progress.load_state_dict(progress)
            apply_rng(rng)

        self._undo.append(undo)
        try:
            saved_world = int(ckpt.get("strategy", {}).get("world_size", 1))
            state.position.load_state_dict(ckpt, saved_world_size=saved_world, source=self.path)
            _restore_rng(trainer, ckpt)
        except BaseException:
            self._rollback()
            raise
        self._undo.clear()  # done: nothing to put back any more
        trainer.ckpt_path = self.path
        if trainer.is_global_zero:  # as Lightning, which names the file (ember adds where the run continues)
            p = state.progress
            log.info(
                "Restored all states from the checkpoint at %s (epoch %d, global step %d%s)",
                self.path,
                p.current_epoch,
                p.global_step,
                f", batch {p.batch_in_epoch} of the epoch" if p.batch_in_epoch else "",
            )


def restore_for_evaluation(trainer: Trainer, state: FitState, path: str) -> None:
    """validate / test / predict with ``ckpt_path``, as Lightning: the module's ``on_load_checkpoint`` and
    weights, the datamodule's state, the callbacks' ``on_load_checkpoint`` and state (all or nothing)."""
    Resume(trainer, state, path).modules_and_callbacks(fit=False)
    if trainer.is_global_zero:
        log.info("Loaded model weights from the checkpoint at %s", path)


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
