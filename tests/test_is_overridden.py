"""ember.utils.is_overridden (what a run decides, as Lightning) and defines_hook (which hooks it calls).

A hook set to None on the instance is "not overridden" for both (as in Lightning): the Trainer neither
calls it nor decides anything from it. They differ on a wrapper of the default: Lightning's decisions
look through it, and Lightning calls every hook, so the Trainer must call it.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

import ember
from ember.callbacks import Callback
from ember.utils import defines_hook, is_overridden
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


class _Prepared(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def prepare_data(self) -> None:
        self.calls.append("prepare_data")

    def configure_model(self) -> None:
        self.calls.append("configure_model")


def test_none_a_subclass_a_partial_a_mock_and_the_default():
    module = _Prepared()
    assert is_overridden("prepare_data", module, ember.TrainModule)
    assert not is_overridden("on_fit_start", module, ember.TrainModule)
    module.prepare_data = None
    assert not is_overridden("prepare_data", module, ember.TrainModule)
    # A partial is looked through: the base's own code bound by hand is still the default.
    module.on_fit_start = functools.partial(ember.TrainModule.on_fit_start, module)
    assert not is_overridden("on_fit_start", module, ember.TrainModule)
    assert not defines_hook("on_fit_start", module, ember.TrainModule)
    module.on_fit_start = mock.Mock()
    assert not is_overridden("on_fit_start", module, ember.TrainModule)  # a bare Mock wraps nothing
    assert defines_hook("on_fit_start", module, ember.TrainModule)  # but calling it is observable
    module.on_fit_start = mock.Mock(wraps=ember.TrainModule.on_fit_start)  # a wrapper of the default
    assert not is_overridden("on_fit_start", module, ember.TrainModule)
    module.prepare_data = functools.partial(_Prepared.prepare_data, module)
    assert is_overridden("prepare_data", module, ember.TrainModule)
    assert not is_overridden("prepare_data", None, ember.TrainModule)
    cb = Callback()
    assert not is_overridden("on_train_end", cb, Callback)
    cb.on_train_end = lambda trainer, module: None
    assert is_overridden("on_train_end", cb, Callback)
    cb.on_train_end = None
    assert not is_overridden("on_train_end", cb, Callback) and not defines_hook("on_train_end", cb, Callback)


def test_prepare_data_and_configure_model_set_to_none_are_not_called():
    module = _Prepared()
    fast_trainer(max_epochs=1, limit_train_batches=1).fit(module, regression_loader())
    assert module.calls == ["prepare_data", "configure_model"]
    module = _Prepared()
    module.prepare_data = None
    module.configure_model = None
    fast_trainer(max_epochs=1, limit_train_batches=1).fit(module, regression_loader())
    assert module.calls == []


def test_a_callbacks_checkpoint_hooks_set_to_none_are_off(tmp_path):
    saved = []

    class Saving(Callback):
        def on_save_checkpoint(self, trainer, module, checkpoint):
            saved.append(trainer.global_step)

    on, off = Saving(), Saving()
    off.on_save_checkpoint = None
    trainer = fast_trainer(max_epochs=1, limit_train_batches=2, callbacks=[on, off])
    trainer.fit(BoringModel(), regression_loader())
    trainer.save_checkpoint(str(tmp_path / "a.ckpt"))
    assert saved == [2]  # the callback's own hook ran once; the one set to None was skipped, not called


def test_a_validation_step_set_to_none_turns_validation_off():
    seen = []

    class Watch(Callback):
        def on_train_start(self, trainer, module):
            seen.append(trainer.enable_validation)

    module = BoringModel()
    fast_trainer(max_epochs=1, limit_train_batches=1, callbacks=[Watch()]).fit(
        module, regression_loader(), regression_loader()
    )
    module = BoringModel()
    module.validation_step = None
    trainer = fast_trainer(max_epochs=1, limit_train_batches=1, callbacks=[Watch()])
    trainer.fit(module, regression_loader(), regression_loader())
    assert seen == [True, False]
    assert "val_loss" not in trainer.callback_metrics and "train_loss" in trainer.callback_metrics


def test_an_lr_scheduler_step_set_to_none_leaves_stepping_to_the_trainer():
    class Stepping(BoringModel):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]

        def lr_scheduler_step(self, scheduler, metric):
            raise AssertionError("set to None on the instance: must not be called")

    module = Stepping()
    module.lr_scheduler_step = None
    trainer = fast_trainer(max_epochs=2, limit_train_batches=1)
    trainer.fit(module, regression_loader())
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.25)
