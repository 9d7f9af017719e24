"""What a fit carries, in one object: ``trainer.fit_state``.

As torchtnt's ``State`` and its unit's ``app_state()``: the Trainer builds one :class:`FitState` and
hands it to the loop, to the checkpoint writer (``ember.checkpoint.contents``) and to the restore
(``ember.checkpoint.restore``). Each part has ``state_dict`` / ``load_state_dict`` under the
checkpoint's own keys, so saving and resuming read and write a fit through these methods only,
never through the Trainer's attributes:

============  =====================================================  ================================
part          what                                                    checkpoint keys
============  =====================================================  ================================
progress      epoch, global step, batches consumed (``FitProgress``)  ``progress``
optim         optimizers and LR schedulers (``OptimizerState``)       ``optimizer_states``, ``lr_schedulers``
precision     the GradScaler (``Precision``)                          ``precision``
metrics       latest values, the training epoch's running sums        ``callback_metrics``, ``epoch_metrics``
position      where the training data continues (:class:`DataPosition`)  ``sampler``, ``loader``
============  =====================================================  ================================

The module's weights, the callbacks' and the datamodule's states and the RNG streams are not here:
they belong to their owners (the module, the callbacks, the process), and the checkpoint package
asks them directly.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import TYPE_CHECKING, Any

import torch

from ember.data.resumable import SkipFirstBatches, resumable_sampler_of
from ember.trainer.loaders import FitData
from ember.trainer.metrics import MetricCollector
from ember.trainer.optim import OptimizerState
from ember.trainer.progress import FitProgress
from ember.utils import sized_len

if TYPE_CHECKING:
    from ember.strategies.strategy import Strategy
    from ember.trainer.precision import Precision


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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        collector, strategy = self._state.metrics, self._state.strategy
        collector.callback_metrics.clear()  # the same dict: trainer.callback_metrics reads through it
        collector.callback_metrics.update(state.get("callback_metrics") or {})
        if strategy.world_size == 1:
            collector.load_state_dict(state.get("epoch_metrics") or [], strategy.root_device)


class DataPosition:
    """The ``position`` part: where the training data continues, for an exact mid-epoch resume.

    A sampler ember can resume (``ShardedSampler``, a default ``RandomSampler`` / ``SequentialSampler``)
    records ``{"seed", "epoch", "position"}``, the position counted in samples of the global order the
    loop consumed (not what workers prefetched); a train loader that keeps its own position (a
    ``CombinedLoader``) records its ``state_dict()``; any other loader is skipped forward batch by batch
    on resume, with a warning.
    """

    def __init__(self, state: FitState) -> None:
        self._state = state
        #: ``(epoch, samples)``: where a resume on another number of ranks left the global position of
        #: that epoch relative to ``batch_in_epoch * batch_size * world_size``.
        self.offset: tuple[int, int] | None = None

    def state_dict(self) -> dict[str, Any]:
        sampler = self._sampler_state()
        return {"sampler": sampler, "loader": self._loader_state() if sampler is None else None}

    def _sampler_state(self) -> dict[str, Any] | None:
        loader = self._state.data.train_loader
        sampler = resumable_sampler_of(loader)
        if sampler is None:
            return None
        progress = self._state.progress
        state = dict(sampler.state_dict())
        # Batches the loop consumed, not what the sampler handed out: workers prefetch ahead.
        batch_size = getattr(loader, "batch_size", None) or 1
        consumed = progress.batch_in_epoch * batch_size * self._state.strategy.world_size
        if self.offset is not None and self.offset[0] == progress.current_epoch:
            consumed += self.offset[1]  # this epoch was resumed from a checkpoint of another number of ranks
        total = _dataset_len(loader)
        state["position"] = min(consumed, total) if total is not None else consumed
        state["epoch"] = progress.current_epoch
        state["batch_size"] = batch_size
        return state

    def _loader_state(self) -> dict[str, Any] | None:
        """The state of a train loader that keeps its own position (a ``CombinedLoader``: each inner
        loader's), when it has a length: then the loop takes exactly the batches it yields (no
        look-ahead), so its count is the loop's."""
        loader = self._state.data.train_loader
        if not callable(getattr(loader, "state_dict", None)) or not callable(getattr(loader, "load_state_dict", None)):
            return None
        if sized_len(loader) is None:
            return None
        return loader.state_dict()

    def load_state_dict(self, state: dict[str, Any], saved_world_size: int = 1, source: str = "the checkpoint") -> None:
        """Continue the training data where ``state`` (``state_dict()``, with ``progress`` already loaded)
        left it. ``saved_world_size``: the number of ranks that wrote it; with another number, the epoch
        continues from the next sample of the global order no rank has seen. ``source`` names the
        checkpoint in a warning."""
        progress, data = self._state.progress, self._state.data
        world = self._state.strategy.world_size
        saved = state.get("sampler")
        loader = data.train_loader
        sampler = resumable_sampler_of(loader)
        mid_epoch = progress.batch_in_epoch and not progress.epoch_finished
        new_world = saved is not None and saved_world_size != world and mid_epoch
        if new_world and saved is not None:
            # Continue from the next unseen sample of the global order, counted in this run's batches.
            batch_size = getattr(loader, "batch_size", None) or saved.get("batch_size", 1)
            progress.batch_in_epoch = math.ceil(saved["position"] / (batch_size * world))
        if sampler is not None:
            if saved is not None:
                full = sized_len(loader)
                # An epoch whose end already ran continues with the next epoch, from its first sample.
                position = 0 if progress.epoch_finished else saved["position"]
                sampler.load_state_dict({"seed": saved["seed"], "epoch": saved["epoch"], "position": position})
                left = sized_len(loader)
                if new_world:
                    if full is not None and left is not None:
                        # What is left of the epoch is padded to a multiple of this run's ranks (see
                        # ShardedSampler._end): count as done what this run's epoch length leaves over,
                        # so the loop runs exactly the batches the sampler still yields on every rank.
                        progress.batch_in_epoch = max(0, full - left)
                    # How far that count is from the global position, so checkpoints written later in
                    # this epoch record where it really is.
                    self.offset = (
                        progress.current_epoch,
                        saved["position"] - progress.batch_in_epoch * batch_size * world,
                    )
            return
        saved_loader = state.get("loader")
        if saved_loader is not None and callable(getattr(loader, "load_state_dict", None)):
            if mid_epoch:
                loader.load_state_dict(saved_loader)  # continues each inner loader where it was (CombinedLoader)
            return
        if mid_epoch:
            warnings.warn(
                f"Resuming mid-epoch from {source!r} with a train loader ember cannot resume at the sampler level: "
                f"the first {progress.batch_in_epoch} batches of the epoch are loaded again and skipped, and the "
                "order matches the interrupted run only if the loader's order is deterministic. Use a plain "
                "DataLoader (map-style dataset, default sampler) for an exact resume.",
                UserWarning,
            )
            data.train_loader = SkipFirstBatches(loader, progress.batch_in_epoch)

    def snapshot(self) -> tuple[Any, ...]:
        """What :meth:`restore` puts back: the train loader, the offset and the sampler's own state (a
        failed resume leaves the data where it was)."""
        loader = self._state.data.train_loader
        sampler = resumable_sampler_of(loader)
        return loader, self.offset, sampler, (sampler.state_dict() if sampler is not None else None)

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        loader, self.offset, sampler, sampler_state = snapshot
        self._state.data.train_loader = loader
        if sampler is not None:
            sampler.load_state_dict(sampler_state)


class FitState:
    """What a fit carries; built once by the Trainer, its parts renewed as each run starts.

    Args:
        strategy: the Trainer's strategy (world size and device, for the metrics and the data position).
        precision: the Trainer's precision plugin (its GradScaler state is a part).
        data: the fit's loaders (``FitData``; the data position reads the train loader from it).
    """

    def __init__(self, strategy: Strategy, precision: Precision, data: FitData) -> None:
        self.strategy = strategy
        self.precision = precision
        self.data = data
        self.progress = FitProgress()
        self.optim = OptimizerState([], [])
        self.metrics = MetricCollector(strategy)
        self.metric_state = MetricState(self)
        self.position = DataPosition(self)

    def start_run(self) -> None:
        """Each fit / validate / test / predict starts from empty metrics, as in Lightning."""
        self.metrics = MetricCollector(self.strategy)

    def start_fit(self, data: FitData) -> None:
        """A new fit: its loaders, fresh progress, no position carried over from an earlier fit."""
        self.data = data
        self.progress = FitProgress()
        self.position = DataPosition(self)

    def state_dict(self, fitting: bool = True) -> dict[str, Any]:
        """Every part's state, under the checkpoint's keys. ``fitting``: the Trainer is in a fit (a save
        inside its validation counts that validation as done, so a resume does not repeat it)."""
        progress = self.progress.state_dict()
        if fitting and self.metrics.stage == "validate":  # inside a validation not yet counted
            progress["val_checks_in_epoch"] += 1
        return {
            **self.optim.state_dict(),
            "precision": self.precision.state_dict(),
            "progress": progress,
            **self.position.state_dict(),
            **self.metric_state.state_dict(),
        }

    def training_parts(self) -> dict[str, Any]:
        """The parts a resume loads before the loaders exist, by name (each with ``state_dict`` /
        ``load_state_dict``), in the order they are loaded."""
        return {
            "optim": self.optim,
            "precision": self.precision,
            "progress": self.progress,
            "metrics": self.metric_state,
        }

    def snapshot_training(self) -> dict[str, Any]:
        """Copies of :meth:`training_parts`' states, for :meth:`restore_training` to put back."""
        return {name: copy.deepcopy(part.state_dict()) for name, part in self.training_parts().items()}

    def restore_training(self, snapshot: dict[str, Any]) -> None:
        parts = self.training_parts()
        for name, state in snapshot.items():
            parts[name].load_state_dict(state)


def _dataset_len(loader: Any) -> int | None:
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return None
