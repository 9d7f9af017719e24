"""Batch-end outputs, logging from epoch hooks, fresh metrics per entry point, validation on an early stop."""

from __future__ import annotations

import torch

from ember.callbacks import Callback
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


def test_train_batch_end_sees_a_dict_with_a_detached_loss():
    seen = []

    class Peek(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(outputs)

    fast_trainer(callbacks=[Peek()]).fit(BoringModel(), regression_loader())
    assert len(seen) == 4
    for out in seen:
        assert set(out) == {"loss"}
        assert isinstance(out["loss"], torch.Tensor) and not out["loss"].requires_grad


def test_log_in_epoch_hooks_defaults_to_epoch_values():
    class EpochLogger(BoringModel):
        def on_train_epoch_end(self):
            self.log("epoch_marker", float(self.current_epoch))

    trainer = fast_trainer(max_epochs=2)
    trainer.fit(EpochLogger(), regression_loader())
    assert float(trainer.callback_metrics["epoch_marker"]) == 1.0
    assert [row["epoch_marker"] for row in trainer.history] == [0.0, 1.0]


def test_each_entry_point_starts_from_empty_metrics():
    trainer = fast_trainer()
    module = BoringModel()
    trainer.fit(module, regression_loader())
    assert "train_loss" in trainer.callback_metrics
    trainer.test(module, regression_loader())
    assert set(trainer.callback_metrics) == {"test_loss"}


def test_max_steps_mid_epoch_still_validates_the_final_weights():
    trainer = fast_trainer(max_epochs=5, max_steps=2, num_sanity_val_steps=0)
    module = BoringModel()
    trainer.fit(module, regression_loader(), regression_loader(n=16))
    assert trainer.global_step == 2
    after_fit = float(trainer.callback_metrics["val_loss"])
    # Validating the final weights again gives the value fit ended with: it validated after step 2.
    assert abs(trainer.validate(module, regression_loader(n=16))[0]["val_loss"] - after_fit) < 1e-6


def test_early_stop_mid_epoch_validates_once():
    calls = []

    class Count(Callback):
        def on_validation_end(self, trainer, module):
            calls.append(trainer.global_step)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 1:
                trainer.should_stop = True

    fast_trainer(max_epochs=3, num_sanity_val_steps=0, callbacks=[Count()]).fit(
        BoringModel(), regression_loader(), regression_loader(n=16)
    )
    assert calls == [2]


def test_outputs_dict_is_built_only_when_a_hook_may_read_it():
    seen = []

    class Raw(Callback):
        uses_step_outputs = False  # declares it ignores outputs

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(outputs)

    fast_trainer(callbacks=[Raw()]).fit(BoringModel(), regression_loader())
    assert all(isinstance(o, torch.Tensor) for o in seen)  # what training_step returned, untouched

    seen.clear()
    fast_trainer(callbacks=[Raw(), Callback()]).fit(BoringModel(), regression_loader())
    assert all(isinstance(o, torch.Tensor) for o in seen)  # Callback() overrides no hook

    class Reads(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            pass

    seen.clear()
    fast_trainer(callbacks=[Raw(), Reads()]).fit(BoringModel(), regression_loader())
    assert all(set(o) == {"loss"} for o in seen)  # one hook may read them: everyone gets the dict
