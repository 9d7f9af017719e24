"""The training step skips the layers that add nothing to a fit: the default fit calls the module's
``training_step``, ``loss.backward()`` and ``optimizer.step()`` itself, where an overridden ``optimizer_step``,
a closure optimizer, a gradient scaler, a profiler or a strategy that adds work goes through every layer.

Both must be the same fit: the same hooks with the same arguments and gradients in the same order, the same
step counts and warnings, the same weights to the bit.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ember
from ember.callbacks import Callback
from ember.strategies import SingleDeviceStrategy
from tests.helpers.models import fast_trainer

#: What the closure path goes through (qualified names of the functions) from ``optimizer_step`` to the step.
CLOSURE_LAYERS = {
    "TrainerOptimizer.step",
    "TrainingStep.step_optimizer",
    "_Closure.__call__",
    "Precision.optimizer_step",
    "Strategy.optimizer_step",
}
#: The layers between the loop and the work, all skipped in a default fit.
LAYERS = CLOSURE_LAYERS | {"TrainModule.optimizer_step", "Strategy.training_step", "Strategy.backward"}


def _grads(module: torch.nn.Module) -> list[Any]:
    return [None if p.grad is None else p.grad.tolist() for p in module.parameters()]


class Recorder(Callback):
    """Every step hook, with the gradients and counters it sees."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.calls.append(("batch_start", batch_idx, trainer.global_step))

    def on_before_zero_grad(self, trainer, module, optimizer):
        self.calls.append(("before_zero_grad", trainer.global_step, _grads(module)))

    def on_before_backward(self, trainer, module, loss):
        self.calls.append(("before_backward", loss.item()))

    def on_after_backward(self, trainer, module):
        self.calls.append(("after_backward", _grads(module)))

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.calls.append(("before_optimizer_step", _grads(module)))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.calls.append(("batch_end", batch_idx, trainer.global_step, None if loss is None else loss.item()))


class Net(ember.TrainModule):
    def __init__(self, skip: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.skip = set(skip)

    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip:
            return None
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ThroughEveryLayer(Net):
    """The default ``optimizer_step``, overridden: the step goes through the closure and every layer."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)


class _Unsized(IterableDataset):
    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self):
        return iter(self.data)


def _loader(sized: bool = True) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(14, 3, generator=g), torch.randn(14, 1, generator=g))
    return DataLoader(data if sized else _Unsized(data), batch_size=2)


def _called(run: Callable[[], Any]) -> set[str]:
    """The qualified names of the ember functions ``run`` calls (in this thread)."""
    names: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and "ember" in frame.f_code.co_filename:
            names.add(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return names


def _fit(
    cls: type[Net],
    sized: bool = True,
    skip: tuple[int, ...] = (),
    record: bool = True,
    trace: bool = True,
    **kwargs: Any,
) -> dict[str, Any]:
    """A fit of ``cls``; ``record``: with the Recorder callback (without it, nothing runs between the last
    backward and the step, a path of its own); ``trace``: with the names of the functions it called."""
    torch.manual_seed(0)
    module = cls(skip)
    recorder = Recorder()
    options: dict[str, Any] = dict(max_epochs=2, callbacks=[recorder] if record else [])
    trainer = fast_trainer(**{**options, **kwargs})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if trace:
            called = _called(lambda: trainer.fit(module, _loader(sized)))
        else:
            called = set()
            trainer.fit(module, _loader(sized))
    return dict(
        called=called,
        calls=recorder.calls,
        global_step=trainer.global_step,
        weights=[p.detach().clone() for p in module.parameters()],
        warnings=sorted(str(w.message) for w in caught if "training_step returned None" in str(w.message)),
    )


CASES = {
    "default": dict(),
    "accumulate, a short last window": dict(accumulate_grad_batches=3),
    "accumulate, a loader without a length": dict(accumulate_grad_batches=3, sized=False),
    "clipping": dict(gradient_clip_val=0.05),
    "None from training_step, a window of them": dict(accumulate_grad_batches=2, skip=(1, 2, 3)),
    "None from training_step, one batch a step": dict(skip=(0, 4)),
    "bf16-mixed": dict(precision="bf16-mixed"),
}


@pytest.mark.parametrize("record", [True, False], ids=["step hooks", "no step hooks"])
@pytest.mark.parametrize("case", CASES)
def test_the_default_step_is_the_fit_the_closure_path_runs(case, record):
    direct = _fit(Net, record=record, trace=record, **CASES[case])
    layered = _fit(ThroughEveryLayer, record=record, trace=record, **CASES[case])
    if record:  # (tracing every call is slow: once per case is enough)
        assert not direct["called"] & LAYERS, "the default fit went through a layer it skips"
        assert CLOSURE_LAYERS <= layered["called"], "an overridden optimizer_step did not go through the closure"
    assert direct["calls"] == layered["calls"]
    assert direct["global_step"] == layered["global_step"] > 0
    assert direct["warnings"] == layered["warnings"]
    assert all(torch.equal(a, b) for a, b in zip(direct["weights"], layered["weights"]))
    if CASES[case].get("skip"):
        first = CASES[case]["skip"][0]
        assert len(direct["warnings"]) == 1, "said once per fit"
        assert direct["warnings"][0].startswith(f"training_step returned None for batch {first}: skipping its backward")
    if CASES[case].get("skip") and record:
        assert ("before_optimizer_step", [None, None]) in direct["calls"]  # the all-None window still "steps"


#: What every automatic step runs, on either path: the batch's work is one function.
WORK = {"TrainingStep.__call__", "TrainingStep.forward_backward"}


class OnAfterBackward(Callback):
    def on_after_backward(self, trainer, module):
        pass


class ZeroGrad(Net):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad()


class OwnBackward(Net):
    def backward(self, loss, *args, **kwargs):
        self.backwards = getattr(self, "backwards", 0) + 1
        (loss * 2).backward()


class ModuleHooks(Net):
    """Step hooks on the module itself, not on a callback."""

    def on_before_zero_grad(self, optimizer):
        self.seen = getattr(self, "seen", 0) + 1

    def on_before_backward(self, loss):
        self.seen = getattr(self, "seen", 0) + 1


class FrozenBias(Net):
    def __init__(self, skip: tuple[int, ...] = ()) -> None:
        super().__init__(skip)
        self.layer.bias.requires_grad_(False)


class DictStep(Net):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if loss is None else {"loss": loss, "seen": batch_idx}


@pytest.mark.parametrize(
    "cls, options, direct",
    [
        (Net, dict(), True),
        (OwnBackward, dict(), True),
        (DictStep, dict(), True),
        (FrozenBias, dict(), True),
        (Net, dict(sized=False), True),
        (Net, dict(callbacks=[OnAfterBackward()]), True),
        (Net, dict(accumulate_grad_batches=2), True),
        (Net, dict(precision="bf16-mixed"), True),
        (Net, dict(gradient_clip_val=1.0), True),
        (ZeroGrad, dict(), True),
        (ModuleHooks, dict(), True),
        (ThroughEveryLayer, dict(), False),
        (Net, dict(profiler="simple"), False),
    ],
)
def test_each_fit_takes_the_direct_path_unless_a_layer_adds_work(cls, options, direct):
    """One fast path: whatever runs between training_step, zero_grad, backward and the optimizer's step (a hook,
    an override, a window, autocast, clipping), the step skips the layers that add nothing; only an overridden
    optimizer_step or a profiler goes through them. Either way it is the same fit as through every layer."""
    fit = _fit(cls, record=False, **options)
    assert WORK <= fit["called"]
    assert (not fit["called"] & LAYERS, CLOSURE_LAYERS <= fit["called"]) == (direct, not direct)
    layered_cls = cls if issubclass(cls, ThroughEveryLayer) else type("Layered", (ThroughEveryLayer, cls), {})
    layered = _fit(layered_cls, record=False, trace=False, **options)
    assert fit["global_step"] == layered["global_step"] == (14 if options.get("accumulate_grad_batches") is None else 8)
    assert all(torch.equal(a, b) for a, b in zip(fit["weights"], layered["weights"]))


def test_own_backward_in_the_direct_step_is_called_once_a_step():
    module = OwnBackward()
    trainer = fast_trainer(max_epochs=1)
    trainer.fit(module, _loader())
    assert module.backwards == trainer.global_step == 7


def test_a_window_that_changes_size_between_epochs_changes_the_step_with_it():
    """GradientAccumulationScheduler sets accumulate_grad_batches per epoch: one batch a step in the first
    epoch, three in the next, one again after; the direct path in each, the same fit as every layer's."""
    from ember.callbacks import GradientAccumulationScheduler

    def fit(cls: type[Net]) -> dict[str, Any]:
        return _fit(cls, record=False, max_epochs=3, callbacks=[GradientAccumulationScheduler({1: 3, 2: 1})])

    fit_direct, layered = fit(Net), fit(ThroughEveryLayer)
    assert WORK <= fit_direct["called"] and not fit_direct["called"] & LAYERS
    assert fit_direct["global_step"] == layered["global_step"] == 7 + 3 + 7
    assert all(torch.equal(a, b) for a, b in zip(fit_direct["weights"], layered["weights"]))


def test_a_profiler_sees_every_layer():
    """Timing the step's parts needs them: with a profiler nothing is skipped."""
    fit = _fit(Net, profiler="simple")
    assert LAYERS <= fit["called"]
    assert fit["calls"] == _fit(Net)["calls"]


def test_a_closure_optimizer_goes_through_the_closure():
    class LBFGSNet(Net):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)

    fit = _fit(LBFGSNet, max_epochs=1)
    assert CLOSURE_LAYERS | {"TrainModule.optimizer_step"} <= fit["called"]
    assert fit["global_step"] == 7
    assert sum(c[0] == "before_backward" for c in fit["calls"]) > 7  # LBFGS evaluated the loss several times a step


def test_overrides_set_on_the_instance_are_called():
    seen: list[str] = []

    def optimizer_step(epoch, batch_idx, optimizer, optimizer_closure=None):
        seen.append("optimizer_step")
        optimizer.step(closure=optimizer_closure)

    def backward(loss, *args, **kwargs):
        seen.append("backward")
        loss.backward()

    module = Net()
    module.optimizer_step = optimizer_step
    module.backward = backward
    trainer = fast_trainer()
    trainer.fit(module, _loader())
    assert seen == ["backward", "optimizer_step"] * 7 or seen == ["optimizer_step", "backward"] * 7
    assert trainer.global_step == 7


def test_a_strategy_that_adds_work_to_a_layer_keeps_it():
    seen: list[str] = []

    class Adds(SingleDeviceStrategy):
        def training_step(self, batch, batch_idx, *extra):
            seen.append("training_step")
            return super().training_step(batch, batch_idx, *extra)

        def backward(self, loss, backward=None):
            seen.append("backward")
            super().backward(loss, backward)

        def optimizer_step(self, optimizer, closure=None, **kwargs):
            seen.append("optimizer_step")
            return super().optimizer_step(optimizer, closure, **kwargs)

    trainer = fast_trainer(strategy=Adds("cpu"))
    trainer.fit(Net(), _loader())
    assert seen == ["training_step", "backward", "optimizer_step"] * 7


def test_a_strategy_patched_on_the_instance_keeps_the_patch():
    trainer = fast_trainer()
    calls: list[int] = []
    real = trainer.strategy.backward

    def backward(loss, backward=None):
        calls.append(1)
        real(loss, backward)

    trainer.strategy.backward = backward
    trainer.fit(Net(), _loader())
    assert len(calls) == 7


@pytest.mark.parametrize("cuda_available", [False, True])
def test_the_batch_transfer_is_skipped_only_where_no_batch_can_need_moving(monkeypatch, cuda_available):
    """On a machine without CUDA a CPU fit's batches cannot hold a tensor to move: the loops skip the transfer.
    With CUDA present (a CPU fit on a GPU machine), the transfer runs: a batch may hold CUDA tensors."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    trainer = fast_trainer()

    class WithValidation(Net):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    called = _called(lambda: trainer.fit(WithValidation(), _loader(), val_dataloaders=_loader()))
    assert ("SingleDeviceStrategy.batch_to_device" in called) is cuda_available
    assert trainer.global_step == 7
    assert "val_loss" in trainer.callback_metrics


@pytest.mark.parametrize("profiler", [None, "simple"])
def test_an_optimizer_step_set_to_none_is_an_error_that_says_so(profiler):
    """As Lightning, a hook set to None is not called; with optimizer_step that leaves the closure (training_step,
    backward) unrun, which Lightning also refuses ("The closure hasn't been executed")."""
    module = Net()
    module.optimizer_step = None
    before = [p.detach().clone() for p in module.parameters()]
    trainer = fast_trainer(profiler=profiler)
    with pytest.raises(RuntimeError, match=r"Net.optimizer_step is None.*Remove the `optimizer_step = None`"):
        trainer.fit(module, _loader())
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
