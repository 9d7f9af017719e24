"""A training sampler with a ``set_epoch`` of its own (a ``RandomSampler`` subclass, or an instance given
one) is the user's per-epoch logic: in one process ember keeps the loader as given, so that ``set_epoch``
is called each epoch and the sampler's order is the one trained on, as in Lightning. A mid-epoch resume
then skips the consumed batches, with a warning; ``ddp`` still shards such a loader with its own sampler."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

import ember
from ember.callbacks import Callback, ModelCheckpoint
from ember.data.resumable import make_resumable
from ember.data.sampler import ShardedSampler
from tests.helpers.models import TrainOnlyModel, fast_trainer, regression_data

N, BATCH = 16, 4  # 4 batches per epoch


class EpochSeeded(RandomSampler):
    """Shuffles by the epoch it was told: epoch e's order is ``randperm(N)`` of a generator seeded with e."""

    def __init__(self, data) -> None:
        super().__init__(data)
        self.epochs: list[int] = []
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)
        self.generator = torch.Generator().manual_seed(epoch)


def epoch_order(epoch: int) -> list[int]:
    return torch.randperm(N, generator=torch.Generator().manual_seed(epoch)).tolist()


class Seen(TrainOnlyModel):
    """Records the samples of each training batch (their indices: x's first column identifies them)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []
        self.firsts = regression_data(N).tensors[0][:, 0].tolist()

    def training_step(self, batch, batch_idx):
        self.seen += [self.firsts.index(v) for v in batch[0][:, 0].tolist()]
        return super().training_step(batch, batch_idx)


def test_a_random_sampler_given_set_epoch_is_called_each_epoch():
    data = regression_data(N)
    sampler = RandomSampler(data)
    calls: list[int] = []
    sampler.set_epoch = calls.append  # type: ignore[attr-defined]
    loader = DataLoader(data, sampler=sampler, batch_size=BATCH)
    trainer = fast_trainer(max_epochs=3)
    trainer.fit(TrainOnlyModel(), loader)
    assert calls == [0, 1, 2]
    assert trainer.train_dataloader is loader


def test_a_sampler_subclass_with_set_epoch_orders_each_epoch():
    data = regression_data(N)
    sampler = EpochSeeded(data)
    module = Seen()
    fast_trainer(max_epochs=3).fit(module, DataLoader(data, sampler=sampler, batch_size=BATCH))
    assert sampler.epochs == [0, 0, 1, 2]  # its own __init__'s call, then the loop's
    assert module.seen == epoch_order(0) + epoch_order(1) + epoch_order(2)


def test_make_resumable_keeps_a_set_epoch_sampler_in_one_process_only():
    data = regression_data(N)
    loader = DataLoader(data, sampler=EpochSeeded(data), batch_size=BATCH)
    assert make_resumable(loader) is loader
    # with a factory (ddp's sharding), the loader is rebuilt on the factory's sampler, as before
    sharded = make_resumable(loader, lambda n, shuffle, user: ShardedSampler(n, 2, 0, shuffle=shuffle))
    assert sharded is not loader and isinstance(sharded.sampler, ShardedSampler)
    # samplers without a set_epoch are still made resumable
    for plain in (DataLoader(data, batch_size=BATCH), DataLoader(data, batch_size=BATCH, shuffle=True)):
        assert isinstance(make_resumable(plain).sampler, ShardedSampler)
    assert isinstance(DataLoader(data).sampler, SequentialSampler)


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("stopped")


def test_a_mid_epoch_resume_skips_the_consumed_batches_of_the_users_order(tmp_path):
    def run(module, ckpt_path=None, stop=None):
        data = regression_data(N)
        callbacks = [ModelCheckpoint(dirpath=os.path.join(tmp_path, "c"), every_n_train_steps=2)]
        trainer = ember.Trainer(
            max_epochs=2,
            enable_progress_bar=False,
            logger=False,
            callbacks=callbacks + ([StopAt(stop)] if stop else []),
        )
        trainer.fit(module, DataLoader(data, sampler=EpochSeeded(data), batch_size=BATCH), ckpt_path=ckpt_path)
        return module

    with pytest.raises(RuntimeError, match="stopped"):
        run(Seen(), stop=7)  # the last checkpoint: step 6, the 2nd batch of epoch 1
    with pytest.warns(UserWarning, match="cannot resume at the sampler level"):
        resumed = run(Seen(), ckpt_path="last")
    assert resumed.seen == epoch_order(1)[2 * BATCH :]
