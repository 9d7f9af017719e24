"""The hook contract: every hook, in Lightning's order, with Lightning's arguments.

The expected sequences below were checked against PyTorch Lightning 2.6.6, recording the same
module (tests/helpers/hook_recorder.py) and callback in the same scenarios. Where ember's sequence
still differs from Lightning's, a comment at the expectation says how.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint
from tests.helpers.hook_recorder import HookModule, RecordingHookModule, trainer

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
    assert torch.load(path, weights_only=True)["datamodule"] == {"seen": 7}


def test_reload_dataloaders_every_n_epochs():
    requested: list[int] = []

    class Module(HookModule):
        def train_dataloader(self) -> DataLoader:
            requested.append(self.current_epoch)
            return super().train_dataloader()

    trainer([], max_epochs=4, limit_val_batches=0, reload_dataloaders_every_n_epochs=2).fit(Module([]))
    assert requested == [0, 2]


# ------------------------------------------------------------------------------------ override points
def _fit(module: HookModule, **kwargs: Any) -> HookModule:
    options = dict(max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0)
    options.update(kwargs)
    torch.manual_seed(0)
    trainer([], **options).fit(module)
    return module


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_optimizer_step_override_can_skip_steps():
    steps: list[int] = []

    class Skips(HookModule):
        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            if batch_idx % 2:
                optimizer_closure()  # forward and backward, no step
            else:
                steps.append(batch_idx)
                optimizer.step(closure=optimizer_closure)

    torch.manual_seed(0)
    plain = HookModule([])
    torch.manual_seed(0)
    skips = Skips([])
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), skips.state_dict().values()))
    _fit(plain, limit_train_batches=4)
    _fit(skips, limit_train_batches=4)
    assert steps == [0, 2]
    assert not torch.equal(plain.layer.weight, skips.layer.weight)


def test_optimizer_step_override_that_only_calls_step_matches_the_default():
    class Same(HookModule):
        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            optimizer.step(closure=optimizer_closure)

    torch.manual_seed(0)
    a = HookModule([])
    b = copy.deepcopy(a)
    b.__class__ = Same
    _fit(a, limit_train_batches=3)
    _fit(b, limit_train_batches=3)
    assert torch.allclose(a.layer.weight, b.layer.weight)


def test_optimizer_zero_grad_override_is_used():
    class Keeps(HookModule):
        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            pass  # gradients accumulate across batches

    torch.manual_seed(0)
    a = HookModule([])
    b = copy.deepcopy(a)
    b.__class__ = Keeps
    _fit(a, limit_train_batches=3)
    _fit(b, limit_train_batches=3)
    assert not torch.allclose(a.layer.weight, b.layer.weight)


def test_backward_override_is_used():
    class Doubles(HookModule):
        def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            (loss * 0).backward()

    m = Doubles([])
    before = _weights(m)
    _fit(m, limit_train_batches=2)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # zero gradients: SGD does nothing


def test_transfer_batch_to_device_override_and_transfer_hooks_are_used():
    seen: list[str] = []

    class Module(HookModule):
        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            seen.append("before")
            return batch

        def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
            seen.append(f"transfer {device.type}")
            x, y = batch
            return x * 0, y * 0

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            seen.append("after")
            return batch

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            assert not batch[0].any()
            return super().training_step(batch, batch_idx)

    _fit(Module([]), limit_train_batches=1)
    assert seen == ["before", "transfer cpu", "after"]


def test_configure_gradient_clipping_override_clips():
    norms: list[float] = []

    class Clips(HookModule):
        def configure_gradient_clipping(
            self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
        ) -> None:
            self.clip_gradients(optimizer, gradient_clip_val=1e-3, gradient_clip_algorithm="value")

        def on_before_zero_grad(self, optimizer: Any) -> None:
            if self.layer.weight.grad is not None:
                norms.append(float(self.layer.weight.grad.abs().max()))

    _fit(Clips([]), limit_train_batches=3)
    assert norms and max(norms) <= 1e-3 + 1e-9


def test_lr_scheduler_step_override_is_used():
    stepped: list[Any] = []

    class Module(HookModule):
        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            stepped.append(metric)  # and does not step it

    m = _fit(Module([]), max_epochs=2, limit_train_batches=2)
    assert stepped == [None, None]
    assert m.lr_schedulers().last_epoch == 0


def test_configure_model_runs_before_configure_optimizers():
    class Module(HookModule):
        def configure_model(self) -> None:
            if not hasattr(self, "head"):
                self.head = torch.nn.Linear(1, 1)

        def configure_optimizers(self) -> Any:
            assert hasattr(self, "head")
            return super().configure_optimizers()

    m = _fit(Module([]), limit_train_batches=1)
    assert isinstance(m.head, torch.nn.Linear)


def test_model_eval_override_is_used():
    class KeepsDropout(HookModule):
        def on_validation_model_eval(self) -> None:
            self.eval()
            self.layer.train()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            assert self.layer.training

    trainer([], limit_val_batches=1).validate(KeepsDropout([]))


@pytest.mark.parametrize("manual", [True])
def test_manual_optimization_calls_on_before_optimizer_step_per_step(manual):
    count: list[int] = []

    class Module(HookModule):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            count.append(1)

    _fit(Module([], manual=manual), limit_train_batches=3)
    assert len(count) == 6


def test_a_datamodule_batch_transfer_hook_is_used_instead_of_the_modules():
    seen: list[str] = []

    class Data(ember.DataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.randn(2, 2), torch.randn(2, 1)), batch_size=1)

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            seen.append("datamodule")
            return batch

    class Module(HookModule):
        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            seen.append("module")
            return batch

    trainer([], max_epochs=1, limit_val_batches=0).fit(Module([]), datamodule=Data())
    assert seen == ["datamodule", "datamodule"]


def test_validation_releases_the_gradients_before_it_runs():
    grads: list[Any] = []

    class Module(HookModule):
        def on_validation_start(self) -> None:
            grads.append(self.layer.weight.grad)

    trainer([], max_epochs=1, num_sanity_val_steps=0).fit(Module([]))
    assert grads == [None]
