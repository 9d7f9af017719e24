"""Preemption: how often ranks agree on stopping, and that a signal on any rank stops them all."""
from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from ember.trainer.preemption import PreemptionHandler


class _TwoRanks:
    """Stands in for a 2-rank strategy: counts the agreements and lets a peer report a signal."""

    world_size = 2

    def __init__(self) -> None:
        self.calls = 0
        self.peer_received = False

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        self.calls += 1
        return decision or self.peer_received


def _handler(strategy: _TwoRanks) -> tuple[PreemptionHandler, list[int]]:
    trainer = SimpleNamespace(accumulate_grad_batches=1, num_training_batches=1000, strategy=strategy,
                              progress=SimpleNamespace(batch_in_epoch=0))
    handler = PreemptionHandler(trainer, (signal.SIGTERM,))
    stops: list[int] = []
    handler.stop = lambda: stops.append(trainer.progress.batch_in_epoch)  # saving is tested elsewhere
    return handler, stops


def test_ranks_agree_once_every_sync_every_boundaries():
    strategy = _TwoRanks()
    handler, stops = _handler(strategy)
    for step in range(1, 33):
        handler.trainer.progress.batch_in_epoch = step
        handler.check()
    assert strategy.calls == 32 // handler.sync_every == 4
    assert stops == []


@pytest.mark.parametrize("own_signal", [True, False])
def test_a_signal_on_any_rank_stops_at_the_next_agreement(own_signal):
    strategy = _TwoRanks()
    handler, stops = _handler(strategy)
    for step in range(1, 20):
        handler.trainer.progress.batch_in_epoch = step
        if step == 3:
            if own_signal:
                handler.received = signal.SIGTERM
            else:
                strategy.peer_received = True
        handler.check()
        if stops:
            break
    assert stops == [handler.sync_every]  # the first agreement after the signal
