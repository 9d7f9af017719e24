"""LambdaCallback: functions run at their hooks with Lightning's arguments; a misspelt hook is an error."""

from __future__ import annotations

import pytest

import ember
from ember.callbacks import Callback, LambdaCallback, ModelCheckpoint
from ember.callbacks.callback import HOOKS
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


def test_each_given_function_runs_at_its_hook_with_the_hook_arguments(tmp_path):
    calls: list[tuple] = []
    cb = LambdaCallback(
        setup=lambda trainer, module, stage: calls.append(("setup", stage)),
        on_train_epoch_end=lambda trainer, module: calls.append(("epoch_end", trainer.current_epoch)),
        on_train_batch_end=lambda trainer, module, outputs, batch, batch_idx: calls.append(
            ("batch_end", batch_idx, float(outputs["loss"]) > 0)
        ),
        on_save_checkpoint=lambda trainer, module, checkpoint: checkpoint.__setitem__("mine", 7),
        on_load_checkpoint=lambda trainer, module, checkpoint: calls.append(("loaded", checkpoint["mine"])),
        on_fit_end=None,  # None: no function there, as Lightning
    )
    ckpt = ModelCheckpoint(dirpath=str(tmp_path))
    trainer = fast_trainer(
        max_epochs=2, callbacks=[cb, ckpt], enable_checkpointing=True, logger=True, default_root_dir=str(tmp_path)
    )
    trainer.fit(BoringModel(), regression_loader(n=16, batch_size=8))
    assert calls == [
        ("setup", "fit"),
        ("batch_end", 0, True),
        ("batch_end", 1, True),
        ("epoch_end", 0),
        ("batch_end", 0, True),
        ("batch_end", 1, True),
        ("epoch_end", 1),
    ]
    calls.clear()
    fast_trainer(max_epochs=3, callbacks=[cb]).fit(
        BoringModel(), regression_loader(n=16, batch_size=8), ckpt_path=ckpt.last_model_path
    )
    assert calls[:2] == [("setup", "fit"), ("loaded", 7)]


def test_hooks_not_given_cost_nothing_and_a_plain_callback_attribute_counts_too():
    cb = LambdaCallback(on_train_end=lambda trainer, module: None)
    assert "on_train_end" in vars(cb) and "on_train_start" not in vars(cb)
    ran: list[int] = []
    plain = Callback()
    plain.on_train_start = lambda trainer, module: ran.append(trainer.global_step)  # as Lightning allows
    fast_trainer(callbacks=[plain]).fit(BoringModel(), regression_loader(n=8))
    assert ran == [0]


def test_a_misspelt_hook_or_a_value_that_is_not_a_function_is_an_error():
    with pytest.raises(TypeError, match="on_train_epoch_ends"):
        LambdaCallback(on_train_epoch_ends=lambda t, m: None)
    with pytest.raises(TypeError, match="must be a function"):
        LambdaCallback(on_fit_start=3)
    LambdaCallback(**{name: (lambda *a: None) for name in HOOKS})  # every hook is accepted
    assert ember.callbacks.LambdaCallback is LambdaCallback
