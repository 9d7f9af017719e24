"""DataModule: the data side of an experiment, in one object."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ember.hparams import HyperparametersMixin, build_from_hparams

if TYPE_CHECKING:
    from ember.types import Stage

_D = TypeVar("_D", bound="DataModule")


class DataModule(HyperparametersMixin):
    """Group data preparation and loaders. Override what you need.

    ``prepare_data`` runs once per machine (local rank zero) before ``setup``; ``setup(stage)``
    runs on every process with stage "fit", "validate", "test" or "predict". ``state_dict`` is
    saved in checkpoints and given back to ``load_state_dict`` when a fit resumes. Its
    ``save_hyperparameters()`` / ``hparams`` work as the module's.
    """

    #: The datamodule's name (None unless a subclass sets it), as Lightning's ``LightningDataModule.name``.
    name: str | None = None

    def __init__(self) -> None:
        self.trainer: Any = None

    @classmethod
    def load_from_checkpoint(
        cls: type[_D],
        checkpoint_path: str,
        map_location: Any = "cpu",
        weights_only: bool | None = None,
        **overrides: Any,
    ) -> _D:
        """Rebuild this datamodule from the hyper-parameters a fit's checkpoint saved for it (its
        ``save_hyperparameters()``), and give it its saved ``state_dict``, as Lightning's.

        Args:
            checkpoint_path: a checkpoint written by a fit with this datamodule.
            map_location: where tensors are loaded (as in ``torch.load``).
            weights_only: accepted for Lightning's signature; ember's checkpoints are plain data and
                always load with ``torch.load(weights_only=True)``.
            **overrides: constructor arguments that replace the saved hyper-parameters.
        """
        import torch  # imported where used, as in _loaders_for

        ckpt = torch.load(checkpoint_path, map_location=map_location, weights_only=True)
        datamodule = build_from_hparams(
            cls, ckpt.get("datamodule_hyper_parameters"), ckpt.get("datamodule_hparams_name"), overrides
        )
        state = saved_state(ckpt, datamodule)
        if state:
            datamodule.load_state_dict(state)
        return datamodule

    @classmethod
    def from_datasets(
        cls: type[_D],
        train_dataset: Any = None,
        val_dataset: Any = None,
        test_dataset: Any = None,
        predict_dataset: Any = None,
        batch_size: int = 1,
        num_workers: int = 0,
        **datamodule_kwargs: Any,
    ) -> _D:
        """A datamodule whose loaders are ``DataLoader``s over the given datasets (each may also be a list or
        dict of datasets, for several loaders); the training ones shuffle.

        Args:
            batch_size, num_workers: the loaders' settings; also passed to ``__init__`` when it takes them.
            **datamodule_kwargs: passed to ``__init__``.
        """
        params = inspect.signature(cls.__init__).parameters
        special = {"batch_size": batch_size, "num_workers": num_workers}
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            special = {k: v for k, v in special.items() if k in params}
        datamodule = cls(**datamodule_kwargs, **special)
        for stage, dataset in (
            ("train", train_dataset),
            ("val", val_dataset),
            ("test", test_dataset),
            ("predict", predict_dataset),
        ):
            if dataset is not None:
                loaders = _loaders_for(dataset, batch_size, num_workers, shuffle=stage == "train")
                setattr(datamodule, f"{stage}_dataloader", lambda loaders=loaders: loaders)
        return datamodule

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

    def on_exception(self, exception: BaseException) -> None:
        """Called when a Trainer run (fit, validate, test, predict) is interrupted by ``exception``."""


def _loaders_for(dataset: Any, batch_size: int, num_workers: int, shuffle: bool) -> Any:
    """A DataLoader for a dataset, and lists / dicts of them for lists / dicts of datasets."""
    import torch
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    if isinstance(dataset, Dataset):
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle and not isinstance(dataset, IterableDataset),
            num_workers=num_workers,
            pin_memory=torch.cuda.is_available(),
        )
    if isinstance(dataset, Mapping):
        return {k: _loaders_for(v, batch_size, num_workers, shuffle) for k, v in dataset.items()}
    if isinstance(dataset, (list, tuple)):
        return type(dataset)(_loaders_for(v, batch_size, num_workers, shuffle) for v in dataset)
    raise TypeError(
        f"DataModule.from_datasets got a {type(dataset).__name__}; pass a torch Dataset, or a list or dict of them."
    )


def _move(batch: Any, device: Any) -> Any:
    # Own walker, and not ember.batches.move_to_device (what the Trainer does when no hook is
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


def saved_state(ckpt: Mapping[str, Any], datamodule: DataModule) -> Any:
    """The state a checkpoint holds for ``datamodule``: under its class's ``__qualname__``, as Lightning saves
    it (``"datamodule"`` in files of earlier ember versions); None without one."""
    return ckpt.get(type(datamodule).__qualname__, ckpt.get("datamodule"))
