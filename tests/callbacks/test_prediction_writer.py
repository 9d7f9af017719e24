"""BasePredictionWriter: what it hands write_on_batch_end / write_on_epoch_end and when (Lightning's calls)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import BasePredictionWriter
from ember.callbacks.prediction_writer import WriteInterval


class Net(ember.TrainModule):
    """Predicts ``10 * dataloader_idx + batch_idx`` for every sample, so each output names its batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return batch[0].sum(1) * 0 + batch_idx + 10 * dataloader_idx


class Writer(BasePredictionWriter):
    def __init__(self, write_interval: Any) -> None:
        super().__init__(write_interval)
        self.batches: list[tuple[list[float], Any, int, int, int]] = []
        self.epochs: list[tuple[Any, Any]] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((prediction.tolist(), batch_indices, len(batch[0]), batch_idx, dataloader_idx))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.epochs.append((predictions, batch_indices))


def predict(writer: BasePredictionWriter, loaders: Any, **kwargs: Any) -> Any:
    trainer = ember.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[writer])
    return trainer.predict(Net(), loaders, **kwargs)


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(5, 2)), batch_size=2)  # batches of 2, 2 and 1


def test_batch_interval_writes_each_batch_as_it_ends() -> None:
    writer = Writer("batch")
    assert predict(writer, loader(), return_predictions=False) is None
    # With each batch, the dataset indices of its samples.
    assert writer.batches == [([0.0, 0.0], [0, 1], 2, 0, 0), ([1.0, 1.0], [2, 3], 2, 1, 0), ([2.0], [4], 1, 2, 0)]
    assert writer.epochs == []


def test_epoch_interval_gets_every_output_once_per_loader() -> None:
    writer = Writer("epoch")
    predict(writer, loader(), return_predictions=False)  # the writer gets them even when predict keeps none
    assert writer.batches == []
    [(predictions, indices)] = writer.epochs
    assert [p.tolist() for p in predictions] == [[0.0, 0.0], [1.0, 1.0], [2.0]]
    assert all(p.device.type == "cpu" for p in predictions)
    assert indices == [[[0, 1], [2, 3], [4]]]  # per loader, per batch, as Lightning's epoch_batch_indices

    both = Writer("batch_and_epoch")
    predict(both, [loader(), loader()])
    assert [(b[3], b[4]) for b in both.batches] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    [(predictions, indices)] = both.epochs  # several loaders: a list of outputs per loader
    assert [[p.tolist() for p in per_loader] for per_loader in predictions] == [
        [[0.0, 0.0], [1.0, 1.0], [2.0]],
        [[10.0, 10.0], [11.0, 11.0], [12.0]],
    ]
    assert indices == [[[0, 1], [2, 3], [4]]] * 2


class Echo(Net):
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return batch[0][..., 0]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=[pytest.mark.processes, pytest.mark.timeout(120)])])
def test_indices_follow_a_shuffled_loader_and_its_workers(workers: int) -> None:
    data = torch.arange(11.0)[:, None].repeat(1, 2)  # sample i is (i, i)

    writer = Writer("batch_and_epoch")
    # Workers from a forkserver: forked from this test process, which earlier tests may leave with threads still
    # ending, a worker can deadlock before its first batch (CPython < 3.12); the indices are followed the same way.
    context = "forkserver" if workers else None
    shuffled = DataLoader(TensorDataset(data), batch_size=3, shuffle=True, num_workers=workers,
                          multiprocessing_context=context)  # fmt: skip
    trainer = ember.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[writer])
    trainer.predict(Echo(), shuffled, return_predictions=False)
    assert [b[1] for b in writer.batches] == [[int(v) for v in b[0]] for b in writer.batches]  # index i holds i
    assert sorted(i for b in writer.batches for i in b[1]) == list(range(11))
    assert writer.batches[0][1] != [0, 1, 2]  # shuffled (fails 1 time in 990)
    # Lightning's trainer.predict_loop keeps them after the run, with the outputs an epoch writer needed.
    assert trainer.predict_loop.epoch_batch_indices == [[b[1] for b in writer.batches]]
    assert [p.tolist() for p in trainer.predict_loop.predictions] == [b[0] for b in writer.batches]


def test_indices_are_empty_where_they_cannot_be_known() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([(torch.zeros(2),), (torch.ones(2),)])

    writer = Writer("batch")
    trainer = ember.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[writer])
    trainer.predict(Echo(), DataLoader(Stream(), batch_size=None), return_predictions=False)
    assert [b[1] for b in writer.batches] == [[], []]


def test_interval_is_lightnings_enum_and_a_bad_one_is_refused() -> None:
    writer = Writer("batch_and_epoch")
    assert writer.interval == "batch_and_epoch" and writer.interval is WriteInterval.BATCH_AND_EPOCH
    assert writer.interval.on_batch and writer.interval.on_epoch
    assert Writer("epoch").interval.on_batch is False and BasePredictionWriter().interval == "batch"
    with pytest.raises(ValueError, match=r"expected one of \['batch', 'epoch', 'batch_and_epoch'\]"):
        BasePredictionWriter("step")  # type: ignore[arg-type]


def test_a_writer_must_override_what_its_interval_calls() -> None:
    with pytest.raises(NotImplementedError, match="does not override write_on_batch_end"):
        predict(BasePredictionWriter("batch"), loader())
    with pytest.raises(NotImplementedError, match="does not override write_on_epoch_end"):
        predict(BasePredictionWriter("epoch"), loader())


def test_a_predict_step_that_fetches_its_own_batches_is_refused() -> None:
    class Fetches(Net):
        def predict_step(self, dataloader_iter: Any) -> Any:  # type: ignore[override]
            batch, _, _ = next(dataloader_iter)
            return batch[0]

    trainer = ember.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[Writer("batch")])
    with pytest.raises(NotImplementedError, match="dataloader_iter"):
        trainer.predict(Fetches(), loader())
