"""Fixtures shared by the tests of ember.parallel."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def group():
    """A one-rank gloo process group in this process, destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
