"""``Tuner(trainer).scale_batch_size(model)``: the power and binsearch searches, out-of-memory errors
(raised the way CUDA raises them, from a memory cap the test sets), the max_val and dataset bounds,
and that the module and the Trainer are as they were afterwards."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ember
from ember.tuner import Tuner
from tests.helpers.models import regression_data, regression_loader


class Capped(ember.TrainModule):
    """Builds its loaders from ``self.batch_size``; a batch over ``cap`` samples "runs out of memory"."""

    def __init__(self, batch_size: int = 4, cap: int | None = None, n: int = 4096) -> None:
        super().__init__()
        self.batch_size, self.cap, self.n = batch_size, cap, n
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.sizes: list[int] = []

    def train_dataloader(self):
        return DataLoader(regression_data(self.n), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(regression_data(self.n), batch_size=self.batch_size)

    def _check(self, x):
        self.sizes.append(len(x))
        if self.cap is not None and len(x) > self.cap:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate a batch of {len(x)}")

    def training_step(self, batch, batch_idx):
        x, y = batch
        self._check(x)
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self._check(x)
        self.log("val_loss", F.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(tmp_path, **kwargs) -> ember.Trainer:
    return ember.Trainer(
        accelerator="cpu", default_root_dir=tmp_path, enable_progress_bar=False, max_epochs=3, **kwargs
    )


def test_power_doubles_until_out_of_memory_and_keeps_the_last_size_that_fit(tmp_path):
    module = Capped(cap=50)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    t = trainer(tmp_path)
    callbacks = list(t.callbacks)
    assert Tuner(t).scale_batch_size(module) == 32
    assert module.batch_size == 32
    # Each trial ran 3 training steps and 3 validation batches at its size: 2, 4, ..., 32, then 64 failed.
    assert sorted(set(module.sizes)) == [2, 4, 8, 16, 32, 64]
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert t.callbacks == callbacks and (t.global_step, t.max_steps, t.limit_val_batches) == (0, -1, 1.0)
    assert not os.path.exists(os.path.join(tmp_path, "ember_logs"))  # trials log and save nothing
    module.sizes.clear()
    t.fit(module)  # the real fit: 3 epochs at the size found, with the default logger and checkpoints
    assert set(module.sizes) == {32} and t.current_epoch == 3
    assert os.listdir(os.path.join(t.log_dir, "checkpoints"))


def test_binsearch_bisects_to_the_largest_size_then_takes_the_margin_off(tmp_path):
    module = Capped(cap=50)
    found = Tuner(trainer(tmp_path, logger=False)).scale_batch_size(module, mode="binsearch")
    # 2..32 fit, 64 fails; 48 fits, 56 and 52 fail, 50 fits, 51 fails: 50, minus 5 %.
    assert found == module.batch_size == int(50 * 0.95)
    assert Tuner(trainer(tmp_path, logger=False)).scale_batch_size(Capped(cap=50), mode="binsearch", margin=0) == 50


def test_a_first_size_too_large_is_halved_until_it_fits(tmp_path):
    module = Capped(cap=10)
    assert Tuner(trainer(tmp_path, logger=False)).scale_batch_size(module, init_val=64) == 8


def test_max_val_and_the_dataset_size_bound_the_search(tmp_path):
    assert Tuner(trainer(tmp_path, logger=False)).scale_batch_size(Capped(), max_val=100) == 100
    assert Tuner(trainer(tmp_path, logger=False)).scale_batch_size(Capped(n=40)) == 64  # 64 >= 40 samples: stop
    assert Tuner(trainer(tmp_path, logger=False)).scale_batch_size(Capped(), max_trials=3) == 8


def test_nothing_fits_is_an_error_and_the_batch_size_is_given_back(tmp_path):
    module = Capped(batch_size=7, cap=0)
    with pytest.raises(RuntimeError, match="no batch size that fits"):
        Tuner(trainer(tmp_path, logger=False)).scale_batch_size(module)
    assert module.batch_size == 7


def test_other_errors_are_not_taken_for_out_of_memory(tmp_path):
    class Broken(Capped):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("a bug in the step")

    with pytest.raises(RuntimeError, match="a bug in the step"):
        Tuner(trainer(tmp_path, logger=False)).scale_batch_size(Broken())


def test_the_batch_size_in_hparams_or_a_datamodule(tmp_path):
    class Hp(Capped):
        def __init__(self, batch_size: int = 4):
            super().__init__(cap=20)
            del self.batch_size
            self.save_hyperparameters()

        def train_dataloader(self):
            return DataLoader(regression_data(self.n), batch_size=self.hparams.batch_size)

        def val_dataloader(self):
            return DataLoader(regression_data(self.n), batch_size=self.hparams.batch_size)

    module = Hp()
    assert Tuner(trainer(tmp_path, logger=False)).scale_batch_size(module) == module.hparams.batch_size == 16

    class Data(ember.DataModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 2

        def train_dataloader(self):
            return DataLoader(regression_data(256), batch_size=self.batch_size)

    class NoSize(Capped):
        def __init__(self):
            super().__init__(cap=20)
            del self.batch_size

        train_dataloader = None
        val_dataloader = None

    data = Data()
    assert Tuner(trainer(tmp_path, logger=False)).scale_batch_size(NoSize(), datamodule=data) == data.batch_size == 16


def test_mistakes_are_explained(tmp_path):
    tuner = Tuner(trainer(tmp_path, logger=False))
    with pytest.raises(ValueError, match="loaders passed in ready-made cannot change it"):
        tuner.scale_batch_size(Capped(), regression_loader())
    with pytest.raises(AttributeError, match="no 'bs' in the module"):
        tuner.scale_batch_size(Capped(), batch_arg_name="bs")
    with pytest.raises(ValueError, match="'power' or 'binsearch'"):
        tuner.scale_batch_size(Capped(), mode="binary")
    with pytest.raises(ValueError, match="margin must be in"):
        tuner.scale_batch_size(Capped(), margin=1.0)
    with pytest.raises(ValueError, match="method must be one of"):
        tuner.scale_batch_size(Capped(), method="train")


def test_validate_is_sized_by_its_own_batches(tmp_path):
    module = Capped(cap=40)
    assert Tuner(trainer(tmp_path, logger=False)).scale_batch_size(module, method="validate") == 32


def test_the_size_returned_always_ran(tmp_path):
    """Lightning 2.6.6 returns 128 for max_val=100 (never tried) and 64 for init_val=64 that ran out of
    memory; ember returns a size whose trial ran."""
    module = Capped()
    assert Tuner(trainer(tmp_path, logger=False)).scale_batch_size(module, max_val=100) == 100
    assert max(module.sizes) == 100
    module = Capped(cap=10)
    assert Tuner(trainer(tmp_path, logger=False)).scale_batch_size(module, init_val=64) == 8
    assert 8 in module.sizes
