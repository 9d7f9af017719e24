"""The resumable sampler swap (ember.data.resumable)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler, TensorDataset

from ember.data.resumable import SkipFirstBatches, make_resumable, resumable_sampler_of, why_not_swappable
from ember.data.sampler import ShardedSampler


def ds(n: int = 10) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def collate(items):
    return torch.stack([i[0] for i in items]) * 10


def test_swap_keeps_every_loader_setting():
    def init(worker_id):
        pass

    user = DataLoader(
        ds(),
        batch_size=3,
        shuffle=True,
        num_workers=2,
        collate_fn=collate,
        drop_last=True,
        worker_init_fn=init,
        persistent_workers=True,
        prefetch_factor=3,
        timeout=7,
    )
    swapped = make_resumable(user)
    assert isinstance(swapped, DataLoader) and swapped is not user
    for attr in (
        "dataset",
        "batch_size",
        "num_workers",
        "collate_fn",
        "drop_last",
        "worker_init_fn",
        "persistent_workers",
        "prefetch_factor",
        "timeout",
        "pin_memory",
    ):
        assert getattr(swapped, attr) == getattr(user, attr), attr
    sampler = resumable_sampler_of(swapped)
    assert isinstance(sampler, ShardedSampler) and sampler.shuffle and sampler.num_replicas == 1
    assert len(swapped) == len(user) == 3
    assert not isinstance(make_resumable(DataLoader(ds(), batch_size=3)).sampler, SequentialSampler)


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: type("Sub", (DataLoader,), {})(ds(), batch_size=2), "not a plain torch DataLoader"),
        (
            lambda: DataLoader(type("It", (IterableDataset,), {"__iter__": lambda s: iter([1])})(), batch_size=2),
            "IterableDataset",
        ),
        (lambda: DataLoader(ds(), batch_size=None), "batch_size=None"),
        (lambda: DataLoader(ds(), sampler=list(range(10)), batch_size=2), "custom sampler"),
        (lambda: DataLoader(ds(), batch_sampler=[[0, 1], [2, 3]]), "custom batch_sampler"),
    ],
)
def test_loaders_that_cannot_be_rebuilt_are_left_alone(make, reason):
    loader = make()
    assert reason in why_not_swappable(loader)
    assert make_resumable(loader) is loader


def test_sampler_state_and_resume_position():
    """What the Trainer relies on from the sampler: a restored position survives set_epoch of the same epoch."""
    s = ShardedSampler(10, 1, 0, shuffle=True, seed=5)
    s.set_epoch(2)
    full = list(s)
    assert sorted(full) == list(range(10)) and full != list(range(10))
    assert s.state_dict()["seed"] == 7 and s.state_dict()["epoch"] == 2
    resumed = ShardedSampler(10, 1, 0, shuffle=True, seed=5)
    resumed.load_state_dict({"seed": 7, "epoch": 2, "position": 4})
    resumed.set_epoch(2)  # the trainer calls this at the resumed epoch's start: it keeps the position
    assert list(resumed) == full[4:]
    resumed.set_epoch(2)
    assert list(resumed) == full  # the next iteration of the epoch is whole again
    resumed.set_epoch(3)
    assert list(resumed) != full


def test_resumed_iteration_draws_nothing_from_the_global_rng():
    loader = make_resumable(DataLoader(ds(), batch_size=2, shuffle=True))
    sampler = resumable_sampler_of(loader)
    sampler.load_state_dict({"seed": 123, "epoch": 0, "position": 4})
    state = torch.get_rng_state()
    batches = [b[0].tolist() for b in loader]
    assert torch.equal(torch.get_rng_state(), state)
    assert len(batches) == 3


def test_skip_first_batches_wrapper():
    loader = DataLoader(ds(), batch_size=2)
    wrapped = SkipFirstBatches(loader, 3)
    assert [b[0].tolist() for b in wrapped] == [[6, 7], [8, 9]]
    assert len(list(wrapped)) == 5 and len(wrapped) == 5 and wrapped.batch_size == 2


@pytest.mark.processes
def test_fit_end_stops_the_persistent_workers_of_the_loader_it_rebuilt():
    """The fit's end drops the rebuilt loader's iterator: its ``__del__`` stops the workers at once, without
    waiting for the garbage collector (which, in a reference cycle, takes seconds per worker)."""
    import gc
    import multiprocessing

    from tests.helpers.models import TrainOnlyModel, fast_trainer

    before = set(multiprocessing.active_children())
    during: list[int] = []

    class Model(TrainOnlyModel):
        def on_train_epoch_end(self) -> None:
            during.append(len(set(multiprocessing.active_children()) - before))

    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
    assert make_resumable(loader) is not loader  # the fit rebuilds it (a resumable sampler), so it owns the workers
    gc.disable()  # the workers must go by reference counting alone
    try:
        fast_trainer(max_epochs=2).fit(Model(), loader)
        assert during == [2, 2]  # persistent: the same two workers in both epochs
        assert set(multiprocessing.active_children()) - before == set()
    finally:
        gc.enable()
