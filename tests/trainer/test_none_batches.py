"""A train loader that yields None for a batch: as Lightning 2.6, the batch is skipped (no on_train_batch_start,
no training_step, no optimizer step), on_train_batch_end gets outputs=None, and the batch counts as one of the
epoch's (batch_idx, the validation interval, accumulation windows, the position a resume skips to)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

from ember.callbacks import Callback
from tests.helpers.models import BoringModel, TrainOnlyModel, fast_trainer
from tests.helpers.weights import assert_same_weights

N, BATCH = 24, 4  # 6 batches an epoch


def indexed_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True), torch.arange(N))


def loader(none_at: tuple[int, ...]) -> DataLoader:
    """Batches of (x, y); None in place of the batches numbered ``none_at`` (decided by the samples, so that
    a resumed loader yields the same)."""

    def collate(samples: list[Any]) -> Any:
        x, y, idx = default_collate(samples)
        return None if int(idx[0]) // BATCH in none_at else (x, y)

    return DataLoader(indexed_data(), batch_size=BATCH, collate_fn=collate)


class Recording(TrainOnlyModel):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[Any, ...]] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.events.append(("start", batch_idx, self.trainer.global_step))

    def training_step(self, batch, batch_idx):
        self.events.append(("step", batch_idx))
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.events.append(("end", batch_idx, outputs is None, batch is None, self.trainer.global_step))


class EndOutputs(Callback):
    def __init__(self) -> None:
        self.outputs: list[Any] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.outputs.append(outputs)


def test_a_none_batch_is_skipped_and_counted_as_lightning():
    # Lightning 2.6.6, 6 batches with None at 1 and 4: the same events, global_step 4, the batches counted 6.
    module, outputs = Recording(), EndOutputs()
    trainer = fast_trainer(callbacks=[outputs])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader(none_at=(1, 4)))
    assert module.events == [
        ("start", 0, 0),
        ("step", 0),
        ("end", 0, False, False, 1),
        ("end", 1, True, True, 1),
        ("start", 2, 1),
        ("step", 2),
        ("end", 2, False, False, 2),
        ("start", 3, 2),
        ("step", 3),
        ("end", 3, False, False, 3),
        ("end", 4, True, True, 3),
        ("start", 5, 3),
        ("step", 5),
        ("end", 5, False, False, 4),
    ]
    assert [o is None for o in outputs.outputs] == [False, True, False, False, True, False]
    assert set(outputs.outputs[0]) == {"loss"}  # a real batch's hooks still see Lightning's {"loss": ...}
    assert trainer.global_step == 4
    assert trainer.progress.total_batches == 6  # (Lightning: batch_progress.total.ready == 6)
    said = [w for w in caught if "yielded None" in str(w.message)]
    assert len(said) == 1 and said[0].category is UserWarning  # once per fit, as Lightning's warning cache
    assert str(said[0].message).startswith("train_dataloader yielded None")
    assert said[0].filename == __file__


def test_a_none_batch_counts_toward_the_validation_interval():
    seen: list[int] = []

    class Val(Callback):
        def on_validation_start(self, trainer, module):
            if not trainer.sanity_checking:
                seen.append(trainer.progress.batch_in_epoch)

    trainer = fast_trainer(callbacks=[Val()], val_check_interval=2, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "train_dataloader yielded None")
        trainer.fit(BoringModel(), loader(none_at=(1,)), loader(none_at=()))
    assert seen == [2, 4, 6]  # after the None batch 1 too


def test_manual_optimization_skips_a_none_batch():
    class Manual(TrainOnlyModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.steps: list[int] = []

        def training_step(self, batch, batch_idx):
            self.steps.append(batch_idx)
            opt = self.optimizers()
            x, y = batch
            opt.zero_grad()
            self.manual_backward(F.mse_loss(self(x), y))
            opt.step()

    module = Manual()
    trainer = fast_trainer()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "train_dataloader yielded None")
        trainer.fit(module, loader(none_at=(0, 3)))
    assert module.steps == [1, 2, 4, 5] and trainer.global_step == 4


def sgd_reference(windows: list[list[int]], steps: list[bool]) -> torch.nn.Module:
    """The weights after SGD steps on the given windows of batches (each batch's loss divided by the window's
    size, 2), stepping only where ``steps`` says."""
    torch.manual_seed(0)
    module = BoringModel()
    x, y, _ = indexed_data().tensors
    opt = torch.optim.SGD(module.parameters(), lr=module.lr)
    for batches, step in zip(windows, steps):
        opt.zero_grad()
        for b in batches:
            sl = slice(b * BATCH, (b + 1) * BATCH)
            (F.mse_loss(module(x[sl]), y[sl]) / 2).backward()
        if step:
            opt.step()
    return module


def test_accumulation_a_none_batch_holds_its_place_in_the_window():
    # Windows of 2: {0, None}: no step (as Lightning: the last batch of the window takes it); {2, 3}: a step;
    # {None, 5}: the window is zeroed at its None batch, so batch 5 alone steps (Lightning would add the
    # previous window's gradients to it, never zeroed).
    zero_grads: list[int] = []

    class Counted(TrainOnlyModel):
        def on_before_zero_grad(self, optimizer):
            zero_grads.append(self.trainer.progress.batch_in_epoch)

    torch.manual_seed(0)
    module = Counted()
    trainer = fast_trainer(accumulate_grad_batches=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "train_dataloader yielded None")
        trainer.fit(module, loader(none_at=(1, 4)))
    assert trainer.global_step == 2
    assert zero_grads == [0, 2, 4]  # at each window's first batch (batch_in_epoch is the batches before it)
    assert_same_weights(module, sgd_reference([[0], [2, 3], [5]], [False, True, True]))


class SaveAfterBatch(Callback):
    """Saves a checkpoint at the step boundary after the epoch's ``after``-th batch (first epoch only)."""

    def __init__(self, path: str, after: int) -> None:
        self.path, self.after = path, after

    def on_train_step_boundary(self, trainer, module):
        if trainer.current_epoch == 0 and trainer.progress.batch_in_epoch == self.after:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_resume_after_a_none_batch_continues_at_the_next_batch(tmp_path, accumulate):
    path = str(tmp_path / "after_none.ckpt")
    torch.manual_seed(0)
    reference = Recording()
    trainer = fast_trainer(max_epochs=2, accumulate_grad_batches=accumulate, callbacks=[SaveAfterBatch(path, 2)])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "train_dataloader yielded None")
        trainer.fit(reference, loader(none_at=(1, 4)))
        torch.manual_seed(1)
        resumed = Recording()
        again = fast_trainer(max_epochs=2, accumulate_grad_batches=accumulate)
        again.fit(resumed, loader(none_at=(1, 4)), ckpt_path=path)
    # The checkpoint was written after the None batch 1: the resumed fit starts at batch 2 of epoch 0.
    first = next(i for i, event in enumerate(reference.events) if event[:2] == ("start", 2))
    assert resumed.events == reference.events[first:]
    assert again.global_step == trainer.global_step == (8 if accumulate == 1 else 4)
    assert again.progress.total_batches == trainer.progress.total_batches == 12
    assert_same_weights(resumed, reference, bitwise=True)


def test_a_training_step_taking_dataloader_iter_gets_the_none_batches_itself():
    # As Lightning: the skipping is for the usual training_step(batch, batch_idx) only.
    class Iter(TrainOnlyModel):
        def __init__(self) -> None:
            super().__init__()
            self.fetched: list[Any] = []

        def training_step(self, dataloader_iter):
            batch, _, _ = next(dataloader_iter)
            self.fetched.append(batch is None)
            if batch is None:
                return None
            x, y = batch
            return F.mse_loss(self(x), y)

    module = Iter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "training_step returned None")
        fast_trainer().fit(module, loader(none_at=(1,)))
    assert module.fetched == [False, True, False, False, False, False]
