"""The numbers: ember's fit must equal a plain PyTorch loop (parity, accumulation, clipping) to 1e-6."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import ember
from tests.helpers.models import UnsizedBatches, fast_trainer, regression_data, regression_loader
from tests.helpers.weights import assert_same_weights


class MLP(ember.TrainModule):
    """Small MLP with dropout (so the RNG stream must match too) and SGD with momentum."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1)
        )
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def plain_loop(
    module: MLP,
    loader: Any,
    epochs: int,
    accumulate: int = 1,
    n_batches: int | None = None,
    clip: tuple[str, float] | None = None,
) -> list[float]:
    """The reference: the loop a user would write by hand, accumulation averaged per (possibly short) window.

    Reseeds first, like every ember run in these tests does, so dropout draws the same masks.
    """
    torch.manual_seed(0)
    opt = module.configure_optimizers()
    losses = []
    module.train()
    for _ in range(epochs):
        batches = list(loader)
        total = len(batches) if n_batches is None else n_batches
        batches = batches[:total]
        for start in range(0, total, accumulate):
            window = batches[start : start + accumulate]
            opt.zero_grad()
            for x, y in window:
                loss = F.mse_loss(module(x), y)
                losses.append(loss.item())
                (loss / len(window)).backward()
            if clip is not None:
                if clip[0] == "norm":
                    torch.nn.utils.clip_grad_norm_(module.parameters(), clip[1])
                else:
                    torch.nn.utils.clip_grad_value_(module.parameters(), clip[1])
            opt.step()
    return losses


def _pair(seed: int = 7) -> tuple[MLP, MLP]:
    ember.seed_everything(seed)
    a = MLP()
    b = copy.deepcopy(a)
    return a, b


def test_parity_with_a_plain_pytorch_loop():
    # Same seed, shuffled loader (the shuffle draws from the global RNG) and dropout in the model.
    ember.seed_everything(123)
    reference = MLP()
    losses = plain_loop(reference, DataLoader(regression_data(40), batch_size=8, shuffle=True), epochs=3)

    ember.seed_everything(123)
    module = MLP()
    trainer = fast_trainer(strategy="single", max_epochs=3, num_sanity_val_steps=0)
    torch.manual_seed(0)  # what plain_loop does before its first batch
    trainer.fit(module, DataLoader(regression_data(40), batch_size=8, shuffle=True))

    assert len(module.losses) == len(losses) == 15
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(losses), atol=1e-6, rtol=0)
    assert_same_weights(module, reference)
    assert trainer.global_step == 15 and trainer.current_epoch == 3
    assert losses[-1] < losses[0]  # it actually trained


class _StepHook(ember.callbacks.Callback):
    """Overrides a step hook: the step then also runs it, and nothing else changes."""

    def __init__(self) -> None:
        self.calls = 0

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.calls += 1


def test_a_step_hook_changes_nothing_in_the_numbers():
    runs = []
    for callbacks in ([], [_StepHook()]):
        ember.seed_everything(5)
        module = MLP()
        trainer = fast_trainer(max_epochs=2, num_sanity_val_steps=0, callbacks=callbacks)
        trainer.fit(module, DataLoader(regression_data(40), batch_size=8, shuffle=True))
        runs.append((module, trainer.global_step))
    assert callbacks[0].calls == 10  # the hook ran before each of the second run's 10 steps
    (plain, steps_a), (hooked, steps_b) = runs
    assert steps_a == steps_b == 10
    assert plain.losses == hooked.losses
    assert_same_weights(plain, hooked, atol=0)


@pytest.mark.parametrize("k", [2, 3])
def test_accumulation_equals_hand_written_loop_with_short_final_window(k):
    # 5 batches: k=2 -> windows of 2, 2, 1; k=3 -> 3, 2 (the short final window is averaged over its size).
    a, b = _pair()
    loader = regression_loader(n=40, batch_size=8)
    ref_losses = plain_loop(b, loader, epochs=2, accumulate=k)
    trainer = fast_trainer(max_epochs=2, accumulate_grad_batches=k)
    torch.manual_seed(0)
    trainer.fit(a, loader)
    torch.testing.assert_close(torch.tensor(a.losses), torch.tensor(ref_losses), atol=1e-6, rtol=0)
    assert_same_weights(a, b)
    windows = -(-5 // k)
    assert trainer.global_step == 2 * windows
    assert trainer.estimated_stepping_batches == 2 * windows


def test_accumulation_with_limit_train_batches_closes_the_window_at_the_limit():
    a, b = _pair()
    loader = regression_loader(n=40, batch_size=8)
    plain_loop(b, loader, epochs=1, accumulate=2, n_batches=3)
    trainer = fast_trainer(accumulate_grad_batches=2, limit_train_batches=3)
    torch.manual_seed(0)
    trainer.fit(a, loader)
    assert_same_weights(a, b)
    assert trainer.global_step == 2


@pytest.mark.parametrize("limit", [None, 10])
def test_accumulation_on_a_loader_without_length(limit):
    # The trainer cannot know the last window is short until the stream ends: the gradients are rescaled.
    # With limit=10 the int limit is larger than the 5-batch stream, so the stream's end still decides.
    a, b = _pair()
    stream = UnsizedBatches(n=40, batch_size=8)
    plain_loop(b, list(stream), epochs=2, accumulate=2)
    trainer = fast_trainer(max_epochs=2, accumulate_grad_batches=2, limit_train_batches=limit)
    torch.manual_seed(0)
    trainer.fit(a, stream)
    assert_same_weights(a, b)
    assert trainer.global_step == 6


@pytest.mark.parametrize("algorithm,value", [("norm", 0.05), ("value", 0.01)])
def test_gradient_clipping_equals_hand_written_loop(algorithm, value):
    a, b = _pair()
    loader = regression_loader(n=40, batch_size=8)
    plain_loop(b, loader, epochs=1, accumulate=2, clip=(algorithm, value))
    trainer = fast_trainer(accumulate_grad_batches=2, gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    torch.manual_seed(0)
    trainer.fit(a, loader)
    assert_same_weights(a, b)


@pytest.mark.parametrize("algorithm,value", [("norm", 0.05), ("value", 0.01)])
def test_gradients_are_clipped_before_the_step(algorithm, value):
    seen = []

    class Spy(MLP):
        def configure_optimizers(self):
            opt = super().configure_optimizers()
            original = opt.step

            def step(*args, **kwargs):
                grads = [p.grad for p in self.parameters() if p.grad is not None]
                if algorithm == "norm":
                    norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
                    seen.append(float(torch.linalg.vector_norm(norms)))
                else:
                    seen.append(max(float(g.abs().max()) for g in grads))
                return original(*args, **kwargs)

            opt.step = step
            return opt

    trainer = fast_trainer(gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    trainer.fit(Spy(), regression_loader(n=40, batch_size=8))
    assert len(seen) == 5
    assert max(seen) <= value * (1 + 1e-5)
    assert max(seen) >= value * (1 - 1e-5)  # the limit was reached, so clipping really happened


def test_gradient_clip_val_zero_or_none_does_not_clip():
    a, b = _pair()
    loader = regression_loader(n=40, batch_size=8)
    plain_loop(b, loader, epochs=1)
    torch.manual_seed(0)
    fast_trainer(gradient_clip_val=0.0).fit(a, loader)
    assert_same_weights(a, b)


@settings(max_examples=40, deadline=None)
@given(
    n_batches=st.integers(1, 7),
    k=st.integers(1, 4),
    limit=st.one_of(st.none(), st.integers(1, 9)),
    sized=st.booleans(),
    epochs=st.integers(1, 2),
)
def test_accumulation_property(n_batches, k, limit, sized, epochs):
    """Any loader length, window size and int limit, with or without a length: the hand-written loop's weights."""
    torch.manual_seed(0)
    a = Linear()
    b = copy.deepcopy(a)
    stream = UnsizedBatches(n=4 * n_batches, batch_size=4)
    loader = DataLoader(regression_data(4 * n_batches), batch_size=4) if sized else stream
    used = n_batches if limit is None else min(limit, n_batches)
    plain_loop(b, list(stream), epochs=epochs, accumulate=k, n_batches=used)
    trainer = fast_trainer(max_epochs=epochs, accumulate_grad_batches=k, limit_train_batches=limit)
    trainer.fit(a, loader)
    assert_same_weights(a, b)
    assert trainer.global_step == epochs * -(-used // k)


class Linear(MLP):
    """No dropout: the property test needs no RNG alignment."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


class LBFGSLinear(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=5)


def test_lbfgs_gets_a_closure_and_equals_a_hand_written_loop():
    ember.seed_everything(3)
    module = LBFGSLinear()
    reference = copy.deepcopy(module)
    loader = regression_loader(n=32, batch_size=16)

    opt = reference.configure_optimizers()
    for _ in range(2):
        for x, y in loader:

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = F.mse_loss(reference.layer(x), y)
                loss.backward()
                return loss

            opt.step(closure)

    trainer = fast_trainer(max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(module, loader)
    assert trainer.global_step == 4  # one step per batch, however often the closure ran
    assert module.calls > 4  # LBFGS evaluated the loss several times per step
    assert_same_weights(module, reference, atol=1e-6)


def test_lbfgs_runs_the_step_hooks_inside_each_closure_call():
    calls = []

    class Hooks(ember.callbacks.Callback):
        def on_before_backward(self, trainer, module, loss):
            calls.append("backward")

        def on_before_optimizer_step(self, trainer, module, optimizer):
            calls.append("step")

    module = LBFGSLinear()
    fast_trainer(max_epochs=1, limit_train_batches=1, callbacks=[Hooks()], gradient_clip_val=0.5).fit(
        module, regression_loader()
    )
    assert calls == ["backward", "step"] * module.calls


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(precision="16-mixed"),
            r"LBFGS.step needs a closure, which a gradient scaler \(precision='16-mixed'\) cannot",
        ),
    ],
)
def test_lbfgs_with_what_cannot_drive_a_closure_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fast_trainer(**kwargs).fit(LBFGSLinear(), regression_loader())


def test_lbfgs_cannot_skip_a_batch():
    class Skips(LBFGSLinear):
        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(
        ValueError,
        match=r"training_step returned None for batch 0, but LBFGS needs the loss from "
        r"every closure call",
    ):
        fast_trainer().fit(Skips(), regression_loader())
