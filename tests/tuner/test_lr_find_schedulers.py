"""``Tuner.lr_find`` with the user's LR schedulers: the sweep's schedule alone sets the rate, so the sweep
records the same rates, losses and suggestion with or without one (Lightning's sweep sets them aside
too); afterwards the schedulers and the optimizer are as the sweep found them, and the real fit
schedules as it would have without lr_find."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.tuner import Tuner
from tests.helpers.models import regression_loader

Sched = Callable[[torch.optim.Optimizer], Any]

SCHEDULERS: dict[str, Sched] = {
    # cycle_momentum=False: with it, OneCycleLR's constructor sets the optimizer's momentum to its own, and
    # the sweep trains with the optimizer as configure_optimizers left it (as Lightning's does).
    "OneCycleLR": lambda opt: {
        "scheduler": torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=1000, cycle_momentum=False),
        "interval": "step",
    },
    "StepLR per step": lambda opt: {
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
        "interval": "step",
    },
    "StepLR per epoch": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
    # Monitors a validation metric, which the sweep never computes: it does not validate.
    "ReduceLROnPlateau": lambda opt: {
        "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.1, patience=0),
        "monitor": "val_loss",
    },
}


class Net(ember.TrainModule):
    """SGD with momentum on a linear regression, with ``sched`` (when given) as its LR scheduler.

    ``kept``: the optimizer and scheduler are built at the first ``configure_optimizers`` call and
    returned again by later ones (objects that outlive one fit).
    """

    def __init__(self, sched: Sched | None = None, kept: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.lr = 0.01
        self.sched, self.kept = sched, kept
        self.built: list[tuple[Any, dict[str, Any]]] = []  # (scheduler, its state when built)
        self.rates: list[float] = []  # the rate of each training step
        self.losses: list[float] = []
        self._configured: Any = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.rates.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self):
        if self.kept and self._configured is not None:
            return self._configured
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        configured: Any = opt
        if self.sched is not None:
            configured = {"optimizer": opt, "lr_scheduler": self.sched(opt)}
            config = configured["lr_scheduler"]
            scheduler = config["scheduler"] if isinstance(config, dict) else config
            self.built.append((scheduler, copy.deepcopy(scheduler.state_dict())))
        self._configured = configured
        return configured


def trainer(tmp_path, **kwargs: Any) -> ember.Trainer:
    return ember.Trainer(
        accelerator="cpu", default_root_dir=tmp_path, logger=False, enable_progress_bar=False, **kwargs
    )


def loaders() -> tuple[Any, Any]:
    """Training (4 batches) and validation data."""
    return regression_loader(n=32, batch_size=8), regression_loader(n=16, seed=1)


def sweep(tmp_path, module: Net, t: ember.Trainer | None = None, **kwargs: Any) -> Any:
    # 4 batches an epoch: 30 steps span 8 epochs, so epoch-interval schedulers would step 7 times.
    kwargs = {"min_lr": 1e-5, "max_lr": 1.0, "num_training": 30, "update_attr": False, **kwargs}
    return Tuner(t or trainer(tmp_path)).lr_find(module, *loaders(), **kwargs)


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_a_users_scheduler_changes_nothing_in_the_sweep_and_is_given_back_as_found(tmp_path, name):
    plain = sweep(tmp_path, Net())
    module = Net(SCHEDULERS[name])
    t = trainer(tmp_path)
    found = sweep(tmp_path, module, t)
    assert found.results == plain.results  # the very same rates and losses
    assert found.suggestion() == plain.suggestion() is not None
    assert found.results["lr"][0] == 1e-5 and found.results["lr"][-1] == pytest.approx(1.0)
    # The scheduler is the trainer's again, in the state configure_optimizers built it in (never stepped),
    # and the optimizer's rate is the one it set (OneCycleLR's own start: max_lr / 25).
    ((scheduler, built_state),) = module.built
    assert [c.scheduler for c in t.lr_scheduler_configs] == [scheduler]
    assert scheduler.state_dict() == built_state
    start = 0.1 / 25 if name == "OneCycleLR" else 0.01
    assert [g["lr"] for g in t.optimizers[0].param_groups] == [pytest.approx(start)]
    assert t.optimizers[0].state_dict()["state"] == {}  # no momentum buffer left from the sweep


@pytest.mark.parametrize("kept", [False, True], ids=["built-per-fit", "built-once"])
@pytest.mark.parametrize("name", ["StepLR per step", "StepLR per epoch"])
def test_after_lr_find_the_fit_schedules_as_without_it(tmp_path, name, kept):
    def fit(module: Net) -> tuple[list[float], list[float]]:
        module.rates.clear()
        module.losses.clear()
        trainer(tmp_path, max_epochs=3).fit(module, *loaders())
        return module.rates, module.losses

    alone = fit(Net(SCHEDULERS[name], kept=kept))
    module = Net(SCHEDULERS[name], kept=kept)
    sweep(tmp_path, module)
    assert fit(module) == alone  # rates and losses: the scheduler and the optimizer start where they would


def test_with_update_attr_the_fit_schedules_from_the_suggested_rate(tmp_path):
    alone = Net(SCHEDULERS["StepLR per step"])
    trainer(tmp_path, max_epochs=2).fit(alone, *loaders())
    module = Net(SCHEDULERS["StepLR per step"])
    finder = sweep(tmp_path, module, update_attr=True)
    assert module.lr == finder.suggestion() != 0.01
    module.rates.clear()
    trainer(tmp_path, max_epochs=2).fit(module, *loaders())
    assert module.rates == pytest.approx([r / 0.01 * module.lr for r in alone.rates], rel=1e-12)


class ManualNet(Net):
    """Manual optimization, with a scheduler stepped before the optimizer (a warm-up written by hand)."""

    def __init__(self, sched: Sched | None = None) -> None:
        super().__init__(sched)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            with warnings.catch_warnings():  # (torch's warning for this order, which is the point here)
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step", category=UserWarning)
                scheduler.step()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss  # what the sweep records


def test_in_manual_optimization_the_modules_scheduler_cannot_move_the_rate(tmp_path):
    plain = sweep(tmp_path, ManualNet())
    module = ManualNet(lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    t = trainer(tmp_path)
    found = sweep(tmp_path, module, t)
    assert found.results == plain.results
    assert len(module.rates) == 30  # the module's lr_schedulers() gave it its scheduler at every step
    ((scheduler, built_state),) = module.built
    assert scheduler.state_dict() == built_state  # the 30 steps it took are undone
    assert t.optimizers[0].param_groups[0]["lr"] == 0.01


def test_a_sweep_that_raises_gives_the_scheduler_back_too(tmp_path):
    class Failing(Net):
        def training_step(self, batch, batch_idx):
            if len(self.rates) == 5:
                raise RuntimeError("the module failed")
            return super().training_step(batch, batch_idx)

    module = Failing(SCHEDULERS["StepLR per step"])
    t = trainer(tmp_path)
    with pytest.raises(RuntimeError, match="the module failed"):
        sweep(tmp_path, module, t)
    ((scheduler, built_state),) = module.built
    assert [c.scheduler for c in t.lr_scheduler_configs] == [scheduler]
    assert scheduler.state_dict() == built_state
    assert t.optimizers[0].param_groups[0]["lr"] == 0.01
