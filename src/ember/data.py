"""DataModule: the data side of an experiment, in one object."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.types import Stage


class DataModule:
    """Group data preparation and loaders. Override what you need.

    ``prepare_data`` runs once per machine (local rank zero) before ``setup``; ``setup(stage)``
    runs on every process with stage "fit", "validate", "test" or "predict".
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

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
