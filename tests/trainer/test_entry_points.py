"""fit / validate / test / predict: what they take and return, and the Trainer's public state."""

from __future__ import annotations

import math

import pytest
import torch

import ember
from ember.callbacks import Callback
from ember.strategies import SingleDeviceStrategy
from tests.helpers.models import BoringModel, TrainOnlyModel, fast_trainer, regression_loader


class ConstEval(BoringModel):
    """Logs a constant per dataloader so returned dicts are predictable."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_const", float(10 + dataloader_idx))
        assert not self.training and not torch.is_grad_enabled()

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("test_const", float(20 + dataloader_idx))
        self.log("test_sum", 1.0, reduce_fx="sum")


def test_validate_returns_a_list_with_one_metric_dict():
    trainer = fast_trainer()
    module = ConstEval()
    assert trainer.validate(module, regression_loader()) == [{"val_const": 10.0}]
    assert module.training  # restored after evaluation
    assert trainer.callback_metrics["val_const"] == 10.0


def test_test_returns_a_list_with_one_metric_dict():
    trainer = fast_trainer()
    assert trainer.test(ConstEval(), regression_loader()) == [{"test_const": 20.0, "test_sum": 4.0}]


def test_evaluation_with_several_dataloaders_returns_a_dict_per_loader():
    trainer = fast_trainer()
    out = trainer.test(ConstEval(), [regression_loader(), regression_loader(n=16)])
    assert out == [
        {"test_const/dataloader_idx_0": 20.0, "test_sum/dataloader_idx_0": 4.0},
        {"test_const/dataloader_idx_1": 21.0, "test_sum/dataloader_idx_1": 2.0},
    ]
    out = trainer.validate(ConstEval(), (regression_loader(), regression_loader()))
    assert out == [{"val_const/dataloader_idx_0": 10.0}, {"val_const/dataloader_idx_1": 11.0}]


def test_evaluation_metrics_go_to_the_loggers():
    from tests.helpers.models import RecordingLogger

    lg = RecordingLogger()
    trainer = fast_trainer(logger=lg)
    trainer.test(ConstEval(), regression_loader())
    # Checked against Lightning 2.6.6: the logger gets the epoch too; logged_metrics holds tensors and no epoch.
    assert lg.records == [(0, {"test_const": 20.0, "test_sum": 4.0, "epoch": 0.0})]
    assert trainer.logged_metrics == {"test_const": torch.tensor(20.0), "test_sum": torch.tensor(4.0)}


def test_predict_returns_the_outputs():
    trainer = fast_trainer()
    module = BoringModel()
    out = trainer.predict(module, regression_loader(n=20, batch_size=8))
    assert [o.shape for o in out] == [torch.Size([8, 1]), torch.Size([8, 1]), torch.Size([4, 1])]
    x = regression_loader(n=20, batch_size=8).dataset.tensors[0]
    torch.testing.assert_close(torch.cat(out), module(x).detach())
    assert not any(o.requires_grad for o in out)


def test_predict_with_several_loaders_returns_a_list_per_loader():
    seen_idx = []

    class Custom(BoringModel):
        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            seen_idx.append(dataloader_idx)
            return {"idx": dataloader_idx, "n": len(batch[0])}

    out = fast_trainer().predict(Custom(), [regression_loader(n=8), regression_loader(n=16)])
    assert out == [[{"idx": 0, "n": 8}], [{"idx": 1, "n": 8}, {"idx": 1, "n": 8}]]
    assert seen_idx == [0, 1, 1]


def test_eval_entry_points_reuse_the_fitted_module():
    trainer = fast_trainer()
    module = ConstEval()
    trainer.fit(module, regression_loader())
    assert trainer.validate(dataloaders=regression_loader()) == [{"val_const": 10.0}]
    assert trainer.test(dataloaders=regression_loader())[0]["test_const"] == 20.0
    assert len(trainer.predict(dataloaders=regression_loader())) == 4


def test_loaders_from_the_module_methods():
    class WithLoaders(ConstEval):
        def train_dataloader(self):
            return regression_loader()

        def val_dataloader(self):
            return regression_loader()

        def test_dataloader(self):
            return regression_loader()

        def predict_dataloader(self):
            return regression_loader(n=8)

    trainer = fast_trainer()
    module = WithLoaders()
    trainer.fit(module)
    assert trainer.global_step == 4 and trainer.callback_metrics["val_const"] == 10.0
    assert trainer.test(module)[0]["test_const"] == 20.0
    assert len(trainer.predict(module)) == 1


def test_fit_twice_restarts_the_counters():
    trainer = fast_trainer(max_epochs=2)
    trainer.fit(BoringModel(), regression_loader())
    assert trainer.global_step == 8
    trainer.fit(BoringModel(), regression_loader())
    assert trainer.global_step == 8 and trainer.current_epoch == 2


# ---------------------------------------------------------------------- trainer and module state
def test_trainer_properties_after_construction():
    trainer = fast_trainer(max_epochs=3)
    assert isinstance(trainer.strategy, SingleDeviceStrategy)
    assert (trainer.global_rank, trainer.local_rank, trainer.world_size) == (0, 0, 1)
    assert trainer.is_global_zero is True
    assert (trainer.current_epoch, trainer.global_step, trainer.should_stop) == (0, 0, False)
    assert trainer.lightning_module is None and trainer.optimizers == []
    assert trainer.state == "initializing" and not trainer.training


def test_trainer_and_module_state_during_fit():
    seen = {}

    class Peek(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.setdefault("steps", []).append(
                (trainer.current_epoch, module.current_epoch, trainer.global_step, module.global_step)
            )
            seen["training"] = trainer.training
            seen["state"] = (trainer.state.activity, trainer.state.fn, trainer.state.stage)  # (a live object)
            seen["module_trainer"] = module.trainer is trainer
            seen["lightning_module"] = trainer.lightning_module is module
            seen["device"] = module.device
            seen["rank"] = module.global_rank

        def on_sanity_check_start(self, trainer, module):
            seen["sanity_training"] = trainer.training

    trainer = fast_trainer(max_epochs=2, callbacks=[Peek()], num_sanity_val_steps=1)
    module = BoringModel()
    trainer.fit(module, regression_loader(n=16), regression_loader(n=8))
    # As Lightning 2.6.6: global_step already counts this batch's step in on_train_batch_end.
    assert seen["steps"] == [(0, 0, 1, 1), (0, 0, 2, 2), (1, 1, 3, 3), (1, 1, 4, 4)]
    assert seen["training"] is True and seen["sanity_training"] is False
    assert seen["state"] == ("fitting", "fit", "train")
    assert seen["module_trainer"] and seen["lightning_module"]
    assert seen["device"] == torch.device("cpu") and seen["rank"] == 0
    assert trainer.state == "finished"
    assert trainer.estimated_stepping_batches == 4
    assert trainer.num_training_batches == 2 and trainer.num_val_batches == [1]


def test_estimated_stepping_batches():
    trainer = fast_trainer(max_epochs=3, accumulate_grad_batches=3)
    trainer.fit(BoringModel(), regression_loader(n=40))  # 5 batches -> 2 steps per epoch
    assert trainer.estimated_stepping_batches == 6 == trainer.global_step
    trainer = fast_trainer(max_epochs=3, max_steps=4)
    trainer.fit(BoringModel(), regression_loader(n=40))
    assert trainer.estimated_stepping_batches == 4
    trainer = fast_trainer(max_epochs=-1, max_steps=-1)
    assert trainer.estimated_stepping_batches == math.inf


def test_module_state_outside_a_trainer():
    module = BoringModel()
    assert module.current_epoch == 0 and module.global_step == 0 and module.global_rank == 0
    with pytest.raises(RuntimeError, match=r"BoringModel is not attached to a Trainer. Call trainer.fit\(module"):
        _ = module.trainer


def test_fit_with_a_loader_without_length():
    from tests.helpers.models import UnsizedBatches

    trainer = fast_trainer(max_epochs=2)
    trainer.fit(BoringModel(), UnsizedBatches(n=24), UnsizedBatches(n=16))
    assert trainer.global_step == 6 and trainer.num_training_batches == math.inf
    assert "val_loss" in trainer.callback_metrics


def test_training_step_may_return_a_dict_with_loss():
    outputs = []

    class DictOut(TrainOnlyModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return {"loss": loss, "extra": 1}

        def on_train_batch_end(self, out, batch, batch_idx):
            outputs.append(sorted(out))

    trainer = fast_trainer()
    trainer.fit(DictOut(), regression_loader())
    assert trainer.global_step == 4 and outputs[0] == ["extra", "loss"]


def test_seed_everything(monkeypatch):
    monkeypatch.delenv("EMBER_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("EMBER_SEED_WORKERS", raising=False)
    import os
    import random

    assert ember.seed_everything(42) == 42
    a = (random.random(), torch.rand(3))
    ember.seed_everything(42)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    assert os.environ["EMBER_GLOBAL_SEED"] == "42" and os.environ["EMBER_SEED_WORKERS"] == "0"
    ember.seed_everything(7, workers=True)
    assert os.environ["EMBER_SEED_WORKERS"] == "1"
    monkeypatch.setenv("EMBER_GLOBAL_SEED", "5")
    assert ember.seed_everything() == 5
    try:
        import numpy as np
    except ImportError:
        return
    ember.seed_everything(1)
    x = np.random.rand()
    ember.seed_everything(1)
    assert np.random.rand() == x


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "1"])
def test_seed_everything_bad_seed(bad):
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32\)"):
        ember.seed_everything(bad)


class _Trusted:
    """An object a trusted checkpoint carries pickled (a user's own class)."""


def test_fit_validate_test_predict_take_lightnings_model_and_weights_only(tmp_path):
    from ember.checkpoint import CheckpointError

    t = ember.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, default_root_dir=str(tmp_path))
    t.fit(model=BoringModel(), train_dataloaders=regression_loader())  # Lightning's keyword
    t.fit(module=BoringModel(), train_dataloaders=regression_loader())  # ember's, still
    with pytest.raises(TypeError, match="both model= and module="):
        t.fit(BoringModel(), regression_loader(), module=BoringModel())
    with pytest.raises(TypeError, match="needs the module to train"):
        t.fit()
    assert t.validate(model=t.module, dataloaders=regression_loader(), verbose=False)
    path = str(tmp_path / "trusted.ckpt")
    checkpoint = torch.load(t.checkpoint_callback.last_model_path, weights_only=True)
    checkpoint["mine"] = _Trusted()  # not plain data: only weights_only=False reads it
    torch.save(checkpoint, path)
    with pytest.raises(CheckpointError, match="weights_only=False"):
        t.test(BoringModel(), regression_loader(), ckpt_path=path, verbose=False)
    for entry in ("fit", "validate", "test", "predict"):
        loaders = {"train_dataloaders" if entry == "fit" else "dataloaders": regression_loader()}
        trainer = ember.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_checkpointing=False)
        getattr(trainer, entry)(model=BoringModel(), ckpt_path=path, weights_only=False, **loaders)
        assert trainer.ckpt_path == path
