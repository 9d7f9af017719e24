"""Preemption: how often ranks agree on stopping, and that a signal on any rank stops them all."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.trainer import preemption
from ember.trainer.preemption import PreemptionHandler
from ember.trainer.progress import FitProgress


class _TwoRanks:
    """Stands in for a 2-rank strategy: counts the agreements started and read, and lets a peer report a signal."""

    world_size = 2

    def __init__(self) -> None:
        self.calls = 0
        self.reads = 0
        self.peer_received = False

    def start_decision(self, decision: bool, mode: str = "any") -> SimpleNamespace:
        assert mode == "any"
        self.calls += 1
        agreed = decision or self.peer_received

        def result() -> bool:
            self.reads += 1
            return agreed

        return SimpleNamespace(result=result)


def _handler(strategy: _TwoRanks) -> tuple[PreemptionHandler, list[int]]:
    trainer = SimpleNamespace(
        accumulate_grad_batches=1,
        num_training_batches=1000,
        strategy=strategy,
        progress=FitProgress(),
    )
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
    assert strategy.reads == 3  # the fourth is read at the next boundary, or waited for by finish()
    handler.finish()
    assert strategy.reads == 4
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
    # The first agreement after the signal, read one boundary after it started.
    assert stops == [handler.sync_every + handler.decision_lag]


def test_default_signals_add_sigusr1_under_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert preemption.default_signals() == (signal.SIGTERM,)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert preemption.default_signals() == (signal.SIGTERM, signal.SIGUSR1)


def test_configured_signal_preempts_with_its_exit_status(tmp_path):
    class Net(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)
            return self.layer(batch[0].float().unsqueeze(1)).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = ember.Trainer(max_epochs=1, enable_progress_bar=False, logger=False, default_root_dir=str(tmp_path))
    trainer.preemption_signals = (signal.SIGUSR1,)
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.warns(UserWarning, match="SIGUSR1"), pytest.raises(preemption.Preempted) as info:
        trainer.fit(Net(), DataLoader(TensorDataset(torch.arange(10)), batch_size=2))
    assert info.value.code == 128 + signal.SIGUSR1 == preemption.exit_code(signal.SIGUSR1)
    assert info.value.checkpoint_path == str(tmp_path / "checkpoints" / "last.ckpt")
    assert torch.load(info.value.checkpoint_path, weights_only=True)["progress"]["global_step"] == 3
    assert signal.getsignal(signal.SIGUSR1) is before


class _SignalsAt(ember.TrainModule):
    """Sends itself SIGUSR1 in training_step when global_step reaches ``stop_at`` (None: never)."""

    def __init__(self, stop_at: int | None = None):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.stop_at = stop_at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.stop_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        return self.layer(batch[0].float().unsqueeze(1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _preemptible(root, max_epochs: int) -> ember.Trainer:
    """A default-checkpointing Trainer in ``root`` that SIGUSR1 preempts."""
    t = ember.Trainer(max_epochs=max_epochs, enable_progress_bar=False, logger=False, default_root_dir=str(root))
    t.preemption_signals = (signal.SIGUSR1,)
    return t


def test_a_preempted_second_run_in_the_same_directory_keeps_the_first_runs_last_checkpoint(tmp_path):
    data = DataLoader(TensorDataset(torch.arange(10)), batch_size=2)
    _preemptible(tmp_path, 1).fit(_SignalsAt(), data)
    first = tmp_path / "checkpoints" / "last.ckpt"
    before = first.read_bytes()
    with pytest.warns(UserWarning, match="SIGUSR1"), pytest.raises(preemption.Preempted) as info:
        _preemptible(tmp_path, 1).fit(_SignalsAt(stop_at=2), data)
    # As ModelCheckpoint names a second run's files in one directory (Lightning's -v1), so does preemption.
    assert info.value.checkpoint_path == str(tmp_path / "checkpoints" / "last-v1.ckpt")
    assert first.read_bytes() == before
    assert torch.load(info.value.checkpoint_path, weights_only=True)["progress"]["global_step"] == 3


def test_a_resume_after_preemption_keeps_writing_the_same_last_checkpoint(tmp_path):
    data = DataLoader(TensorDataset(torch.arange(10)), batch_size=2)
    with pytest.warns(UserWarning, match="SIGUSR1"), pytest.raises(preemption.Preempted):
        _preemptible(tmp_path, 2).fit(_SignalsAt(stop_at=2), data)  # before any ModelCheckpoint save point
    _preemptible(tmp_path, 2).fit(_SignalsAt(), data, ckpt_path="last")
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.glob("last*.ckpt")) == ["last.ckpt"]
    assert torch.load(directory / "last.ckpt", weights_only=True)["progress"]["global_step"] == 10
