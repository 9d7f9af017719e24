"""More CPU ranks than cores on one machine: a warning that says so and what to do."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from ember.strategies.ddp import DDPStrategy
from ember.strategies.ddp_messages import oversubscription_message


def test_message_only_when_ranks_outnumber_cores():
    assert oversubscription_message(2, 2) is None and oversubscription_message(1, 4) is None
    message = oversubscription_message(4, 2)
    assert message is not None
    assert "4 CPU ranks" in message and "2 core(s)" in message and "devices=2" in message


@pytest.mark.parametrize("omp", [None, "1"])
def test_the_ddp_strategy_warns_on_local_rank_zero(monkeypatch, omp):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)  # a chosen thread count does not silence the warning
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    strategy = DDPStrategy(accelerator="cpu", devices=[torch.device("cpu")] * 4)
    threads = torch.get_num_threads()
    try:
        with pytest.warns(UserWarning, match="4 CPU ranks run on this machine, which has 2 core"):
            strategy._share_cpu_threads(4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            strategy._share_cpu_threads(2)  # as many ranks as cores: quiet
    finally:
        torch.set_num_threads(threads)
