"""What a fit carries, in one object: ``trainer.fit_state``, the registry of the fit's named parts.

As torchtnt's ``State`` and its unit's ``app_state()``: the Trainer builds one :class:`FitState`, which
registers every part of the fit's state (``ember/state.py`` says what a part is) and is handed to the loop,
to the checkpoint writer (``ember.checkpoint.contents.save(state, strategy, ...)``) and to the restore
(``ember.checkpoint.restore.Restore``). Saving and resuming read and write a fit through the parts only,
never through the Trainer's attributes:

==========  ===========================================  ==================================  ==========
part        what (class)                                  checkpoint entries                  resumed at
==========  ===========================================  ==================================  ==========
module      the weights (:class:`ModuleWeights`)         ``state_dict``; ``module_class``,   modules
                                                         ``hyper_parameters``, ...
datamodule  its state (:class:`DataModuleState`)         its class's ``__qualname__``         modules
callbacks   their states and checkpoint hooks             ``callbacks``                       modules
            (:class:`CallbackStates`)
optimizers  optimizers and LR schedulers                  ``optimizer_states``,               training
            (``OptimizerState``, ``optim.py``)            ``lr_schedulers``
precision   the GradScaler (:class:`PrecisionState`)     ``precision``                       training
progress    epoch, step, batches (:class:`ProgressState`)  ``progress``; ``epoch``, ...       training
metrics     latest values, the epoch's running sums       ``callback_metrics``,               training
            (:class:`MetricState`)                        ``epoch_metrics``
position    where the training data continues             ``sampler``, ``loader``             data
            (``DataPosition``, ``position.py``)
rng         every rank's generators (:class:`RngState`)  ``rng``                             data
==========  ===========================================  ==================================  ==========

They are registered in that order, the order a resume loads them in at each of Lightning's moments
(``ember.state.MOMENTS``). The parts defined here wrap an object of the user's or of the process, and read
the Trainer's current one when called (the module of this run, its callbacks), so they are registered once;
the optimizers' part is renewed with each fit's ``configure_optimizers``, the position's with each fit. The
module, the datamodule and the callbacks restore through their own hooks, exactly as Lightning calls them
(``on_load_checkpoint``, ``load_state_dict``); what a failed resume puts back of them is a copy of their
attributes, taken without calling any of their hooks.

The trainer package uses the objects behind the parts directly, under the names it always has:
``progress``, ``optim``, ``metrics`` (the ``self.log`` collector), ``data`` (the fit's loaders),
``precision`` and ``position``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.callback import overrides
from ember.checkpoint.contents import ENTRIES
from ember.checkpoint.format import CheckpointError, check_plain_data
from ember.checkpoint.weights import check_state_dict, match_compiled_keys
from ember.data.datamodule import saved_state
from ember.rng import apply_rng, capture_rng, gather_rng
from ember.state import State
from ember.trainer.metrics import MetricCollector
from ember.trainer.optim import OptimizerState
from ember.trainer.position import DataPosition
from ember.trainer.progress import FitProgress
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.data import DataModule
    from ember.module import TrainModule
    from ember.strategies.strategy import Strategy
    from ember.trainer.loaders import FitData
    from ember.trainer.precision import Precision
    from ember.trainer.trainer import Trainer


class FitState(State):
    """What a fit carries; built once by the Trainer, its parts renewed as each run starts.

    Args:
        trainer: the Trainer, whose module, datamodule and callbacks of the current run the parts read.
        strategy: the Trainer's strategy (world size and device, for the metrics and the data position).
        precision: the Trainer's precision plugin (its GradScaler state is a part).
        data: the fit's loaders (``FitData``; the data position reads the train loader from it).
    """

    def __init__(self, trainer: Trainer, strategy: Strategy, precision: Precision, data: FitData) -> None:
        super().__init__()
        self.strategy = strategy
        self.precision = precision
        self.data = data
        self.progress = FitProgress()
        self.metrics = MetricCollector(strategy)
        self.position = DataPosition(self)
        self.register("module", ModuleWeights(trainer), "modules", weights=True)
        self.register("datamodule", DataModuleState(trainer), "modules")
        self.register("callbacks", CallbackStates(trainer), "modules")
        self.optim = OptimizerState([], [])
        self.register("precision", PrecisionState(precision), "training")
        self.register("progress", ProgressState(self, trainer), "training")
        self.register("metrics", MetricState(self), "training")
        self.register("position", self.position, "data")
        self.register("rng", RngState(strategy), "data")

    @property
    def optim(self) -> OptimizerState:
        """The optimizers and LR schedulers of the fit (``configure_optimizers``'), the ``optimizers`` part."""
        return self._optim

    @optim.setter
    def optim(self, optim: OptimizerState) -> None:
        self._optim = optim
        self.register("optimizers", optim, "training")

    def start_run(self) -> None:
        """Each fit / validate / test / predict starts from empty metrics, as in Lightning."""
        self.metrics = MetricCollector(self.strategy)

    def start_fit(self, data: FitData) -> None:
        """A new fit: its loaders, fresh progress, no position carried over from an earlier fit."""
        self.data = data
        self.progress = FitProgress()
        self.position = DataPosition(self)
        self.register("position", self.position, "data")


# ------------------------------------------------------------------------------------------ the parts
class ModuleWeights:
    """The ``module`` part: the weights under ``state_dict`` (every checkpoint, weights-only ones too), and
    the module's class and hyper-parameters beside them for ``load_from_checkpoint``."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    @property
    def module(self) -> TrainModule:
        module = self._trainer.module
        assert module is not None  # parts are saved and loaded during a run, with the module attached
        return module

    def summary(self) -> dict[str, Any]:
        module = self.module
        return {
            "module_class": f"{type(module).__module__}.{type(module).__qualname__}",
            "hyper_parameters": plain_hparams(module),
            # As Lightning: the argument a single config object (dict, Namespace) was saved from, so that
            # load_from_checkpoint passes it back as that argument.
            "hparams_name": getattr(module, "_hparams_name", None),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"state_dict": self._trainer.strategy.model_state_dict()}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.module.on_save_checkpoint(checkpoint)

    def check(self, checkpoint: dict[str, Any], source: str) -> None:
        module = self.module
        # A module with strict_loading=False (it saves part of its weights) loads the keys the file holds; a
        # shape mismatch still raises in load_state_dict, and the snapshot puts the weights back. A fit
        # continues training in the saved dtype; evaluation may cast (a float64 file into float32).
        if module.strict_loading:
            weights = match_compiled_keys(module, checkpoint["state_dict"])
            check_state_dict(module, weights, source, exact_dtype=self._trainer.state == "fitting")

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        module = self.module
        # Saved with or without torch.compile: the keys as this module names them, before its hook sees them.
        checkpoint["state_dict"] = match_compiled_keys(module, checkpoint["state_dict"])
        module.on_load_checkpoint(checkpoint)  # first, as Lightning: it may rewrite the weights
        module.load_state_dict(checkpoint["state_dict"], strict=module.strict_loading)  # by keyword, as Lightning

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def rollback(self, weights: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(weights)


class _CopiesAsLoaded:
    """What a failed resume puts back of the objects whose hooks a load calls (the datamodule, the
    callbacks): a copy of each one's attributes, taken as the load reaches it, before its first hook.
    Copies of attributes, since a resume calls no ``state_dict`` (as Lightning), and of those objects only,
    since a datamodule's attributes may hold whole datasets."""

    _trainer: Trainer
    _copies: list[tuple[Any, dict[str, Any]]] | None = None

    def snapshot(self) -> list[tuple[Any, dict[str, Any]]]:
        self._copies = []  # filled by load_state_dict, which the restore calls next
        return self._copies

    def rollback(self, copies: list[tuple[Any, dict[str, Any]]]) -> None:
        for owner, saved in reversed(copies):
            vars(owner).clear()
            vars(owner).update(saved)

    def _copier(self) -> Callable[[Any], None]:
        """A function that copies an object's attributes into this load's snapshot, once (none without one)."""
        copies, self._copies = self._copies, None  # the restore keeps the list: this part need not
        shared = shared_objects(self._trainer)

        def copy_once(owner: Any) -> None:
            if copies is not None and hasattr(owner, "__dict__") and all(owner is not o for o, _ in copies):
                copies.append((owner, attributes(owner, shared)))

        return copy_once


class DataModuleState(_CopiesAsLoaded):
    """The ``datamodule`` part: its ``state_dict()`` when not empty, under its class's ``__qualname__``
    (Lightning's key), and its hyper-parameters beside the module's."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def summary(self) -> dict[str, Any]:
        dm = self._trainer.datamodule
        if dm is None or not dm.__dict__.get("_hparams"):
            return {}
        return {
            "datamodule_hyper_parameters": plain_hparams(dm),
            "datamodule_hparams_name": getattr(dm, "_hparams_name", None),
        }

    def state_dict(self) -> dict[str, Any]:
        dm = self._trainer.datamodule
        state = dm.state_dict() if dm is not None else None
        if not state:
            return {}
        key = type(dm).__qualname__
        if key in ENTRIES:
            raise ValueError(
                f"{key}.state_dict() would be saved under the checkpoint key {key!r} (a datamodule's state is saved "
                "under its class name, as in Lightning), which the checkpoint already uses for its own entry. "
                "Rename the datamodule class."
            )
        return {key: state}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        copy_once = self._copier()
        dm = self._trainer.datamodule
        state = None if dm is None else saved_state(checkpoint, dm)
        if dm is not None and state:
            copy_once(dm)
            dm.load_state_dict(state)


class CallbackStates(_CopiesAsLoaded):
    """The ``callbacks`` part: ``{callback.state_key: callback.state_dict()}`` under ``callbacks``, and the
    callbacks' ``on_save_checkpoint`` / ``on_load_checkpoint`` hooks."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def _module(self) -> TrainModule:
        module = self._trainer.module
        assert module is not None  # parts are saved and loaded during a run, with the module attached
        return module

    def state_dict(self) -> dict[str, Any]:
        return {"callbacks": {cb.state_key: cb.state_dict() for cb in self._trainer.callbacks}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        t, module = self._trainer, self._module()
        for cb in t.callbacks:
            if overrides(cb, "on_save_checkpoint"):
                cb.on_save_checkpoint(t, module, checkpoint)

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        copy_once, t, module = self._copier(), self._trainer, self._module()
        for cb in t.callbacks:
            if overrides(cb, "on_load_checkpoint"):
                copy_once(cb)
                cb.on_load_checkpoint(t, module, checkpoint)
        saved = checkpoint.get("callbacks") or {}
        for cb in t.callbacks:
            if saved.get(cb.state_key):
                copy_once(cb)
                cb.load_state_dict(saved[cb.state_key])


class PrecisionState:
    """The ``precision`` part: the GradScaler's state (empty unless 16-mixed)."""

    def __init__(self, precision: Precision) -> None:
        self._precision = precision

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self._precision.state_dict()}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        self._precision.load_state_dict(checkpoint.get("precision") or {})


class ProgressState:
    """The ``progress`` part: epoch, global step, batches consumed (``FitProgress``), and the epoch and
    step every checkpoint names."""

    def __init__(self, state: FitState, trainer: Trainer) -> None:
        self._state, self._trainer = state, trainer

    def summary(self) -> dict[str, Any]:
        p = self._state.progress
        return {"epoch": p.current_epoch, "global_step": p.global_step}

    def state_dict(self) -> dict[str, Any]:
        progress = self._state.progress.state_dict()
        # A save inside a fit's validation counts that validation as done, so a resume does not repeat it.
        if self._trainer.state == "fitting" and self._state.metrics.stage == "validate":
            progress["val_checks_in_epoch"] += 1
        return {"progress": progress}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        self._state.progress.load_state_dict(checkpoint["progress"])

    def snapshot(self) -> dict[str, Any]:
        return self._state.progress.state_dict()

    def rollback(self, progress: dict[str, Any]) -> None:
        self._state.progress.load_state_dict(progress)


class MetricState:
    """The ``metrics`` part: the latest logged values (what monitors compare against) and, mid-epoch in a
    single process, the running sums behind the training epoch's ``on_epoch`` values."""

    def __init__(self, state: FitState) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        collector, progress = self._state.metrics, self._state.progress
        # Left where they are, as the weights are: the writer copies them with everything else (a background
        # save through pinned memory, without waiting for the GPU; a copy to the CPU here would wait for it).
        latest = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in collector.callback_metrics.items()}
        # Other ranks' sums are not gathered: single-process only, and only mid-epoch.
        mid_epoch = progress.batch_in_epoch and not progress.epoch_finished
        sums = collector.state_dict() if self._state.strategy.world_size == 1 and mid_epoch else []
        return {"callback_metrics": latest, "epoch_metrics": sums}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        collector, strategy = self._state.metrics, self._state.strategy
        collector.callback_metrics.clear()  # the same dict: trainer.callback_metrics reads through it
        collector.callback_metrics.update(checkpoint.get("callback_metrics") or {})
        if strategy.world_size == 1:
            collector.load_state_dict(checkpoint.get("epoch_metrics") or [], strategy.root_device)


class RngState:
    """The ``rng`` part: every rank's torch / CUDA / Python / NumPy generator states (gathered on save, so
    a save is a collective); a resume gives each rank its own."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        return {"rng": gather_rng(self._strategy)}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        rng = checkpoint.get("rng")
        if not rng:
            return
        rank, world = self._strategy.global_rank, self._strategy.world_size
        per_rank = rng["per_rank"]
        if world != rng.get("world_size", len(per_rank)) and self._strategy.is_global_zero:
            warnings.warn(
                f"The checkpoint was written by {len(per_rank)} process(es) and this run has {world}: per-rank "
                "random streams cannot carry over exactly; ranks that did not exist keep their current streams.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        if rank < len(per_rank):
            apply_rng(per_rank[rank])

    def snapshot(self) -> dict[str, Any]:
        return capture_rng()

    def rollback(self, state: dict[str, Any]) -> None:
        apply_rng(state)


# ---------------------------------------------------------------------------------------------- helpers
def plain_hparams(owner: TrainModule | DataModule) -> dict[str, Any]:
    """``owner.hparams`` without the entries a checkpoint cannot hold (said once per save, with what to do)."""
    out: dict[str, Any] = {}
    for k, v in dict(owner.hparams).items():
        try:
            check_plain_data(v)
        except CheckpointError:
            warnings.warn(
                f"Hyper-parameter {k!r} ({type(v).__name__}) is not plain data and is left out of the "
                "checkpoint (ember's checkpoints load with torch.load(weights_only=True)); load_from_checkpoint "
                f"then uses the constructor's default unless given {k}=... . Pass ignore=[{k!r}] to "
                "save_hyperparameters to silence this.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
            continue
        out[k] = v
    return out


def shared_objects(trainer: Trainer) -> dict[int, Any]:
    """What a copy of a callback's or datamodule's attributes refers to rather than copies: the Trainer,
    the module, the datamodule and the callbacks (a deep copy's memo)."""
    objs = (trainer, trainer.module, trainer.datamodule, *trainer.callbacks)
    return {id(o): o for o in objs if o is not None}


def attributes(owner: Any, shared: dict[int, Any]) -> dict[str, Any]:
    """A copy of ``owner``'s attributes to put back: deep where it can be (``shared`` objects stay shared),
    shallow for a value that cannot be copied (a lock, a file)."""
    out = {}
    for name, value in vars(owner).items():
        try:
            out[name] = copy.deepcopy(value, dict(shared))
        except Exception:
            out[name] = value
    return out
