"""Manual optimization: self.optimizers(), manual_backward, several optimizers, global_step once per batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


class Manual(BoringModel):
    def __init__(self, loss_factor: float = 1.0) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.loss_factor = loss_factor

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = self.loss_factor * F.mse_loss(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("loss", loss)


class TwoOptimizers(ember.TrainModule):
    """A GAN-shaped module: two sub-networks, each with its own optimizer, both stepped every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = torch.nn.Linear(4, 1)
        self.b = torch.nn.Linear(4, 1)
        self.steps = [0, 0]

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        for i, (opt, net) in enumerate(((opt_a, self.a), (opt_b, self.b))):
            opt.zero_grad()
            self.manual_backward(F.mse_loss(net(x), y))
            opt.step()
            self.steps[i] += 1

    def configure_optimizers(self):
        return [torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.Adam(self.b.parameters(), lr=0.01)]


def test_manual_optimization_equals_a_plain_loop():
    torch.manual_seed(0)
    module = Manual()
    reference = BoringModel()
    reference.load_state_dict(module.state_dict())
    opt = reference.configure_optimizers()
    for _ in range(2):
        for x, y in regression_loader():
            opt.zero_grad()
            F.mse_loss(reference(x), y).backward()
            opt.step()
    trainer = fast_trainer(max_epochs=2)
    trainer.fit(module, regression_loader())
    torch.testing.assert_close(module.layer.weight, reference.layer.weight, atol=1e-6, rtol=0)
    assert trainer.global_step == 8
    assert "loss" in trainer.callback_metrics


def test_optimizers_returns_one_wrapper_for_one_optimizer():
    seen = []

    class Peek(Manual):
        def training_step(self, batch, batch_idx):
            seen.append(self.optimizers())
            return super().training_step(batch, batch_idx)

    trainer = fast_trainer(limit_train_batches=1)
    trainer.fit(Peek(), regression_loader())
    opt = seen[0]
    assert opt.optimizer is trainer.optimizers[0]
    assert opt.param_groups is trainer.optimizers[0].param_groups  # attribute access goes through


def test_two_optimizers_global_step_counts_batches_not_optimizer_calls():
    module = TwoOptimizers()
    trainer = fast_trainer(max_epochs=2)
    trainer.fit(module, regression_loader())
    assert module.steps == [8, 8]
    assert trainer.global_step == 8  # not 16
    assert [type(o) for o in trainer.optimizers] == [torch.optim.SGD, torch.optim.Adam]


def test_max_steps_counts_batches_that_stepped_in_manual_optimization():
    module = TwoOptimizers()
    trainer = fast_trainer(max_epochs=10, max_steps=5)
    trainer.fit(module, regression_loader())
    assert trainer.global_step == 5 and module.steps == [5, 5]


def test_a_batch_without_an_optimizer_step_does_not_count():
    class EveryOther(Manual):
        def training_step(self, batch, batch_idx):
            if batch_idx % 2 == 0:
                return super().training_step(batch, batch_idx)
            return None

    trainer = fast_trainer()
    trainer.fit(EveryOther(), regression_loader())
    assert trainer.global_step == 2


def test_manual_backward_calls_the_backward_hooks():
    calls = []

    class Hooked(Manual):
        def on_before_backward(self, loss):
            calls.append("before")

        def on_after_backward(self):
            calls.append("after")

    fast_trainer(limit_train_batches=2).fit(Hooked(), regression_loader())
    assert calls == ["before", "after"] * 2


def test_manual_optimization_rejects_accumulation_and_clipping():
    for kwargs in ({"accumulate_grad_batches": 2}, {"gradient_clip_val": 1.0}):
        with pytest.raises(
            ValueError,
            match=r"apply to automatic optimization only.*accumulate and clip in "
            r"training_step yourself",
        ):
            fast_trainer(**kwargs).fit(Manual(), regression_loader())


def test_lr_schedulers_are_stepped_by_the_user_not_the_trainer():
    # Lightning semantics: in manual optimization the module steps its schedulers itself.
    class WithScheduler(Manual):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

        def on_train_epoch_end(self):
            self.lr_schedulers().step()

    trainer = fast_trainer(max_epochs=2)
    trainer.fit(WithScheduler(), regression_loader())
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.25)


def test_lr_schedulers_is_none_without_schedulers():
    seen = []

    class Peek(Manual):
        def on_train_start(self):
            seen.append(self.lr_schedulers())

    fast_trainer(limit_train_batches=1).fit(Peek(), regression_loader())
    assert seen == [None]


def test_manual_optimization_with_16_mixed_scales_and_unscales():
    torch.manual_seed(0)
    m16 = Manual(loss_factor=1e-2)
    m32 = Manual(loss_factor=1e-2)
    m32.load_state_dict(m16.state_dict())
    try:
        fast_trainer(precision="16-mixed").fit(m16, regression_loader())
    except RuntimeError as err:  # pragma: no cover - torch builds without CPU float16 autocast
        pytest.skip(f"16-mixed unsupported on this CPU build: {err}")
    fast_trainer().fit(m32, regression_loader())
    torch.testing.assert_close(m16.layer.weight, m32.layer.weight, atol=1e-2, rtol=0)
    assert not torch.equal(m16.layer.weight, BoringModel().layer.weight)


# ---------------------------------------------------------------------- Lightning 2.6.6 parity
class KwargsOptimizer(torch.optim.SGD):
    """An optimizer whose step takes an extra keyword."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.scales: list[float] = []

    def step(self, closure=None, scale=1.0):
        self.scales.append(scale)
        return super().step(closure)


class ClosureAndKwargs(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt, sched = self.optimizers(), self.lr_schedulers()
        loss = F.mse_loss(self(batch[0]), batch[1])

        def closure():
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        opt.step(closure=closure, scale=3.0)
        if batch_idx == 3:
            sched.step(1.0)  # the user steps ReduceLROnPlateau with a metric of their choice

    def configure_optimizers(self):
        opt = KwargsOptimizer(self.parameters(), lr=1.0)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "interval": "step", "frequency": 2}}


def test_step_kwargs_reach_the_optimizer_and_plateau_needs_no_monitor():
    """Lightning 2.6.6, 2 epochs of 4 batches: scale=3.0 reaches every step (8), ReduceLROnPlateau without a
    monitor is accepted in manual optimization, and the user's steps take lr 1.0 -> 0.1."""
    module = ClosureAndKwargs()
    trainer = fast_trainer(max_epochs=2)
    trainer.fit(module, regression_loader())
    assert trainer.optimizers[0].scales == [3.0] * 8
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1)
    assert trainer.global_step == 8


def test_plateau_keys_are_ignored_with_a_warning_in_manual_optimization():
    # Lightning 2.6.6: RuntimeWarning "The lr scheduler dict contains the key(s) ['monitor', 'strict'], but the keys
    # will be ignored. You need to call `lr_scheduler.step()` manually in manual optimization."
    class Module(ClosureAndKwargs):
        def configure_optimizers(self):
            opt = KwargsOptimizer(self.parameters(), lr=1.0)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "x", "strict": True}}

    trainer = fast_trainer(max_epochs=1)
    with pytest.warns(
        RuntimeWarning,
        match=r"contains the key\(s\) \['monitor', 'strict'\], but the keys will be "
        r"ignored",
    ):
        trainer.fit(Module(), regression_loader())
    assert trainer.lr_scheduler_configs[0].monitor is None


def test_on_before_optimizer_step_runs_after_the_closure_inside_the_step():
    """As Lightning: opt.step(closure) runs the closure (its backward) first, then on_before_optimizer_step,
    then the update; so the hook sees the closure's gradients. Without a closure, the hook runs first."""
    calls: list[str] = []

    class Closure(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()

            def closure():
                calls.append("closure")
                opt.zero_grad()
                loss = F.mse_loss(self(batch[0]), batch[1])
                self.manual_backward(loss)
                return loss

            opt.step(closure if batch_idx == 0 else None)

        def on_before_optimizer_step(self, optimizer):
            calls.append(f"hook sees grad: {self.layer.weight.grad is not None}")

    fast_trainer(limit_train_batches=2).fit(Closure(), regression_loader())
    assert calls == ["closure", "hook sees grad: True", "hook sees grad: True"]
