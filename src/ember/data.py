"""DataModule: the data side of an experiment, in one object."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.types import Stage


class DataModule:
    """Group data preparation and loaders. Override what you need.

    ``prepare_data`` runs once per machine (local rank zero) before ``setup``; ``setup(stage)``
    runs on every process with stage "fit", "validate", "test" or "predict". ``state_dict`` is
    saved in checkpoints and given back to ``load_state_dict`` when a fit resumes.
    """

    def __init__(self) -> None:
        self.trainer: Any = None

    def prepare_data(self) -> None: ...
    def setup(self, stage: Stage) -> None: ...
    def teardown(self, stage: Stage) -> None: ...

    def train_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no train_dataloader(); define it to fit.")

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no test_dataloader(); define it to test.")

    def predict_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no predict_dataloader(); define it to predict.")

    # Batch-transfer hooks, as the module's: where a DataModule overrides one, it is used instead of the module's.
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        """Move every tensor in ``batch`` (nested lists, tuples and dicts) to ``device``."""
        return _move(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _move(batch: Any, device: Any) -> Any:
    # Own walker, and not ember.utils.move_to_device (what the Trainer does when no hook is
    # overridden), because its results differ and a DataModule that calls
    # super().transfer_batch_to_device gets them: any object with a ``.to`` is moved through it
    # (move_to_device and apply_to_collection(batch, Tensor, ...) move tensors only), dict
    # subclasses come back as plain dicts, and dataclasses are leaves.
    if hasattr(batch, "to") and callable(batch.to):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _move(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_move(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_move(v, device) for v in batch)
    return batch
