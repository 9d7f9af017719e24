"""A module's overridden hooks are used: optimizer_step (also with a closure optimizer, LBFGS), zero_grad,
backward (also under ``strategy="ddp"``), batch transfer, gradient clipping, scheduler stepping, model eval.

Sequences and values marked "Lightning 2.6.6" were observed by running Lightning on the same module.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from tests.helpers.dist import join_as_rank, run_ranks
from tests.helpers.hook_recorder import HookModule, _loader, trainer


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


def lines(text: str) -> list[str]:
    return text.split()


# ---------------------------------------------------------------------------- closure optimizers, backward under ddp
class LBFGSModule(ember.TrainModule):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen = seen

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(f"training_step({batch_idx}):{self.trainer.global_step}")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen.append(f"on_before_optimizer_step:{self.trainer.global_step}")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(f"on_train_batch_end({batch_idx})")  # global_step here: test_hook_state.py

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)

    def train_dataloader(self) -> DataLoader:
        return _loader(4)


class LBFGSOverride(LBFGSModule):
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        self.seen.append(f"optimizer_step({epoch},{batch_idx}):{self.trainer.global_step}")
        optimizer.step(closure=optimizer_closure)
        self.seen.append(f"optimizer_step_done({batch_idx}):{self.trainer.global_step}")


def lbfgs_fit(cls: type[LBFGSModule]) -> tuple[list[str], LBFGSModule, ember.Trainer]:
    seen: list[str] = []
    torch.manual_seed(0)
    module = cls(seen)
    t = ember.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        accelerator="cpu",
    )
    t.fit(module)
    return seen, module, t


# Lightning 2.6.6, LBFGS(max_iter=3), 2 batches: LBFGS calls the closure 3 times per batch, each running
# training_step and (after backward) on_before_optimizer_step; global_step counts one step per batch.
LBFGS_DEFAULT = """
    training_step(0):0 on_before_optimizer_step:0 training_step(0):0 on_before_optimizer_step:0
    training_step(0):0 on_before_optimizer_step:0 on_train_batch_end(0)
    training_step(1):1 on_before_optimizer_step:1 training_step(1):1 on_before_optimizer_step:1
    training_step(1):1 on_before_optimizer_step:1 on_train_batch_end(1)
"""


# ... and an overridden optimizer_step is called once per batch, the closure calls inside its optimizer.step.
LBFGS_OVERRIDE = """
    optimizer_step(0,0):0
    training_step(0):0 on_before_optimizer_step:0 training_step(0):0 on_before_optimizer_step:0
    training_step(0):0 on_before_optimizer_step:0
    optimizer_step_done(0):0 on_train_batch_end(0)
    optimizer_step(0,1):1
    training_step(1):1 on_before_optimizer_step:1 training_step(1):1 on_before_optimizer_step:1
    training_step(1):1 on_before_optimizer_step:1
    optimizer_step_done(1):1 on_train_batch_end(1)
"""


def test_lbfgs_calls_training_step_per_closure_and_counts_one_step_per_batch():
    seen, _, t = lbfgs_fit(LBFGSModule)
    assert seen == lines(LBFGS_DEFAULT)
    assert t.global_step == 2


def test_lbfgs_with_an_overridden_optimizer_step():
    seen, module, t = lbfgs_fit(LBFGSOverride)
    _, plain, _ = lbfgs_fit(LBFGSModule)
    assert seen == lines(LBFGS_OVERRIDE)
    assert t.global_step == 2
    assert torch.equal(module.layer.weight, plain.layer.weight)  # the override only forwards the closure


class BackwardModule(ember.TrainModule):
    """Records each call of its overridden ``backward`` (as Lightning calls it in automatic optimization)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.seen.append(f"backward(step={self.trainer.global_step},args={len(args)},kwargs={sorted(kwargs)})")
        loss.backward()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return _loader(8)


def _backward_rank(rank: int, world: int) -> list[str]:
    join_as_rank(rank, world)
    torch.manual_seed(0)
    module = BackwardModule()
    ember.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        accelerator="cpu",
        strategy="ddp",
        devices=world,
    ).fit(module)
    return module.seen


# Lightning 2.6.6 (strategy="ddp" and "ddp_spawn", devices=2 on CPU): the override is called on every rank, once per
# batch, with the loss alone.
BACKWARD_DDP = ["backward(step=0,args=0,kwargs=[])", "backward(step=1,args=0,kwargs=[])"]


def test_backward_override_without_ddp():
    module = BackwardModule()
    ember.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        accelerator="cpu",
    ).fit(module)
    assert module.seen == BACKWARD_DDP


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_backward_override_under_ddp():
    assert run_ranks(_backward_rank, 2, timeout=50) == [BACKWARD_DDP, BACKWARD_DDP]
