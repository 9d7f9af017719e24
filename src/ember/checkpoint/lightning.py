"""PyTorch Lightning's ``.ckpt`` files, read as they are: ``ember.load_lightning_checkpoint``. A module
is built from one by ``TrainModule.load_from_checkpoint`` (``weights.py``), which takes both formats."""

from __future__ import annotations

from typing import Any

from ember.checkpoint.format import CheckpointError, is_lightning_checkpoint
from ember.checkpoint.reading import load


def load_lightning_checkpoint(path: str, map_location: Any = "cpu", weights_only: bool = True) -> dict[str, Any]:
    """Read a PyTorch Lightning ``.ckpt`` file as it is, checked: a dict with its ``state_dict`` (the module's
    weights), ``hyper_parameters`` (from ``save_hyperparameters``), ``epoch``, ``global_step`` and the rest.

    To build a module from it, use ``YourModule.load_from_checkpoint(path)``, which accepts Lightning files.

    Args:
        path: the ``.ckpt`` file.
        map_location: where tensors are loaded (as in ``torch.load``).
        weights_only: refuse pickled Python objects (the default); ``False`` only for files you trust.
    """
    ckpt = load(path, map_location=map_location, lightning=True, weights_only=weights_only)
    if not is_lightning_checkpoint(ckpt):
        raise CheckpointError(
            f"{path!r} is an ember checkpoint, not a Lightning one: use "
            "YourModule.load_from_checkpoint(path) or Trainer(...).fit(..., ckpt_path=path)."
        )
    return ckpt
