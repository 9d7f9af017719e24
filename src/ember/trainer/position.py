"""Where the training data continues: the ``position`` part of a fit's state (``state.py``), for an exact
mid-epoch resume, on the same number of ranks or another."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

from ember.batches import sized_len
from ember.checkpoint import validation
from ember.data.resumable import SkipFirstBatches, resumable_sampler_of
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.trainer.state import FitState


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
        self._source = "the checkpoint"

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

    def check(self, checkpoint: dict[str, Any], source: str) -> None:
        """The checkpoint's place in the epoch and its sampler position against this run's training data."""
        progress, data = checkpoint["progress"], self._state.data
        strategy = checkpoint.get("strategy")
        saved_world = strategy.get("world_size", 1) if isinstance(strategy, dict) else 1
        same_world = saved_world == self._state.strategy.world_size
        validation.check("progress", validation.position, progress, data.num_training_batches, same_world)
        # The loader trainer.train_dataloader shows: in one process the one given (ember's own shares its dataset).
        shown = data.train_given if self._state.strategy.world_size == 1 else data.train_loader
        validation.check("sampler", validation.sampler, checkpoint.get("sampler"), _dataset_len(shown))
        self._source = source  # named in load_state_dict's warning

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Continue the training data where ``checkpoint`` (``state_dict()``'s entries and ``strategy``, with
        ``progress`` already loaded) left it. Written by another number of ranks, the epoch continues from
        the next sample of the global order no rank has seen."""
        progress, data = self._state.progress, self._state.data
        world = self._state.strategy.world_size
        saved_world_size = int(checkpoint.get("strategy", {}).get("world_size", 1))
        saved = checkpoint.get("sampler")
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
                sampler.load_state_dict({**saved, "position": position})
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
        saved_loader = checkpoint.get("loader")
        if saved_loader is not None and callable(getattr(loader, "load_state_dict", None)):
            if mid_epoch:
                loader.load_state_dict(saved_loader)  # continues each inner loader where it was (CombinedLoader)
            return
        if mid_epoch:
            warnings.warn(
                f"Resuming mid-epoch from {self._source!r} with a train loader ember cannot resume at the sampler "
                f"level: the first {progress.batch_in_epoch} batches of the epoch are loaded again and skipped, and "
                "the order matches the interrupted run only if the loader's order is deterministic. Use a plain "
                "DataLoader (map-style dataset, default sampler) for an exact resume.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
            data.train_loader = SkipFirstBatches(loader, progress.batch_in_epoch)

    def snapshot(self) -> tuple[Any, ...]:
        """What :meth:`rollback` puts back: the train loader, the offset, the sampler's own state and the
        progress, whose place in the epoch a resume on another number of ranks recounts."""
        loader = self._state.data.train_loader
        sampler = resumable_sampler_of(loader)
        sampler_state = sampler.state_dict() if sampler is not None else None
        return loader, self.offset, sampler, sampler_state, self._state.progress.state_dict()

    def rollback(self, snapshot: tuple[Any, ...]) -> None:
        loader, self.offset, sampler, sampler_state, progress = snapshot
        self._state.data.train_loader = loader
        if sampler is not None:
            sampler.load_state_dict(sampler_state)
        self._state.progress.load_state_dict(progress)


def _dataset_len(loader: Any) -> int | None:
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return None
