"""CombinedLoader: Lightning's four modes (checked against Lightning 2.6.6), what the steps receive in fit
and evaluation, ddp sharding of each inner loader, and an exact mid-epoch resume."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ModelCheckpoint
from ember.utilities import CombinedLoader
from tests.helpers.dist import join_as_rank, run_ranks

A, B = list(range(5)), list(range(10, 13))


@pytest.mark.parametrize(
    "mode, length, batches",
    [
        (
            "max_size_cycle",
            5,
            [{"a": 0, "b": 10}, {"a": 1, "b": 11}, {"a": 2, "b": 12}, {"a": 3, "b": 10}, {"a": 4, "b": 11}],
        ),
        ("min_size", 3, [{"a": 0, "b": 10}, {"a": 1, "b": 11}, {"a": 2, "b": 12}]),
        (
            "max_size",
            5,
            [{"a": 0, "b": 10}, {"a": 1, "b": 11}, {"a": 2, "b": 12}, {"a": 3, "b": None}, {"a": 4, "b": None}],
        ),
    ],
)
def test_combining_modes_match_lightning(mode, length, batches):
    combined = CombinedLoader({"a": A, "b": B}, mode)
    assert len(combined) == length
    assert list(combined) == [(batch, i, 0) for i, batch in enumerate(batches)]
    assert list(combined) == [(batch, i, 0) for i, batch in enumerate(batches)]  # a second pass starts over
    as_list = CombinedLoader([A, B], mode)
    assert next(iter(as_list)) == ([0, 10], 0, 0)


def test_sequential_mode_and_the_structure():
    combined = CombinedLoader({"a": A, "b": B}, "sequential")
    assert len(combined) == 8
    assert list(combined) == [(0, 0, 0), (1, 1, 0), (2, 2, 0), (3, 3, 0), (4, 4, 0), (10, 0, 1), (11, 1, 1), (12, 2, 1)]
    assert CombinedLoader({"a": A}).flattened == [A]  # a list of samples is one iterable, not a list of them
    assert CombinedLoader({"a": A}).mode == "min_size"  # Lightning's default
    nested = CombinedLoader({"x": [A, B], "y": (B,)}, "min_size")
    assert next(iter(nested))[0] == {"x": [0, 10], "y": (10,)}
    with pytest.raises(ValueError, match="Unsupported mode 'foo'"):
        CombinedLoader([A], "foo")


def data(n: int, offset: float) -> TensorDataset:
    g = torch.Generator().manual_seed(n)
    return TensorDataset(torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g), torch.arange(n) + offset)


class Two(ember.TrainModule):
    """Trains on a dict batch {"a": (x, y, idx), "b": (x, y, idx)}; records what each step receives."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: list[tuple] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(("train", batch_idx, batch["a"][2].tolist(), batch["b"][2].tolist()))
        loss = sum(F.mse_loss(self.layer(x), y) for x, y, _ in batch.values())
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.seen.append(("val", batch_idx, dataloader_idx, batch[2].tolist()))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def trainer(**kwargs: Any) -> ember.Trainer:
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    return ember.Trainer(max_epochs=1, enable_progress_bar=False, num_sanity_val_steps=0, **kwargs)


def test_fit_with_a_dict_of_loaders_cycles_the_shorter_and_validates_sequentially():
    """As Lightning: a dict of train loaders is combined in max_size_cycle mode and training_step gets the dict
    (no dataloader_idx); a sequential CombinedLoader of validation loaders gives each its dataloader_idx."""
    module = Two()
    t = trainer()
    t.fit(
        module,
        {"a": DataLoader(data(6, 0), batch_size=2), "b": DataLoader(data(4, 100), batch_size=2)},
        CombinedLoader([DataLoader(data(2, 0), batch_size=2), DataLoader(data(1, 50))], "sequential"),
    )
    assert t.num_training_batches == 3 and t.num_val_batches == [1, 1]
    assert module.seen == [
        ("train", 0, [0, 1], [100, 101]),
        ("train", 1, [2, 3], [102, 103]),
        ("train", 2, [4, 5], [100, 101]),
        ("val", 0, 0, [0, 1]),
        ("val", 0, 1, [50]),
    ]


def test_sequential_training_is_refused_and_max_size_evaluation_gives_combined_batches():
    t = trainer()
    with pytest.raises(ValueError, match="sequential"):
        t.fit(Two(), CombinedLoader([DataLoader(data(4, 0))], "sequential"))

    class Val(Two):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.seen.append((batch_idx, [None if b is None else b[2].tolist() for b in batch]))

    module = Val()
    trainer().validate(module, CombinedLoader([DataLoader(data(2, 0)), DataLoader(data(1, 50))], "max_size"))
    assert module.seen == [(0, [[0], [50]]), (1, [[1], None])]


def _fit(root: str, ckpt_path: str | None = None, **kwargs: Any) -> tuple[Two, ember.Trainer]:
    ember.seed_everything(0)
    module = Two()
    loaders = {
        "a": DataLoader(data(10, 0), batch_size=2, shuffle=True),
        "b": DataLoader(data(6, 100), batch_size=2, shuffle=True),
    }
    t = ember.Trainer(
        max_epochs=2,
        enable_progress_bar=False,
        default_root_dir=root,  # logger on
        callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "c"), every_n_train_steps=1)],
        **kwargs,
    )
    t.fit(module, CombinedLoader(loaders, "max_size_cycle"), ckpt_path=ckpt_path)
    return module, t


@pytest.mark.parametrize("stop", [4, 7])
def test_mid_epoch_resume_continues_every_inner_loader_exactly(tmp_path, stop):
    """Shuffled inner loaders of 5 and 3 batches: the resumed run trains on exactly the samples, in the order,
    the uninterrupted run did (stop=4: the shorter loader already started its second pass; 7: epoch 1)."""
    ref, _ = _fit(str(tmp_path / "ref"))
    root = str(tmp_path / "run")
    first, _ = _fit(root, max_steps=stop)
    resumed, t = _fit(root, ckpt_path=os.path.join(root, "c", "last.ckpt"))
    assert t.global_step == 10
    assert first.seen + resumed.seen == ref.seen
    for a, b in zip(ref.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def _ddp(rank: int, world: int) -> list[tuple]:
    join_as_rank(rank, world)
    warnings.simplefilter("ignore")
    module = Two()
    t = trainer(strategy="ddp", devices=world, accelerator="cpu")
    t.fit(
        module,
        {"a": DataLoader(data(8, 0), batch_size=2), "b": DataLoader(data(4, 100), batch_size=2)},
        CombinedLoader([DataLoader(data(4, 0), batch_size=2), DataLoader(data(2, 50))], "sequential"),
    )
    return module.seen


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_under_ddp_each_inner_loader_is_sharded():
    """2 ranks: each inner train loader is split between the ranks (rank r takes samples r, r+2, ...), so
    together they see each epoch's samples once; validation loaders too."""
    seen = run_ranks(_ddp, 2, timeout=80)
    assert seen[0] == [
        ("train", 0, [0, 2], [100, 102]),
        ("train", 1, [4, 6], [100, 102]),
        ("val", 0, 0, [0, 2]),
        ("val", 0, 1, [50]),
    ]
    assert seen[1] == [
        ("train", 0, [1, 3], [101, 103]),
        ("train", 1, [5, 7], [101, 103]),
        ("val", 0, 0, [1, 3]),
        ("val", 0, 1, [51]),
    ]


def test_dp_trains_on_combined_batches_as_one_device_does():
    """strategy="dp" scatters each combined (dict) batch over 2 replicas; the weights equal one device's."""
    results = []
    for kwargs in (dict(), dict(strategy="dp", devices=2, accelerator="cpu")):
        torch.manual_seed(0)
        module = Two()
        trainer(**kwargs).fit(
            module, {"a": DataLoader(data(8, 0), batch_size=4), "b": DataLoader(data(4, 100), batch_size=4)}
        )
        results.append([p.detach().clone() for p in module.parameters()])
    for single, dp in zip(*results):
        torch.testing.assert_close(dp, single)


def _two() -> dict:
    return {"a": DataLoader(range(10), batch_size=2), "b": DataLoader(range(6), batch_size=2)}  # 5 and 3 batches


@pytest.mark.parametrize(
    "mode, limits, length",
    [
        ("min_size", None, 3),
        ("min_size", [4, 1], 1),
        ("min_size", 2, 2),
        ("max_size_cycle", [1, 5], 3),
        ("max_size", 2, 2),
        ("sequential", None, 8),
        ("sequential", [4, 1], 5),
    ],
)
def test_limits_cap_each_loader_in_the_length_as_lightnings(mode, limits, length):
    combined = CombinedLoader(_two(), mode)
    combined.limits = limits
    assert len(combined) == length
    assert combined.limits == (None if limits is None else [limits] * 2 if isinstance(limits, int) else limits)


def test_sequential_mode_moves_on_at_a_loaders_limit():
    combined = CombinedLoader(_two(), "sequential")
    combined.limits = [2, 1]
    assert [(batch.tolist(), i, d) for batch, i, d in combined] == [([0, 1], 0, 0), ([2, 3], 1, 0), ([0, 1], 0, 1)]


def test_a_limit_per_loader_must_match_the_loaders():
    with pytest.raises(ValueError, match="2 loaders but 3 limits"):
        CombinedLoader(_two()).limits = [1, 2, 3]


def test_samplers_and_batch_samplers_in_the_structure_given():
    loaders = _two()
    combined = CombinedLoader({**loaders, "plain": [1, 2]})
    assert combined.sampler == {"a": loaders["a"].sampler, "b": loaders["b"].sampler, "plain": None}
    assert combined.batch_sampler["a"] is loaders["a"].batch_sampler


@pytest.mark.processes
def test_reset_stops_the_workers_of_persistent_loaders():
    loader = DataLoader(range(8), batch_size=2, num_workers=1, persistent_workers=True)
    combined = CombinedLoader([loader])
    next(iter(combined))
    workers = list(loader._iterator._workers)
    combined.reset()
    assert loader._iterator is None
    for worker in workers:
        worker.join(5)
        assert not worker.is_alive()
