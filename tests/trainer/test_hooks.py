"""Hook order: every hook, in Lightning's order, with Lightning's arguments; and how hooks are dispatched.

The expected sequences in the first part were checked against PyTorch Lightning 2.6.6, recording the
same module (tests/helpers/hook_recorder.py, ``C.`` callback, ``M.`` module) and callback in the same
scenarios. Where ember's sequence still differs from Lightning's, a comment at the expectation says how.
The second part records with tests/helpers/models.py (``Callback.``/``Module.``) and checks dispatch:
callback order, which callbacks are called, hooks switched off or set on an instance, early ends.
"""

from __future__ import annotations

import functools
from typing import Any
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint
from tests.helpers.hook_recorder import HookModule, RecordingHookModule, trainer
from tests.helpers.models import RecordingCallback, RecordingModule, fast_trainer, regression_loader

CLIP = "(gradient_clip_val=,gradient_clip_algorithm=)"


def both(name: str, args: str = "") -> list[str]:
    """A hook as the trainer calls it: the callback first, then the module."""
    return [f"C.{name}{args}", f"M.{name}{args}"]


def transfer() -> list[str]:
    return ["M.on_before_batch_transfer(0)", "M.transfer_batch_to_device(0)", "M.on_after_batch_transfer(0)"]


def start(stage: str) -> list[str]:
    return [
        "M.configure_callbacks",
        "M.prepare_data",
        f"C.setup(stage='{stage}')",
        f"M.setup(stage='{stage}')",
        "M.configure_model",
    ]


def end(stage: str) -> list[str]:
    return [f"C.teardown(stage='{stage}')", f"M.teardown(stage='{stage}')"]


def eval_block(hook: str, batches: int, model_train: bool = True) -> list[str]:
    out = [f"M.on_{hook}_model_eval"] + both(f"on_{hook}_start") + both(f"on_{hook}_epoch_start")
    for i in range(batches):
        out += transfer() + both(f"on_{hook}_batch_start", f"({i})") + [f"M.{hook}_step({i})"]
        out += both(f"on_{hook}_batch_end", f"({i})")
    out += both(f"on_{hook}_epoch_end") + both(f"on_{hook}_end")
    return out + ([f"M.on_{hook}_model_train"] if model_train else [])


def train_batch(
    epoch: int, i: int, *, zero_grad: bool = True, step: bool = True, epoch_sched: bool = False
) -> list[str]:
    out = transfer() + both("on_train_batch_start", f"({i})")
    out += ([f"M.optimizer_step({epoch},{i})"] if step else []) + [f"M.training_step({i})"]
    if zero_grad:
        out += both("on_before_zero_grad") + [f"M.optimizer_zero_grad({epoch},{i})"]
    out += both("on_before_backward") + ["M.backward"] + both("on_after_backward")
    if step:
        out += both("on_before_optimizer_step") + [f"M.configure_gradient_clipping{CLIP}", f"M.clip_gradients{CLIP}"]
    if epoch_sched:  # an epoch-interval scheduler steps after the epoch's last batch, before on_train_batch_end
        out += ["M.lr_scheduler_step"]
    return out + both("on_train_batch_end", f"({i})")


def epoch(e: int, batches: int = 2, val: int = 2) -> list[str]:
    out = both("on_train_epoch_start")
    for i in range(batches):
        out += train_batch(e, i, epoch_sched=i == batches - 1)
    if val:
        out += ["M.on_validation_model_zero_grad"] + eval_block("validation", val)
    return out + both("on_train_epoch_end")


def record(scenario: Any, **kwargs: Any) -> list[str]:
    calls: list[str] = []
    torch.manual_seed(0)
    scenario(calls, **kwargs)
    return calls


# ------------------------------------------------------------------------------------ sequences
def test_fit_sequence():
    calls = record(lambda c: trainer(c).fit(RecordingHookModule(c)))
    expected = (
        start("fit")
        + ["M.configure_optimizers"]
        + both("on_fit_start")
        # As Lightning: val_dataloader is requested inside the sanity check, train_dataloader after it.
        + ["C.on_sanity_check_start", "M.val_dataloader"]
        + eval_block("validation", 1)
        + ["C.on_sanity_check_end", "M.train_dataloader"]
        + both("on_train_start")
        + epoch(0)
        + epoch(1)
        + both("on_train_end")
        + both("on_fit_end")
        + end("fit")
    )
    assert calls == expected


def test_validate_sequence():
    calls = record(lambda c: trainer(c).validate(RecordingHookModule(c)))
    assert calls == start("validate") + ["M.val_dataloader"] + eval_block("validation", 2) + end("validate")


def test_test_sequence():
    calls = record(lambda c: trainer(c).test(RecordingHookModule(c)))
    assert calls == start("test") + ["M.test_dataloader"] + eval_block("test", 2) + end("test")


def test_predict_sequence():
    calls = record(lambda c: trainer(c).predict(RecordingHookModule(c)))
    # Lightning has no on_predict_model_train: predict restores the training flags itself.
    assert calls == start("predict") + ["M.predict_dataloader"] + eval_block("predict", 2, model_train=False) + end(
        "predict"
    )


def test_validate_without_batches_runs_no_loop_hook():
    calls = record(lambda c: trainer(c).validate(RecordingHookModule(c, n_val=0)))
    assert calls == start("validate") + ["M.val_dataloader"] + end("validate")


def test_accumulation_sequence():
    calls = record(
        lambda c: trainer(
            c,
            max_epochs=1,
            limit_train_batches=3,
            accumulate_grad_batches=2,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        ).fit(RecordingHookModule(c))
    )
    expected = (
        start("fit")
        + ["M.configure_optimizers"]
        + both("on_fit_start")
        + ["M.train_dataloader"]
        + both("on_train_start")
        + both("on_train_epoch_start")
        + train_batch(0, 0, step=False)  # opens the window: zero_grad, no step
        + train_batch(0, 1, zero_grad=False)  # closes it: optimizer_step, no zero_grad
        + train_batch(0, 2, epoch_sched=True)  # a short last window: both
        + both("on_train_epoch_end")
        + both("on_train_end")
        + both("on_fit_end")
        + end("fit")
    )
    assert calls == expected


def test_manual_optimization_sequence():
    calls = record(
        lambda c: trainer(c, max_epochs=1, num_sanity_val_steps=0, limit_val_batches=0).fit(
            RecordingHookModule(c, manual=True)
        )
    )

    def batch(i: int) -> list[str]:
        return (
            transfer()
            + both("on_train_batch_start", f"({i})")
            + [f"M.training_step({i})"]
            + both("on_before_backward")
            + ["M.backward"]
            + both("on_after_backward")
            + both("on_before_optimizer_step") * 2  # once per opt.step() (the module steps twice)
            + both("on_train_batch_end", f"({i})")
        )

    expected = (
        start("fit")
        + ["M.configure_optimizers"]
        + both("on_fit_start")
        + ["M.train_dataloader"]
        + both("on_train_start")
        + both("on_train_epoch_start")
        + batch(0)
        + batch(1)
        + both("on_train_epoch_end")
        + both("on_train_end")
        + both("on_fit_end")
        + end("fit")
    )
    assert calls == expected


class _SaveAtStep(Callback):
    def __init__(self, path: str, after_step: int) -> None:
        self.path, self.after_step = path, after_step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.after_step:  # global_step already counts this batch's step (as Lightning)
            trainer.save_checkpoint(self.path)


def test_mid_epoch_resume_sequence(tmp_path):
    path = str(tmp_path / "mid.ckpt")
    trainer([], callbacks=[_SaveAtStep(path, 3)], num_sanity_val_steps=0).fit(HookModule([]))  # epoch 1, batch 0 done
    calls = record(lambda c: trainer(c, num_sanity_val_steps=0).fit(RecordingHookModule(c), ckpt_path=path))
    expected = (
        # As Lightning: the weights and the callbacks' state before configure_optimizers; the optimizers
        # and progress after on_fit_start; the loaders after them.
        start("fit")
        + ["M.on_load_checkpoint", "M.load_state_dict(strict=)", "C.on_load_checkpoint"]
        + ["M.configure_optimizers"]
        + both("on_fit_start")
        + ["M.train_dataloader", "M.val_dataloader"]
        + both("on_train_start")
        # no on_train_epoch_start: the epoch had started before the checkpoint
        + train_batch(1, 1, epoch_sched=True)
        + ["M.on_validation_model_zero_grad"]
        + eval_block("validation", 2)
        + both("on_train_epoch_end")
        + both("on_train_end")
        + both("on_fit_end")
        + end("fit")
    )
    assert calls == expected


# ------------------------------------------------------------------------------------ order points
class _CheckpointRecorder(ModelCheckpoint):
    def __init__(self, calls: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls = calls

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.calls.append("CK.on_train_epoch_end")
        super().on_train_epoch_end(trainer, module)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        self.calls.append("CK.on_validation_end")
        super().on_validation_end(trainer, module)


def test_model_checkpoint_saves_after_on_train_epoch_end_with_the_scheduler_stepped(tmp_path):
    calls: list[str] = []
    saved: list[int] = []

    class Module(RecordingHookModule):
        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.calls.append("M.on_save_checkpoint")
            saved.append(checkpoint["lr_schedulers"][0]["last_epoch"])

    ck = _CheckpointRecorder(calls, dirpath=str(tmp_path), save_last=False, monitor="val_loss")
    trainer(calls, max_epochs=1, num_sanity_val_steps=0, callbacks=[ck], enable_checkpointing=True).fit(Module(calls))
    relevant = [
        c
        for c in calls
        if c.startswith("CK.")
        or c in ("M.on_train_epoch_end", "M.on_save_checkpoint", "M.lr_scheduler_step", "M.on_validation_end")
    ]
    assert relevant == [
        "M.lr_scheduler_step",
        "CK.on_validation_end",
        "M.on_validation_end",
        "M.on_train_epoch_end",
        "CK.on_train_epoch_end",
        "M.on_save_checkpoint",
    ]
    assert saved == [1]  # the epoch's scheduler step is in the checkpoint


def test_batch_hooks_without_dataloader_idx_work_with_one_loader_and_get_it_with_several():
    seen: list[tuple[Any, ...]] = []

    class Module(HookModule):
        def on_validation_batch_start(self, batch: Any, batch_idx: int) -> None:  # no dataloader_idx: one loader
            seen.append(("start", batch_idx))

    class Several(HookModule):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
            seen.append(("step", batch_idx, dataloader_idx))

    trainer([], limit_val_batches=1).validate(Module([]))
    assert seen == [("start", 0)]
    seen.clear()
    m = Several([])
    trainer([], limit_val_batches=1).validate(m, [m.val_dataloader(), m.val_dataloader()])
    assert seen == [("step", 0, 0), ("step", 0, 1)]


def test_setup_and_teardown_get_stage_as_a_keyword():
    got: list[str] = []

    class Module(HookModule):
        def setup(self, stage: str | None = None) -> None:
            got.append(f"setup {stage}")

        def teardown(self, stage: str | None = None) -> None:
            got.append(f"teardown {stage}")

    trainer([], max_epochs=1, limit_val_batches=0).fit(Module([]))
    assert got == ["setup fit", "teardown fit"]


def test_validation_step_none_means_no_validation():
    calls: list[str] = []

    class Module(RecordingHookModule):
        validation_step = None

    trainer(calls, max_epochs=1).fit(Module(calls))
    assert "M.val_dataloader" not in calls and not any("validation" in c for c in calls)


def test_evaluation_gives_every_submodule_back_its_own_training_flag():
    class Module(HookModule):
        def __init__(self) -> None:
            super().__init__([])
            self.backbone = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
            self.backbone.eval()  # frozen
            self.flags: list[bool] = []

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.flags.append(self.backbone.training or self.backbone[1].training)

        def on_validation_batch_start(self, batch: Any, batch_idx: int) -> None:
            assert not self.training and not self.layer.training

    m = Module()
    trainer([], max_epochs=2, num_sanity_val_steps=1).fit(m)
    assert m.flags and not any(m.flags)  # the backbone stayed in eval after the sanity check and validation
    assert m.layer.training


def test_datamodule_loaders_are_requested_in_lightnings_order_and_its_state_is_saved(tmp_path):
    calls: list[str] = []

    class Data(ember.DataModule):
        def train_dataloader(self) -> DataLoader:
            calls.append("train_dataloader")
            return DataLoader(TensorDataset(torch.randn(4, 2), torch.randn(4, 1)), batch_size=2)

        def val_dataloader(self) -> DataLoader:
            calls.append("val_dataloader")
            return DataLoader(TensorDataset(torch.randn(2, 2), torch.randn(2, 1)), batch_size=2)

        def state_dict(self) -> dict[str, Any]:
            return {"seen": 7}

    t = trainer([], max_epochs=1)
    t.fit(HookModule([]), datamodule=Data())
    assert calls == ["val_dataloader", "train_dataloader"]  # a sanity check runs: validation first
    calls.clear()
    trainer([], max_epochs=1, num_sanity_val_steps=0).fit(HookModule([]), datamodule=Data())
    assert calls == ["train_dataloader", "val_dataloader"]
    path = str(tmp_path / "x.ckpt")
    t.save_checkpoint(path)
    assert torch.load(path, weights_only=True)[Data.__qualname__] == {"seen": 7}  # Lightning's key


def test_reload_dataloaders_every_n_epochs():
    requested: list[int] = []

    class Module(HookModule):
        def train_dataloader(self) -> DataLoader:
            requested.append(self.current_epoch)
            return super().train_dataloader()

    trainer([], max_epochs=4, limit_val_batches=0, reload_dataloaders_every_n_epochs=2).fit(Module([]))
    assert requested == [0, 2]


# ------------------------------------------------------------------------------------ dispatch
def pair(*names: str) -> list[str]:
    """Each hook as the trainer calls it: callbacks first, then the module."""
    out = []
    for n in names:
        out += [f"Callback.{n}", f"Module.{n}"]
    return out


def validation_block(steps: int = 1) -> list[str]:
    batch = pair("on_validation_batch_start") + ["Module.validation_step"] + pair("on_validation_batch_end")
    return (
        pair("on_validation_start", "on_validation_epoch_start")
        + batch * steps
        + pair("on_validation_epoch_end", "on_validation_end")
    )


def train_batch_hooks() -> list[str]:
    return (
        pair("on_train_batch_start")
        + ["Module.training_step"]
        + pair(
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
    epoch = pair("on_train_epoch_start") + train_batch_hooks() * 2 + validation_block() + pair("on_train_epoch_end")
    expected = (
        [
            "Module.configure_callbacks",
            "Module.prepare_data",
            "Callback.setup:fit",
            "Module.setup:fit",
            "Module.configure_optimizers",
        ]
        + pair("on_fit_start")
        + ["Callback.on_sanity_check_start"]
        + validation_block()
        + ["Callback.on_sanity_check_end"]
        + pair("on_train_start")
        + epoch * 2
        + pair("on_train_end", "on_fit_end")
        + ["Callback.teardown:fit", "Module.teardown:fit"]
    )
    assert calls == expected


def test_fit_hook_order_without_validation_has_no_sanity_check():
    calls, module, trainer = _run(max_epochs=1, limit_train_batches=1)
    trainer.fit(module, regression_loader())
    assert "Callback.on_sanity_check_start" not in calls
    start = calls.index("Callback.on_train_start")
    assert calls[start:] == (
        pair("on_train_start", "on_train_epoch_start")
        + train_batch_hooks()
        + pair("on_train_epoch_end", "on_train_end", "on_fit_end")
        + ["Callback.teardown:fit", "Module.teardown:fit"]
    )


def test_accumulation_zero_grad_first_and_optimizer_step_last_in_window():
    calls, module, trainer = _run(limit_train_batches=3, accumulate_grad_batches=2)
    trainer.fit(module, regression_loader())
    start = calls.index("Module.on_train_epoch_start") + 1
    end = calls.index("Callback.on_train_epoch_end")
    head = pair("on_train_batch_start") + ["Module.training_step"]
    backward = pair("on_before_backward", "on_after_backward")
    expected = (
        head
        + pair("on_before_zero_grad")
        + backward
        + pair("on_train_batch_end")  # opens window
        + head
        + backward
        + pair("on_before_optimizer_step", "on_train_batch_end")  # closes it
        + head
        + pair("on_before_zero_grad")
        + backward
        + pair("on_before_optimizer_step", "on_train_batch_end")  # short window
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
    batch = pair("on_test_batch_start") + ["Module.test_step"] + pair("on_test_batch_end")
    assert calls == (
        ["Module.configure_callbacks", "Module.prepare_data", "Callback.setup:test", "Module.setup:test"]
        + pair("on_test_start", "on_test_epoch_start")
        + batch * 2
        + pair("on_test_epoch_end", "on_test_end")
        + ["Callback.teardown:test", "Module.teardown:test"]
    )


def test_predict_hook_order():
    calls, module, trainer = _run(limit_predict_batches=2)
    trainer.predict(module, regression_loader())
    batch = pair("on_predict_batch_start") + ["Module.predict_step"] + pair("on_predict_batch_end")
    assert calls == (
        ["Module.configure_callbacks", "Module.prepare_data", "Callback.setup:predict", "Module.setup:predict"]
        + pair("on_predict_start", "on_predict_epoch_start")
        + batch * 2
        + pair("on_predict_epoch_end", "on_predict_end")
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
