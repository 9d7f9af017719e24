"""The tuner under ddp, on 2 real gloo ranks: every rank sweeps together (the loss each step records
is the mean over the ranks), so all get the same curve and suggestion; weights are given back on
each rank; the batch-size search runs alike on both and stops at max_val."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ember
from ember.strategies.ddp import DDPStrategy
from ember.tuner import Tuner
from tests.helpers.dist import join_as_rank, run_ranks
from tests.helpers.models import regression_data

pytestmark = pytest.mark.timeout(120)


class Net(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.lr = 0.01
        self.batch_size = 2
        self.sizes: list[int] = []

    def train_dataloader(self):
        return DataLoader(regression_data(256, seed=1), batch_size=self.batch_size, shuffle=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.sizes.append(len(x))
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def tune(rank: int, world: int) -> dict:
    join_as_rank(rank, world)
    ember.seed_everything(rank)  # different shuffles per rank: the ranks' own losses differ
    module = Net()
    before = [t.clone() for t in module.state_dict().values()]
    trainer = ember.Trainer(
        strategy=DDPStrategy(),
        accelerator="cpu",
        devices=world,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        max_epochs=10,
    )
    finder = Tuner(trainer).lr_find(module, num_training=40, min_lr=1e-4, max_lr=10.0)
    restored = all(torch.equal(a, b) for a, b in zip(before, module.state_dict().values()))
    size = Tuner(trainer).scale_batch_size(module, max_val=16, steps_per_trial=2)
    restored_after_sizes = all(torch.equal(a, b) for a, b in zip(before, module.state_dict().values()))
    module.sizes.clear()
    trainer.fit(module)  # then the real fit, at the values found
    return {
        "results": finder.results,
        "lr": module.lr,
        "suggestion": finder.suggestion(),
        "restored": restored,
        "size": size,
        "restored_after_sizes": restored_after_sizes,
        "fit_sizes": sorted(set(module.sizes)),
        "steps": trainer.global_step,
    }


@pytest.mark.processes
def test_ranks_sweep_together_and_get_the_same_suggestion_and_size():
    r0, r1 = run_ranks(tune, 2, timeout=110)
    assert r0["results"] == r1["results"]  # one curve: the mean over the ranks
    assert len(r0["results"]["lr"]) < 40  # lr up to 10 diverges, and both ranks stopped at the same step
    assert r0["suggestion"] == r1["suggestion"] == r0["lr"] == r1["lr"] is not None
    assert r0["restored"] and r1["restored"] and r0["restored_after_sizes"] and r1["restored_after_sizes"]
    assert r0["size"] == r1["size"] == 16
    assert r0["fit_sizes"] == r1["fit_sizes"] == [16]
    assert r0["steps"] == r1["steps"] == 10 * (256 // 2 // 16)  # each rank: half of the 256 samples per epoch
