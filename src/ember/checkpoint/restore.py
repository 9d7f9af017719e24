"""Restoring the fit's state from a checkpoint: all or nothing, every part alike.

:class:`Restore` opens the file once (``reading.load``) and checks the form of every entry the resume
reads (``validation.check_entries``). Then :meth:`Restore.load` is the one way a part is restored, for
whichever parts are due at a moment:

1. check each part against this run (its ``check``, ``ember/state.py``): nothing has changed yet;
2. snapshot each part (what a failure puts back);
3. load each part from the checkpoint (``load_state_dict``), in registration order;
4. on any failure, put back every part loaded so far, at this moment and the earlier ones, in reverse
   order, and raise.

The moments are Lightning's (``ember.state.MOMENTS``), and a fit reaches them in two places: the Trainer
loads the ``"modules"`` parts (the weights, the datamodule's and the callbacks' states) before
``configure_optimizers``, the fit loop the ``"training"`` parts (optimizers, schedulers, precision,
progress, metrics) after ``on_fit_start`` and the ``"data"`` parts (where the training data continues, the
RNG states) once the train loader exists; validate, test and predict load the ``"modules"`` parts only.
Each moment loads what has been built by then, in the order a Lightning user's hooks see it. There is no
one point of a fit where every part could be loaded: the weights go in before ``configure_optimizers``
(which may read them), the optimizers exist only after it, and the train loader only after the sanity check,
which runs with the restored weights and optimizers.

The parts are whatever the fit registered (``trainer.fit_state``); nothing here reads the Trainer.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ember.checkpoint import validation
from ember.checkpoint.format import CheckpointError
from ember.checkpoint.reading import load
from ember.state import MOMENTS, put_back, take_snapshot
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.state import State, Stateful
    from ember.strategies.strategy import Strategy


class Restore:
    """One resume from one checkpoint file, into the parts of ``state``.

    Args:
        state: the fit's parts (``trainer.fit_state``).
        path: the checkpoint file (``"last"`` / ``"best"`` already resolved).
        purpose: ``"fit"`` (every moment, from a full checkpoint) or ``"evaluate"`` (validate / test /
            predict: the ``"modules"`` parts, from any checkpoint).
        on_complete: called once the last moment's parts are loaded (the Trainer records the path).
        strategy: the run's strategy: a sharded checkpoint is read as it holds tensors (its ``read_sharded``).
        weights_only: read plain data only (``torch.load(weights_only=True)``); False lets a trusted file
            unpickle objects (``Trainer.fit(weights_only=False)``, as Lightning's).
    """

    def __init__(
        self,
        state: State,
        path: str,
        purpose: str = "fit",
        on_complete: Callable[[], None] | None = None,
        strategy: Strategy | None = None,
        weights_only: bool = True,
    ) -> None:
        self.state, self.path, self.on_complete = state, path, on_complete
        self.moments = MOMENTS if purpose == "fit" else MOMENTS[:1]
        read_sharded = strategy.read_sharded if strategy is not None else None
        self.checkpoint = ckpt = load(path, purpose=purpose, read_sharded=read_sharded, weights_only=weights_only)
        if purpose == "fit" and (ckpt.get("weights_only") or "progress" not in ckpt):
            module = str(ckpt.get("module_class") or "YourModule").rsplit(".", 1)[-1]
            raise CheckpointError(
                f"{path!r} holds weights only (save_weights_only=True), not the optimizer and "
                "progress state a fit resumes from. Start a new fit from it with "
                f"{module}.load_from_checkpoint(path), or resume from a full checkpoint."
            )
        entries = validation.FIT_ENTRIES if purpose == "fit" else validation.EVALUATION_ENTRIES
        try:
            validation.check_entries(ckpt, entries)
        except validation.Invalid as invalid:
            raise invalid.error(path) from None
        self._loaded: list[tuple[Stateful, Any]] = []  # (part, its snapshot), in the order loaded

    def load(self, moment: str) -> None:
        """Check, snapshot and load the parts due at ``moment``; on a failure, put back every part
        loaded so far (earlier moments' too) and raise."""
        parts = [part for _, part in self.state.parts(moment)]
        try:
            for part in parts:
                check = getattr(part, "check", None)
                if check is not None:
                    check(self.checkpoint, self.path)
            snapshots = [(part, take_snapshot(part)) for part in parts]
            for part, snapshot in snapshots:
                self._loaded.append((part, snapshot))
                part.load_state_dict(self.checkpoint)
        except validation.Invalid as invalid:
            self._rollback()
            raise invalid.error(self.path) from None
        except BaseException:
            self._rollback()
            raise
        if moment == self.moments[-1]:
            self._loaded.clear()  # complete: nothing to put back any more
            if self.on_complete is not None:
                self.on_complete()

    def _rollback(self) -> None:
        # Every part is put back even if one cannot be; the error the user sees stays the one that stopped
        # the resume, and a part left changed is named.
        while self._loaded:
            part, snapshot = self._loaded.pop()
            try:
                put_back(part, snapshot)
            except Exception as err:
                warnings.warn(
                    f"A failed resume from {self.path!r} could not put back a part of the fit's state "
                    f"({type(part).__name__}: {type(err).__name__}: {err}); it may hold the checkpoint's values.",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
