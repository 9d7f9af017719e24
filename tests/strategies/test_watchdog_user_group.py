"""A process group the user made (not ember's launcher): the ddp hang watchdog still runs, on a store
ember hosts for it (torch has no public way to reach the group's own store)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from tests.helpers.dist import join_as_rank, run_ranks
from tests.helpers.models import TrainOnlyModel

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]


def _fit(rank: int, world_size: int) -> tuple[bool, bool]:
    # As under torchrun, where the script made the group itself (run_ranks has made it): ember joins it.
    join_as_rank(rank, world_size)
    trainer = ember.Trainer(
        strategy="ddp",
        devices=world_size,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    trainer.fit(TrainOnlyModel(), DataLoader(data, batch_size=4))
    watchdog = trainer.strategy.watchdog
    return watchdog is not None, watchdog is not None and watchdog.deadline is not None


def test_the_watchdog_runs_in_a_process_group_the_user_made():
    assert run_ranks(_fit, 2, timeout=120) == [(True, True), (True, True)]
