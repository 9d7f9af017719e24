"""``Strategy.backward(loss, backward)``: the given callable computes the gradients, inside the framing.

The base Strategy (and the strategies that inherit its backward) calls ``backward(loss)``, or
``loss.backward()`` without one. Under ``ddp`` on 2 real gloo ranks the callable runs where
``loss.backward()`` ran: armed for the gradient all-reduce, with the beacon naming the collective
the rank waits in, so the gradients still come out averaged across ranks; inside
``no_backward_sync`` it runs with nothing communicated; before ``setup`` (no wrapper) it is simply
called. The callables here double the loss and count their calls, so the gradients show which ran.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.strategies import DataParallelStrategy, DDPStrategy, SingleDeviceStrategy, Strategy
from ember.strategies.watchdog.verdicts import AFTER_BACKWARD
from tests.helpers.dist import run_ranks

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]
GRADIENTS = "the gradient all-reduce (backward)"


class Net(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)


def batch_of(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)


def grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters()]


class Doubling:
    """A module-style backward: ``(2 * loss).backward()``; records the calls (and what the beacon said)."""

    def __init__(self, beacon=None) -> None:
        self.calls: list = []
        self.beacon = beacon

    def __call__(self, loss: torch.Tensor) -> None:
        self.calls.append(self.beacon.waiting if self.beacon is not None else loss)
        (2 * loss).backward()


# ------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("strategy_class", [Strategy, SingleDeviceStrategy])
def test_the_base_strategy_runs_the_given_backward_once(strategy_class):
    net = Net()
    strategy_class().backward(net.training_step(batch_of(0), 0))
    plain = grads(net)

    net.zero_grad(set_to_none=True)
    custom = Doubling()
    loss = net.training_step(batch_of(0), 0)
    strategy_class().backward(loss, custom)
    assert len(custom.calls) == 1 and custom.calls[0] is loss
    for got, want in zip(grads(net), plain):
        torch.testing.assert_close(got, 2 * want)


def test_strategies_without_their_own_framing_inherit_the_base_backward():
    assert SingleDeviceStrategy.backward is Strategy.backward
    assert DataParallelStrategy.backward is Strategy.backward


def test_ddp_before_setup_runs_the_given_backward():
    net, custom = Net(), Doubling()
    DDPStrategy(accelerator="cpu").backward(net.training_step(batch_of(0), 0), custom)
    assert len(custom.calls) == 1 and all(g.abs().sum() > 0 for g in grads(net))


# ------------------------------------------------------------------------------ 2 gloo ranks
def ddp_backward(rank: int, world: int) -> dict:
    """On each rank: local gradients for reference, then the same step through DDPStrategy."""
    reference = Net()
    reference.training_step(batch_of(rank), 0).backward()
    out: dict = {"local": grads(reference)}

    strategy = DDPStrategy(accelerator="cpu", watchdog_timeout=None)
    net = Net()
    strategy.setup(SimpleNamespace(state="fitting"), net)
    beacon = strategy._beacon

    custom = Doubling(beacon)
    strategy.backward(strategy.training_step(batch_of(rank), 0), custom)
    out["custom"], out["custom_calls"] = grads(net), custom.calls
    out["where"] = beacon.where

    net.zero_grad(set_to_none=True)
    strategy.backward(strategy.training_step(batch_of(rank), 0))  # callers that pass only the loss
    out["default"] = grads(net)

    net.zero_grad(set_to_none=True)
    custom = Doubling(beacon)
    with strategy.no_backward_sync():
        strategy.backward(strategy.training_step(batch_of(rank), 0), custom)
    out["unsynced"], out["unsynced_calls"] = grads(net), custom.calls
    strategy.teardown()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(ddp_backward, 2, timeout=50)


def test_ddp_runs_the_given_backward_inside_the_gradient_all_reduce(ranks):
    for r in ranks:
        assert r["custom_calls"] == [GRADIENTS]  # called once, with the beacon naming the wait
        assert r["where"] == AFTER_BACKWARD


def test_ddp_gradients_of_the_given_backward_are_averaged_across_ranks(ranks):
    mean = [torch.stack(gs).mean(0) for gs in zip(*(r["local"] for r in ranks))]
    assert not torch.allclose(ranks[0]["local"][0], ranks[1]["local"][0])  # the ranks' batches differ
    for r in ranks:
        for got, want in zip(r["custom"], mean):
            torch.testing.assert_close(got, 2 * want)  # averaged, of the doubled loss
        for got, want in zip(r["default"], mean):
            torch.testing.assert_close(got, want)  # without a callable: loss.backward()


def test_ddp_inside_no_backward_sync_runs_the_given_backward_without_communicating(ranks):
    for r in ranks:
        assert r["unsynced_calls"] == [None]  # not waiting in any collective
        for got, local in zip(r["unsynced"], r["local"]):
            torch.testing.assert_close(got, 2 * local)
