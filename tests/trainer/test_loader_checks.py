"""A dataset, a tensor or a list of samples where a loader belongs is refused, saying to wrap it in a DataLoader;
a loader that yields fewer batches than its len() is reported once, with both counts."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler

import ember
from tests.helpers.models import BoringModel, UnsizedBatches, fast_trainer, regression_data, regression_loader

WRAP = r"Wrap it in a torch.utils.data.DataLoader: DataLoader\(dataset, batch_size=32"


class Predicting(BoringModel):
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self(batch[0])


class FromHook(BoringModel):
    def train_dataloader(self) -> Any:
        return regression_data()


class DataFromHook(ember.DataModule):
    def train_dataloader(self) -> Any:
        return regression_loader()

    def val_dataloader(self) -> Any:
        return [regression_loader(), regression_data()]


def fit(module: Any = None, *args: Any, **kwargs: Any) -> ember.Trainer:
    trainer = fast_trainer()
    trainer.fit(module or BoringModel(), *args, **kwargs)
    return trainer


@pytest.mark.parametrize(
    "run, match",
    [
        (lambda: fit(None, regression_data()), r"fit's train_dataloaders is a TensorDataset, a Dataset, not a loader"),
        (lambda: fit(None, regression_loader(), regression_data()), r"fit's val_dataloaders is a TensorDataset"),
        (
            lambda: fit(None, regression_loader(), [regression_loader(), regression_data()]),
            r"fit's val_dataloaders\[1\] is a TensorDataset",
        ),
        (lambda: fit(None, {"a": regression_loader(), "b": regression_data()}), r"fit's train_dataloaders\['b'\]"),
        (lambda: fit(FromHook()), r"what FromHook.train_dataloader\(\) returned is a TensorDataset"),
        (lambda: fit(None, datamodule=DataFromHook()), r"what DataFromHook.val_dataloader\(\) returned\[1\] is a"),
        (lambda: fast_trainer().validate(BoringModel(), regression_data()), r"validate's dataloaders is a TensorData"),
        (lambda: fast_trainer().test(BoringModel(), regression_data()), r"test's dataloaders is a TensorDataset"),
        (lambda: fast_trainer().predict(Predicting(), regression_data()), r"predict's dataloaders is a TensorDataset"),
    ],
)
def test_a_dataset_where_a_loader_belongs_is_refused(run, match):
    # Lightning 2.6.6 iterates the dataset: every step gets one sample without a batch dimension.
    with pytest.raises(TypeError, match=f"{match}.*{WRAP}"):
        run()


def test_a_tensor_or_a_list_of_samples_is_refused():
    with pytest.raises(TypeError, match=r"fit's train_dataloaders is a tensor of shape \(8, 4\), not a loader.*"):
        fit(None, torch.randn(8, 4))
    samples = [(torch.randn(4), torch.tensor(1.0)) for _ in range(8)]
    with pytest.raises(TypeError, match=r"fit's train_dataloaders is a list of samples .*DataLoader\(samples"):
        fit(None, samples)
    with pytest.raises(TypeError, match=r"validate's dataloaders is a list of samples \(its first item, 1.5, "):
        fast_trainer().validate(BoringModel(), [1.5, 2.5])


def test_loaders_lists_of_batches_and_streams_still_run():
    data = regression_data()
    batches = [(data.tensors[0][i : i + 8], data.tensors[1][i : i + 8]) for i in range(0, 32, 8)]
    assert fit(None, batches).global_step == 4  # a list of ready-made batches
    assert fit(None, UnsizedBatches()).global_step == 4  # an IterableDataset yielding batches
    assert fit(None, DataLoader(batches, batch_size=None)).global_step == 4  # a dataset of batches, wrapped
    trainer = fit(None, regression_loader(), [regression_loader(), regression_loader(n=16)])
    assert trainer.num_val_batches == [4, 2]


class StopsAt(Dataset):
    """A dataset of ``n`` samples whose ``__getitem__`` raises StopIteration from index ``stop`` on."""

    def __init__(self, n: int = 32, stop: int = 20) -> None:
        self.data, self.stop = regression_data(n), stop

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        if i >= self.stop:
            raise StopIteration
        return self.data[i]


class ShortBatchSampler(BatchSampler):
    """A batch sampler that yields one batch fewer than its ``len()``."""

    def __iter__(self) -> Any:
        return iter(list(super().__iter__())[:-1])


def short_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "but its len() is" in str(w.message)]


def test_a_loader_that_yields_fewer_batches_than_its_len_is_reported_once():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = fast_trainer(max_epochs=3)
        trainer.fit(BoringModel(), DataLoader(StopsAt(), batch_size=8))
    assert trainer.global_step == 6  # 2 of 4 batches per epoch
    assert short_warnings(record) == [
        "The train dataloader yielded 2 batches, but its len() is 4: the epoch ended early. What follows an epoch's "
        "last batch (its validation, epoch-interval LR schedulers) did not run. Check its dataset (a "
        "__getitem__ that raises StopIteration ends the iteration) and its sampler or batch sampler (one that yields "
        "fewer indices than its __len__ says).",
    ]
    short = DataLoader(regression_data(), batch_sampler=ShortBatchSampler(SequentialSampler(range(32)), 8, False))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            fast_trainer().validate(BoringModel(), [regression_loader(), short], verbose=False)
        fast_trainer().test(BoringModel(), DataLoader(StopsAt(), batch_size=8), verbose=False)
        fast_trainer(limit_train_batches=2).fit(BoringModel(), DataLoader(StopsAt(), batch_size=8))  # as limited
    assert [m.split(":")[0] for m in short_warnings(record)] == [
        "The val dataloader 1 yielded 3 batches, but its len() is 4",
        "The test dataloader 0 yielded 2 batches, but its len() is 4",
    ]
