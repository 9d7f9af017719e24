"""A parameter that gets no gradient under ``strategy="ddp"``: the error names what a Trainer user writes.

The user never constructs the wrapper, so the engine's "construct the wrapper with find_unused_parameters=True"
would send them looking for a constructor they do not call: under the Trainer the error names
``Trainer(strategy="ddp_find_unused_parameters_true")`` and ``DDPStrategy(find_unused_parameters=True)``, and
the usual causes (``toggle_optimizer`` in manual optimization, a branch that skips layers). The warning that
``find_unused_parameters=True`` found nothing unused names the strategy argument too, once per job (rank 0),
pointing at the user's ``fit`` line. One spawn of two real gloo ranks runs every case; the engine's own words,
for its direct users, are checked in ``tests/parallel/test_reducer.py``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.strategies.ddp_messages import unused_parameter_advice
from tests.helpers.dist import join_as_rank, run_ranks

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]


class WithSpare(ember.TrainModule):
    """``spare`` takes part in the loss only if ``use_spare``."""

    def __init__(self, use_spare: bool) -> None:
        super().__init__()
        self.used, self.spare = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
        self.use_spare = use_spare

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.used(x) + (self.spare(x) if self.use_spare else 0)
        return F.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(strategy: str, use_spare: bool) -> ember.Trainer:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    trainer = ember.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(WithSpare(use_spare), DataLoader(data, batch_size=4))  # the line the warning points at
    return trainer


FIT_LINE = next(
    i
    for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
    if line.endswith("# the line the warning points at")
)


def cases(rank: int, world: int) -> dict:
    join_as_rank(rank, world)
    out: dict = {}
    try:
        fit("ddp", use_spare=False)
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    out["trained"] = fit("ddp_find_unused_parameters_true", use_spare=False).global_step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit("ddp_find_unused_parameters_true", use_spare=True)
    out["warnings"] = [
        (str(w.message), w.filename, w.lineno)
        for w in caught
        if "every parameter received a gradient" in str(w.message)
    ]
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(cases, 2, timeout=80)


def test_the_error_names_the_trainer_argument_and_the_usual_causes_on_every_rank(ranks):
    for rank, r in enumerate(ranks):
        error = r["error"]
        assert error is not None, f"rank {rank} trained with a parameter that got no gradient"
        assert f"received no gradient on rank {rank}: ['spare.weight', 'spare.bias']" in error, error
        assert 'Trainer(strategy="ddp_find_unused_parameters_true")' in error, error
        assert "DDPStrategy(find_unused_parameters=True)" in error, error
        assert "self.toggle_optimizer(opt)" in error and "requires_grad=False" in error, error
        assert "skips layers" in error, error
        assert "construct the wrapper" not in error, error  # the engine's words, for its own users


def test_with_find_unused_parameters_true_it_trains(ranks):
    assert [r["trained"] for r in ranks] == [2, 2]


def test_the_nothing_unused_warning_names_the_strategy_once_per_job_at_the_users_line(ranks):
    (message, filename, lineno), *more = ranks[0]["warnings"]
    assert not more and not ranks[1]["warnings"], ranks  # rank 0 alone: once per job
    assert 'Trainer(strategy="ddp")' in message and "DDPStrategy(find_unused_parameters=False)" in message, message
    assert (filename, lineno) == (__file__, FIT_LINE), message


def test_ddp_spawn_names_its_own_strategies():
    advice = unused_parameter_advice("spawn", warn=True)
    assert 'Trainer(strategy="ddp_spawn_find_unused_parameters_true")' in advice.missing
    assert 'DDPStrategy(find_unused_parameters=True, start_method="spawn")' in advice.missing
    assert 'Trainer(strategy="ddp_spawn")' in (advice.all_used or "")
    assert unused_parameter_advice("popen", warn=False).all_used is None  # the other ranks stay quiet
