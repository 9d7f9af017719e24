"""Hook order: a recording callback and module, compared with the expected sequence (Lightning's order)."""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

import ember
from ember.callbacks import Callback
from tests.helpers.models import RecordingCallback, RecordingModule, fast_trainer, regression_loader


def both(*names: str) -> list[str]:
    """Each hook as the trainer calls it: callbacks first, then the module."""
    out = []
    for n in names:
        out += [f"Callback.{n}", f"Module.{n}"]
    return out


def validation_block(steps: int = 1) -> list[str]:
    batch = both("on_validation_batch_start") + ["Module.validation_step"] + both("on_validation_batch_end")
    return (
        both("on_validation_start", "on_validation_epoch_start")
        + batch * steps
        + both("on_validation_epoch_end", "on_validation_end")
    )


def train_batch() -> list[str]:
    return (
        both("on_train_batch_start")
        + ["Module.training_step"]
        + both(
            "on_before_zero_grad",
            "on_before_backward",
            "on_after_backward",
            "on_before_optimizer_step",
            "on_train_batch_end",
        )
    )


def _run(**trainer_kwargs):
    calls: list[str] = []
    module = RecordingModule(calls)
    trainer = fast_trainer(callbacks=[RecordingCallback(calls)], **trainer_kwargs)
    return calls, module, trainer


def test_fit_hook_order_with_validation_and_sanity_check():
    calls, module, trainer = _run(max_epochs=2, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=1)
    trainer.fit(module, regression_loader(), regression_loader())
    epoch = both("on_train_epoch_start") + train_batch() * 2 + validation_block() + both("on_train_epoch_end")
    expected = (
        [
            "Module.configure_callbacks",
            "Module.prepare_data",
            "Callback.setup:fit",
            "Module.setup:fit",
            "Module.configure_optimizers",
        ]
        + both("on_fit_start")
        + ["Callback.on_sanity_check_start"]
        + validation_block()
        + ["Callback.on_sanity_check_end"]
        + both("on_train_start")
        + epoch * 2
        + both("on_train_end", "on_fit_end")
        + ["Callback.teardown:fit", "Module.teardown:fit"]
    )
    assert calls == expected


def test_fit_hook_order_without_validation_has_no_sanity_check():
    calls, module, trainer = _run(max_epochs=1, limit_train_batches=1)
    trainer.fit(module, regression_loader())
    assert "Callback.on_sanity_check_start" not in calls
    start = calls.index("Callback.on_train_start")
    assert calls[start:] == (
        both("on_train_start", "on_train_epoch_start")
        + train_batch()
        + both("on_train_epoch_end", "on_train_end", "on_fit_end")
        + ["Callback.teardown:fit", "Module.teardown:fit"]
    )


def test_accumulation_zero_grad_first_and_optimizer_step_last_in_window():
    calls, module, trainer = _run(limit_train_batches=3, accumulate_grad_batches=2)
    trainer.fit(module, regression_loader())
    start = calls.index("Module.on_train_epoch_start") + 1
    end = calls.index("Callback.on_train_epoch_end")
    head = both("on_train_batch_start") + ["Module.training_step"]
    backward = both("on_before_backward", "on_after_backward")
    expected = (
        head
        + both("on_before_zero_grad")
        + backward
        + both("on_train_batch_end")  # opens window
        + head
        + backward
        + both("on_before_optimizer_step", "on_train_batch_end")  # closes it
        + head
        + both("on_before_zero_grad")
        + backward
        + both("on_before_optimizer_step", "on_train_batch_end")  # short window
    )
    assert calls[start:end] == expected


def test_validate_hook_order():
    calls, module, trainer = _run(limit_val_batches=2)
    trainer.validate(module, regression_loader())
    assert calls == (
        ["Module.configure_callbacks", "Module.prepare_data", "Callback.setup:validate", "Module.setup:validate"]
        + validation_block(2)
        + ["Callback.teardown:validate", "Module.teardown:validate"]
    )


def test_test_hook_order():
    calls, module, trainer = _run(limit_test_batches=2)
    trainer.test(module, regression_loader())
    batch = both("on_test_batch_start") + ["Module.test_step"] + both("on_test_batch_end")
    assert calls == (
        ["Module.configure_callbacks", "Module.prepare_data", "Callback.setup:test", "Module.setup:test"]
        + both("on_test_start", "on_test_epoch_start")
        + batch * 2
        + both("on_test_epoch_end", "on_test_end")
        + ["Callback.teardown:test", "Module.teardown:test"]
    )


def test_predict_hook_order():
    calls, module, trainer = _run(limit_predict_batches=2)
    trainer.predict(module, regression_loader())
    batch = both("on_predict_batch_start") + ["Module.predict_step"] + both("on_predict_batch_end")
    assert calls == (
        ["Module.configure_callbacks", "Module.prepare_data", "Callback.setup:predict", "Module.setup:predict"]
        + both("on_predict_start", "on_predict_epoch_start")
        + batch * 2
        + both("on_predict_epoch_end", "on_predict_end")
        + ["Callback.teardown:predict", "Module.teardown:predict"]
    )


def test_callbacks_run_in_the_order_given():
    calls: list[str] = []

    class Named(Callback):
        def __init__(self, name):
            self.name = name

        def on_train_epoch_start(self, trainer, module):
            calls.append(self.name)

    trainer = fast_trainer(callbacks=[Named("a"), Named("b"), Named("c")], limit_train_batches=1)
    trainer.fit(RecordingModule(), regression_loader())
    assert calls == ["a", "b", "c"]


def test_monitoring_callbacks_run_after_the_module_at_epoch_end():
    calls: list[str] = []

    class Monitor(Callback):
        monitors_metrics = True

        def on_train_epoch_end(self, trainer, module):
            calls.append(f"monitor sees {sorted(trainer.callback_metrics)}")

    class Plain(Callback):
        def on_train_epoch_end(self, trainer, module):
            calls.append("plain")

    class Module(RecordingModule):
        def on_train_epoch_end(self):
            calls.append("module")
            self.log("epoch_metric", 1.0)

    trainer = fast_trainer(callbacks=[Monitor(), Plain()], limit_train_batches=1)
    trainer.fit(Module(), regression_loader())
    # The monitor comes last and already sees the metric the module logged at epoch end.
    assert calls == ["plain", "module", "monitor sees ['epoch_metric', 'train_loss']"]


def test_only_overriding_callbacks_are_dispatched():
    class Nothing(Callback):
        pass

    class EpochOnly(Callback):
        def on_train_epoch_start(self, trainer, module):
            pass

    trainer = fast_trainer(callbacks=[Nothing(), EpochOnly()], limit_train_batches=1)
    trainer.fit(_Plain(), regression_loader())
    assert trainer._hooks.get("on_train_batch_end") == []
    assert len(trainer._hooks.get("on_train_epoch_start")) == 1


class _Plain(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_on_train_batch_start_returning_minus_one_ends_the_epoch():
    seen = []

    class Stop(_Plain):
        def on_train_batch_start(self, batch, batch_idx):
            seen.append(batch_idx)
            return -1 if batch_idx == 1 else None

    trainer = fast_trainer(max_epochs=2)
    trainer.fit(Stop(), regression_loader(n=32, batch_size=8))
    assert seen == [0, 1, 0, 1]
    assert trainer.global_step == 2


def test_on_exception_is_called_and_the_error_propagates():
    seen = []

    class Catch(Callback):
        def on_exception(self, trainer, module, exception):
            seen.append(exception)

    class Boom(_Plain):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fast_trainer(callbacks=[Catch()]).fit(Boom(), regression_loader())
    assert len(seen) == 1 and str(seen[0]) == "boom"


def test_a_step_set_to_none_on_the_instance_switches_its_loop_off():
    calls, module, trainer = _run(max_epochs=1, limit_train_batches=1, limit_val_batches=1)
    module.validation_step = None  # Lightning's idiom for "no validation"
    trainer.fit(module, regression_loader(), regression_loader())
    assert "Module.validation_step" not in calls
    assert "Callback.on_validation_start" not in calls and "Callback.on_sanity_check_start" not in calls
    assert trainer.global_step == 1


def test_a_hook_set_to_none_on_the_instance_is_not_called():
    calls, module, trainer = _run(max_epochs=1, limit_train_batches=1, limit_val_batches=1)
    module.on_train_epoch_start = None
    module.on_validation_model_train = None  # the default (modes restored) runs instead
    trainer.fit(module, regression_loader(), regression_loader())
    assert "Callback.on_train_epoch_start" in calls and "Module.on_train_epoch_start" not in calls
    assert module.training


def test_a_hook_set_on_the_instance_or_on_a_callback_instance_is_called():
    calls, module, trainer = _run(max_epochs=1, limit_train_batches=1)
    module.on_train_epoch_start = lambda: calls.append("instance hook")
    plain = Callback()
    plain.on_train_end = lambda trainer, module: calls.append("callback instance hook")
    trainer.callbacks.append(plain)
    trainer.fit(module, regression_loader())
    assert "instance hook" in calls and "callback instance hook" in calls


def test_defines_hook_looks_at_the_instance():
    from ember.utils import defines_hook

    module = RecordingModule()
    assert defines_hook("on_train_start", module, ember.TrainModule)
    assert not defines_hook("on_before_batch_transfer", module, ember.TrainModule)
    module.on_train_start = None
    assert not defines_hook("on_train_start", module, ember.TrainModule)
    module.on_before_batch_transfer = functools.partial(ember.TrainModule.on_before_batch_transfer, module)
    assert not defines_hook("on_before_batch_transfer", module, ember.TrainModule)  # the base's own code
    module.on_before_batch_transfer = mock.Mock()
    assert defines_hook("on_before_batch_transfer", module, ember.TrainModule)

    @functools.wraps(ember.TrainModule.on_before_batch_transfer)
    def wrapper(batch, dataloader_idx):
        return batch

    module.on_before_batch_transfer = wrapper  # a wrapper of the default still has to be called
    assert defines_hook("on_before_batch_transfer", module, ember.TrainModule)


@pytest.mark.parametrize("stage", ["fit", "validate", "test", "predict"])
def test_every_stage_starts_with_module_zero_grad(stage):
    """As Lightning's ``_run_stage``: gradients left on the module (by a previous run, or by hand) are gone."""
    calls, module, trainer = _run(
        limit_train_batches=1,
        limit_val_batches=1,
        limit_test_batches=1,
        limit_predict_batches=1,
        num_sanity_val_steps=0,
    )
    seen = []
    module.zero_grad = lambda set_to_none=True: (
        calls.append("Module.zero_grad"),
        torch.nn.Module.zero_grad(module, set_to_none),
    )
    module.on_fit_start = lambda: calls.append("Module.on_fit_start")
    first_hook = {
        "fit": "Module.on_train_start",
        "validate": "Module.on_validation_start",
        "test": "Module.on_test_start",
        "predict": "Module.on_predict_start",
    }[stage]
    module.layer.weight.grad = torch.ones_like(module.layer.weight)
    record = getattr(module, first_hook.split(".")[1])
    module.__dict__[first_hook.split(".")[1]] = lambda: (seen.append(module.layer.weight.grad), record())
    loader = regression_loader()
    getattr(trainer, stage)(module, loader)
    assert seen == [None]  # the stale gradient was freed before the stage began
    zero = calls.index("Module.zero_grad")
    if stage == "fit":
        assert calls.index("Module.on_fit_start") < zero < calls.index("Module.on_train_start")
    else:
        assert calls.index(f"Module.setup:{stage}") < zero < calls.index(first_hook)
