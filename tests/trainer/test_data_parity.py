"""Where a fit's batches come from and when, as a Lightning 2.6 user's code observes it: the Trainer's loader
attributes, samplers' ``set_epoch``, reloading, ``overfit_batches``, loaders without a length, the sanity
check's random numbers, and an epoch ended early by ``on_train_batch_start``."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, SequentialSampler

import ember
from tests.helpers.models import BoringModel, TrainOnlyModel, fast_trainer, regression_data, regression_loader


class ValModel(BoringModel):
    """A BoringModel that defines its own loaders (as Lightning's BoringModel does)."""

    def train_dataloader(self) -> DataLoader:
        return regression_loader()

    def val_dataloader(self) -> DataLoader:
        return regression_loader(16)


# ---------------------------------------------------------------------- Trainer attributes
def test_eval_loader_attributes_and_enable_validation():
    trainer = fast_trainer(limit_train_batches=2)
    assert trainer.test_dataloaders is None and trainer.predict_dataloaders is None
    assert trainer.enable_validation is False  # nothing attached yet
    trainer.fit(ValModel())
    assert trainer.enable_validation is True
    test_loader, predict_loader = regression_loader(8), regression_loader(16)
    trainer.test(ValModel(), test_loader, verbose=False)
    assert trainer.test_dataloaders is test_loader
    trainer.predict(ValModel(), [predict_loader, predict_loader])
    assert trainer.predict_dataloaders == [predict_loader, predict_loader]
    trainer.fit(TrainOnlyModel(), regression_loader())  # no validation_step
    assert trainer.enable_validation is False
    trainer = fast_trainer(limit_val_batches=0)
    trainer.fit(ValModel())
    assert trainer.enable_validation is False


def test_val_dataloaders_inside_validate_are_the_validated_ones():
    seen = []

    class M(ValModel):
        def on_validation_start(self) -> None:
            seen.append(self.trainer.val_dataloaders)

    given = regression_loader(8)
    fast_trainer().validate(M(), given)
    assert seen == [given]


def test_is_last_batch_is_true_on_the_epochs_last_batch_only():
    flags = []

    class M(TrainOnlyModel):
        def on_train_batch_start(self, batch, batch_idx):
            flags.append(self.trainer.is_last_batch)

    fast_trainer(max_epochs=2, limit_train_batches=3).fit(M(), regression_loader())
    assert flags == [False, False, True] * 2


# ---------------------------------------------------------------------- samplers and reloading
class EpochSampler(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n, self.epochs = n, []

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def test_set_epoch_reaches_the_users_train_and_validation_samplers():
    train, val = EpochSampler(32), EpochSampler(16)
    fast_trainer(max_epochs=3, limit_train_batches=2, limit_val_batches=2).fit(
        BoringModel(),
        DataLoader(regression_data(32), sampler=train, batch_size=8),
        DataLoader(regression_data(16), sampler=val, batch_size=8),
    )
    assert train.epochs == [0, 1, 2]
    assert val.epochs == [0, 0, 1, 2]  # the sanity check, then each epoch's validation (as Lightning)
    test_sampler = EpochSampler(16)
    trainer = fast_trainer()
    trainer.test(BoringModel(), DataLoader(regression_data(16), sampler=test_sampler, batch_size=8))
    assert test_sampler.epochs == [0]


def test_the_validation_loader_is_reloaded_when_a_validation_is_due():
    requested = []

    class M(ValModel):
        def train_dataloader(self):
            requested.append(("train", self.current_epoch))
            return super().train_dataloader()

        def val_dataloader(self):
            requested.append(("val", self.current_epoch))
            return super().val_dataloader()

    fast_trainer(
        max_epochs=5,
        reload_dataloaders_every_n_epochs=1,
        check_val_every_n_epoch=2,
        limit_train_batches=1,
        limit_val_batches=1,
    ).fit(M())
    assert requested == [
        ("val", 0),
        ("train", 0),
        ("train", 1),
        ("val", 1),
        ("train", 2),
        ("train", 3),
        ("val", 3),
        ("train", 4),
    ]


# ---------------------------------------------------------------------- overfit_batches
def test_overfit_batches_makes_a_shuffled_or_custom_sampler_sequential():
    train_batches, val_batches = [], []

    class M(BoringModel):
        def training_step(self, batch, batch_idx):
            train_batches.append(batch[0].sum().item())
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            val_batches.append(batch[0].sum().item())

    train = DataLoader(regression_data(32), batch_size=8, shuffle=True)
    val = DataLoader(regression_data(32, seed=1), batch_size=8, sampler=EpochSampler(32))
    trainer = fast_trainer(max_epochs=2, overfit_batches=2, num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match="You requested to overfit but enabled train dataloader shuffling") as rec:
        trainer.fit(M(), train, val)
    assert any("enabled val dataloader shuffling" in str(w.message) for w in rec)
    first = [b[0].sum().item() for b in DataLoader(regression_data(32), batch_size=8)][:2]
    assert train_batches == first * 2  # the first two batches in order, every epoch
    val_first = [b[0].sum().item() for b in DataLoader(regression_data(32, seed=1), batch_size=8)][:2]
    assert val_batches == val_first * 2  # validation runs on its own loader's first batches (Lightning 2.x)
    assert isinstance(trainer.val_dataloaders.sampler, SequentialSampler)


# ---------------------------------------------------------------------- loaders without a length
class Empty(IterableDataset):
    def __iter__(self):
        return iter([])


class NoLen:
    """A loader wrapper whose ``__len__`` raises NotImplementedError (as some stream wrappers do)."""

    def __init__(self) -> None:
        self.loader = regression_loader()

    def __iter__(self):
        return iter(self.loader)

    def __len__(self) -> int:
        raise NotImplementedError


def test_an_iterable_with_nothing_this_epoch_ends_the_epoch_empty():
    ends = []

    class M(TrainOnlyModel):
        def on_train_epoch_end(self):
            ends.append(self.current_epoch)

    trainer = fast_trainer(max_epochs=2)
    trainer.fit(M(), DataLoader(Empty(), batch_size=2))
    assert ends == [0, 1] and trainer.current_epoch == 2 and trainer.global_step == 0


def test_a_loader_whose_len_raises_not_implemented_is_unsized():
    trainer = fast_trainer()
    trainer.fit(TrainOnlyModel(), NoLen())
    assert trainer.num_training_batches == float("inf") and trainer.global_step == 4


# ---------------------------------------------------------------------- the sanity check and the RNG
def test_the_sanity_check_leaves_the_global_random_state_as_it_found_it():
    drawn = []

    class M(BoringModel):
        def on_train_start(self):
            drawn.append(torch.rand(3))

    for sanity in (2, 0):
        val = DataLoader(regression_data(32), batch_size=8, shuffle=True)  # draws from torch's global RNG
        torch.manual_seed(0)
        fast_trainer(limit_train_batches=1, num_sanity_val_steps=sanity).fit(M(), regression_loader(), val)
    assert torch.equal(drawn[0], drawn[1])


# ---------------------------------------------------------------------- on_train_batch_start returning -1
def test_an_epoch_ended_by_on_train_batch_start_steps_its_epoch_schedulers():
    class M(TrainOnlyModel):
        def on_train_batch_start(self, batch, batch_idx):
            self.last = self.trainer.is_last_batch
            return -1 if batch_idx == 1 else None

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            self.sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
            return [opt], [self.sched]

    module = M()
    trainer = fast_trainer(max_epochs=2)
    trainer.fit(module, regression_loader())
    assert module.sched.last_epoch == 2 and module.sched.get_last_lr() == [pytest.approx(0.025)]
    assert trainer.global_step == 2 and trainer.is_last_batch


# ---------------------------------------------------------------------- validation_step without data
def test_validation_step_without_validation_data_warns_once_per_fit():
    trainer = fast_trainer(max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BoringModel(), regression_loader())
    said = [str(w.message) for w in caught if "validation_step" in str(w.message)]
    assert said == [
        "BoringModel defines validation_step, but this fit has no validation data (no val_dataloaders "
        "passed to fit and no val_dataloader() on the module or datamodule), so validation is skipped. "
        "Pass val_dataloaders to validate."
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TrainOnlyModel(), regression_loader())  # no validation_step: nothing to say
        trainer.fit(BoringModel(), regression_loader(), regression_loader())
    assert not [w for w in caught if "validation_step" in str(w.message)]


def test_fast_dev_run_reads_as_lightning_and_skips_early_stopping():
    assert fast_trainer(fast_dev_run=True).fast_dev_run is True
    assert fast_trainer(fast_dev_run=1).fast_dev_run is True
    assert fast_trainer(fast_dev_run=3).fast_dev_run == 3
    assert fast_trainer(fast_dev_run=False).fast_dev_run is False
    seen = []

    class M(ValModel):
        def training_step(self, batch, batch_idx):
            self.logger.experiment.add_scalar("x", 1.0)  # works: the DummyLogger's experiment does nothing
            self.logger[0].experiment.add_image("y", None)
            seen.append(type(self.logger).__name__)
            return super().training_step(batch, batch_idx)

    trainer = ember.Trainer(
        fast_dev_run=True,
        accelerator="cpu",
        enable_progress_bar=False,
        callbacks=[ember.callbacks.EarlyStopping(monitor="not_logged")],
    )
    trainer.fit(M())  # an unknown monitor is not checked in a smoke run (it would raise otherwise)
    assert seen == ["DummyLogger"] and trainer.global_step == 1
    assert fast_trainer(fast_dev_run=True, logger=False).loggers == []
