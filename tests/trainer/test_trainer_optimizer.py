"""TrainerOptimizer: the one wrapper the module steps its optimizer through, automatic or manual."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.trainer.optim import TrainerOptimizer
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


class KwargsSGD(torch.optim.SGD):
    """An SGD whose step takes a keyword argument, and records it."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.seen: list[float] = []

    def step(self, closure=None, factor=1.0):
        self.seen.append(factor)
        return super().step(closure)


class Automatic(BoringModel):
    def __init__(self, kwargs: dict) -> None:
        super().__init__()
        self.kwargs = kwargs

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1]) * 1e-2  # small: loss * 65536 stays finite in float16

    def configure_optimizers(self):
        return KwargsSGD(self.parameters(), lr=0.1)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        assert isinstance(optimizer, TrainerOptimizer) and isinstance(optimizer.optimizer, KwargsSGD)
        optimizer.step(closure=optimizer_closure, **self.kwargs)


class Manual(Automatic):
    def __init__(self, kwargs: dict) -> None:
        super().__init__(kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.mse_loss(self(batch[0]), batch[1]) * 1e-2)
        opt.step(**self.kwargs)


@pytest.mark.parametrize("cls", [Automatic, Manual])
@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_step_kwargs_reach_the_optimizer_and_change_nothing_else(cls, precision):
    """The keyword argument reaches the optimizer's step (through the GradScaler under 16-mixed), and
    the weights are those of the same fit without it: the gradients are unscaled once, not twice."""
    weights = []
    for kwargs in ({}, {"factor": 1.0}):
        torch.manual_seed(0)
        module = cls(kwargs)
        trainer = fast_trainer(max_epochs=1, limit_train_batches=3, precision=precision)
        trainer.fit(module, regression_loader())
        assert trainer.optimizers[0].seen == [1.0] * 3 and trainer.global_step == 3
        weights.append(module.layer.weight.detach().clone())
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)


@pytest.mark.parametrize("cls", [Automatic, Manual])
def test_a_closure_that_is_not_callable_is_refused(cls):
    class Wrong(cls):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            optimizer.step(0.5)  # a learning rate where the closure goes

        def training_step(self, batch, batch_idx):
            if self.automatic_optimization:
                return super().training_step(batch, batch_idx)
            self.optimizers().step(0.5)

    with pytest.raises(TypeError, match="got a float as closure; it must be a function that computes the loss"):
        fast_trainer(max_epochs=1, limit_train_batches=1).fit(Wrong({}), regression_loader())


def test_attributes_read_through_and_zero_grad_reaches_the_optimizer():
    layer = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(layer.parameters(), lr=0.5)
    calls = []
    wrapped = TrainerOptimizer(sgd, lambda opt, closure, kwargs: calls.append((opt, closure, kwargs)) or "out")
    assert wrapped.optimizer is sgd and wrapped.param_groups is sgd.param_groups and wrapped.defaults["lr"] == 0.5
    layer(torch.ones(1, 2)).sum().backward()
    wrapped.zero_grad()
    assert layer.weight.grad is None
    assert wrapped.step(factor=2.0) == "out" and calls == [(sgd, None, {"factor": 2.0})]
    with pytest.raises(AttributeError, match="no_such_thing"):
        wrapped.no_such_thing  # noqa: B018


class SeesItsOptimizers(BoringModel):
    """Manual optimization that records what ``self.optimizers()`` gives, and what a closure step returns."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.seen: dict = {}

    def training_step(self, batch, batch_idx):
        opt, raw = self.optimizers(), self.optimizers(use_pl_optimizer=False)
        x, y = batch

        def closure():
            loss = F.mse_loss(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        returned = opt.step(closure=closure)
        if batch_idx == 0:
            self.seen = {"opt": opt, "raw": raw, "returned": returned}


def test_the_wrapper_is_the_optimizer_to_isinstance_and_print_and_the_raw_one_is_one_call_away():
    module = SeesItsOptimizers()
    fast_trainer(max_epochs=1).fit(module, regression_loader())
    opt, raw = module.seen["opt"], module.seen["raw"]
    assert isinstance(opt, ember.TrainerOptimizer) and isinstance(opt, torch.optim.SGD)  # as Lightning's wrapper
    assert type(raw) is torch.optim.SGD and opt.optimizer is raw
    assert repr(opt).startswith("TrainerSGD (") and "Parameter Group 0" in str(opt)
    assert torch.is_tensor(module.seen["returned"])  # the closure's loss, through the optimizer's step


def test_a_wrapper_copies_and_pickles_as_a_wrapper():
    import copy
    import pickle

    param = torch.nn.Parameter(torch.ones(2))
    wrapper = TrainerOptimizer(torch.optim.SGD([param], lr=0.1), print)
    for other in (copy.copy(wrapper), copy.deepcopy(wrapper), pickle.loads(pickle.dumps(wrapper))):
        assert type(other) is TrainerOptimizer and type(other.optimizer) is torch.optim.SGD
