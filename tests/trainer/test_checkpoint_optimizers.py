"""A resume checks each saved optimizer state against the optimizer it would go into (its class, its groups'
hyper-parameter keys, the keys and shapes of its per-parameter state), and refuses a mismatch before anything
changes: the weights, optimizers, schedulers and callbacks stay as they were."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.callbacks import Callback, ModelCheckpoint
from ember.checkpoint import CheckpointError
from tests.helpers.models import fast_trainer, regression_loader

Make = Callable[[Any], Any]  # (module) -> what configure_optimizers returns


class Net(ember.TrainModule):
    """Two layers of different shapes, trained by whatever ``make`` builds."""

    def __init__(self, make: Make) -> None:
        super().__init__()
        self.make = make
        self.body = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(torch.relu(self.body(x))), y)

    def configure_optimizers(self) -> Any:
        return self.make(self)


class Counter(Callback):
    """A callback with state, to see that a refused resume loads none of it."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = state["batches"]


def sgd(m: Any) -> Any:
    return torch.optim.SGD(m.parameters(), lr=0.1)


def sgd_momentum(m: Any) -> Any:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def adam(m: Any) -> Any:
    return torch.optim.Adam(m.parameters(), lr=0.01)


def adamw(m: Any) -> Any:
    return torch.optim.AdamW(m.parameters(), lr=0.01)


def adam_amsgrad(m: Any) -> Any:
    return torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=True)


def two_groups(m: Any) -> Any:
    return torch.optim.Adam([{"params": m.body.parameters()}, {"params": m.head.parameters()}], lr=0.01)


def two_groups_swapped(m: Any) -> Any:
    """The same group sizes (two parameters each) as ``two_groups``, the layers in the other order."""
    return torch.optim.Adam([{"params": m.head.parameters()}, {"params": m.body.parameters()}], lr=0.01)


def uneven_groups(m: Any) -> Any:
    return torch.optim.Adam([{"params": [m.body.weight]}, {"params": [m.body.bias, *m.head.parameters()]}], lr=0.01)


def with_scheduler(scheduler: Callable[[Any], Any]) -> Make:
    def make(m: Any) -> Any:
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler(opt), "interval": "step"}}

    return make


step_lr = with_scheduler(lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2))
one_cycle = with_scheduler(lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=100))


def trainer(root: Any, counter: Callback | None = None, epochs: int = 1) -> ember.Trainer:
    callbacks = [ModelCheckpoint(dirpath=str(root / "c"))] + ([counter] if counter is not None else [])
    return fast_trainer(max_epochs=epochs, enable_checkpointing=True, default_root_dir=str(root), callbacks=callbacks)


def saved(root: Any, make: Make) -> str:
    trainer(root, Counter()).fit(Net(make), regression_loader())
    return str(root / "c" / "last.ckpt")


def resume_refused(root: Any, path: str, make: Make, caplog: Any) -> str:
    """Resume ``path`` with ``make``'s optimizer; expect a CheckpointError that changed nothing."""
    module, counter = Net(make), Counter()
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    t = trainer(root, counter, epochs=2)
    caplog.clear()
    with caplog.at_level(logging.INFO), pytest.raises(CheckpointError) as info:
        t.fit(module, regression_loader(), ckpt_path=path)
    assert all(torch.equal(weights[k], v) for k, v in module.state_dict().items()), "the weights changed"
    assert all(not opt.state for opt in t.optimizers), "an optimizer was loaded"
    assert counter.batches == 0, "a callback's state was loaded"
    assert t.global_step == 0 and t.current_epoch == 0
    assert "Restored all states" not in caplog.text
    message = str(info.value)
    assert "'optimizer_states'" in message and "Nothing was loaded" in message
    assert "Resume with the optimizers that wrote it" in message
    assert "Net.load_from_checkpoint(path), then fit without ckpt_path" in message
    return message


@pytest.mark.parametrize(
    "before, after, match",
    [
        (
            sgd_momentum,
            adam,
            r"optimizer 0 is a torch\.optim\.adam\.Adam, but the checkpoint's is a torch\.optim\.sgd\.SGD",
        ),
        (
            adam,
            sgd_momentum,
            r"optimizer 0 is a torch\.optim\.sgd\.SGD, but the checkpoint's is a torch\.optim\.adam\.Adam",
        ),
        (adamw, adam, r"optimizer 0 is a torch\.optim\.adam\.Adam, but .* torch\.optim\.adamw\.AdamW"),
        (adam, adamw, r"optimizer 0 is a torch\.optim\.adamw\.AdamW, but .* torch\.optim\.adam\.Adam"),
        (
            sgd_momentum,
            sgd,
            r"optimizer 0 \(SGD\)'s 'momentum_buffer' for parameter 0 has shape \(3, 4\), but this SGD ",
        ),
        (adam, adam_amsgrad, r"optimizer 0 \(Adam\)'s state for parameter 0 lacks 'max_exp_avg_sq', which this Adam"),
        (adam_amsgrad, adam, r"\(Adam\)'s 'max_exp_avg_sq' for parameter 0 .* keeps no 'max_exp_avg_sq'"),
        (adam, two_groups, r"optimizer 0 has parameter groups of sizes \[4\], but the optimizer now has \[2, 2\]"),
        (two_groups, uneven_groups, r"optimizer 0 has parameter groups of sizes \[2, 2\], but .* now has \[1, 3\]"),
        (
            two_groups,
            two_groups_swapped,
            r"optimizer 0 \(Adam\)'s 'exp_avg' for parameter 0 has shape \(3, 4\), where this optimizer keeps "
            r"\(1, 3\) for a parameter of shape \(1, 3\)",
        ),
        (step_lr, one_cycle, r"parameter group 0 of optimizer 0 \(SGD\) lacks 'base_momentum', 'max_lr', .*'min_lr'"),
    ],
)
def test_a_state_of_another_optimizer_is_refused_before_anything_changes(tmp_path, caplog, before, after, match):
    path = saved(tmp_path, before)
    message = resume_refused(tmp_path, path, after, caplog)
    assert re.search(match, message), message


def test_checkpoints_record_each_optimizers_class(tmp_path):
    ckpt = torch.load(saved(tmp_path, adamw), weights_only=True)
    assert ckpt["optimizer_states"][0]["optimizer_class"] == "torch.optim.adamw.AdamW"


def test_a_file_without_the_class_still_resumes_and_is_still_checked(tmp_path, caplog):
    """Files written before the class was recorded: the same optimizer resumes; another is caught by its keys."""
    for make in (adam, sgd_momentum):
        path = saved(tmp_path / make.__name__, make)
        ckpt = torch.load(path, weights_only=True)
        del ckpt["optimizer_states"][0]["optimizer_class"]
        torch.save(ckpt, path)
    t = trainer(tmp_path / "adam", epochs=2)
    t.fit(Net(adam), regression_loader(), ckpt_path=str(tmp_path / "adam" / "c" / "last.ckpt"))
    assert t.global_step == 8 and t.optimizers[0].state_dict()["state"][0]["step"] == 8
    message = resume_refused(
        tmp_path / "sgd_momentum", str(tmp_path / "sgd_momentum" / "c" / "last.ckpt"), adam, caplog
    )
    # (Adam fills in the flags added to it over torch's releases, 'amsgrad' among them, when it loads a file.)
    assert (
        "parameter group 0 of optimizer 0 (Adam) lacks 'betas', 'eps' and has 'dampening', 'momentum', 'nesterov', "
        "which its groups do not: it was written by another optimizer" in message
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda m: torch.optim.LBFGS(m.parameters(), lr=0.1, max_iter=2),  # flat state under the first parameter
        lambda m: torch.optim.Adafactor(m.parameters(), lr=0.01),  # factored state: a row and a column
        sgd_momentum,
        two_groups,
        one_cycle,
    ],
    ids=["LBFGS", "Adafactor", "SGD", "groups", "OneCycleLR"],
)
def test_the_same_optimizer_resumes_exactly(tmp_path, make):
    """A resume with the optimizer that wrote the checkpoint goes through, whatever shapes its state has, and
    continues as one uninterrupted run."""
    torch.manual_seed(0)
    whole = Net(make)
    start = {k: v.clone() for k, v in whole.state_dict().items()}
    fast_trainer(max_epochs=2).fit(whole, regression_loader())
    first = Net(make)
    first.load_state_dict(start)
    trainer(tmp_path).fit(first, regression_loader())
    resumed = Net(make)
    trainer(tmp_path, epochs=2).fit(resumed, regression_loader(), ckpt_path=str(tmp_path / "c" / "last.ckpt"))
    assert all(torch.equal(whole.state_dict()[k], v) for k, v in resumed.state_dict().items())


class Preconditioned(torch.optim.Optimizer):
    """An optimizer of the user's, keeping per parameter a matrix that is not shaped like the parameter
    (as Shampoo's preconditioners are)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.reshape(p.shape[0], -1)
                state = self.state[p]
                state["precond"] = state.get("precond", torch.zeros(g.shape[1], g.shape[1])) + g.T @ g
                p.add_(p.grad, alpha=-group["lr"])
        return loss


def test_an_optimizer_of_the_users_with_state_not_shaped_like_its_parameters_resumes(tmp_path):
    """Which shapes an optimizer of the user's keeps is its own business: it is checked by class and group keys,
    not against its parameters' shapes."""

    def make(m: Any) -> Any:
        return Preconditioned(m.parameters())

    trainer(tmp_path).fit(Net(make), regression_loader())
    t = trainer(tmp_path, epochs=2)
    t.fit(Net(make), regression_loader(), ckpt_path=str(tmp_path / "c" / "last.ckpt"))
    assert t.global_step == 8 and t.optimizers[0].state_dict()["state"][0]["precond"].shape == (4, 4)
