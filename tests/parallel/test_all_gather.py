"""The differentiable all-gather behind ``all_gather(..., sync_grads=True)``, on 2 real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from ember.parallel.all_gather import all_gather
from tests.helpers.dist import run_ranks

pytestmark = pytest.mark.timeout(90)


def _gather_and_backward(rank: int, world: int) -> dict:
    x = torch.tensor([float(rank + 1)], requires_grad=True)
    gathered = all_gather(x * 1, sync_grads=True)
    # Rank k's loss weighs slice 0 by (k + 1) and slice 1 by 10 (k + 1), so the gradient of rank r's x
    # is the sum over both ranks' losses: 1 + 2 = 3 for rank 0, 10 + 20 = 30 for rank 1.
    (gathered[0] * (rank + 1) + gathered[1] * 10 * (rank + 1)).sum().backward()
    plain = all_gather(x * 1)
    return {"gathered": gathered.detach().tolist(), "grad": x.grad.tolist(), "plain_requires_grad": plain.requires_grad}


@pytest.mark.processes
def test_gradients_reach_every_rank_that_contributed():
    ranks = run_ranks(_gather_and_backward, 2, timeout=80)
    assert [r["gathered"] for r in ranks] == [[[1.0], [2.0]]] * 2
    assert [r["grad"] for r in ranks] == [[3.0], [30.0]]
    assert [r["plain_requires_grad"] for r in ranks] == [False, False]
