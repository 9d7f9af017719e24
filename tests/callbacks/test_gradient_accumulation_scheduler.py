"""GradientAccumulationScheduler: the accumulation factor per epoch, the steps it gives, its errors, and a
mid-epoch resume that keeps the interrupted epoch's factor."""

from __future__ import annotations

import os

import pytest
import torch

import ember
from ember.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


class StepsPerEpoch(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []
        self._start = 0

    def on_train_epoch_start(self, trainer, module):
        self._start = trainer.global_step

    def on_train_epoch_end(self, trainer, module):
        self.seen.append((trainer.current_epoch, trainer.accumulate_grad_batches, trainer.global_step - self._start))


def test_factor_changes_at_the_scheduled_epochs():
    """8 batches per epoch: 8 steps with factor 1, 4 with 2, 2 with 4 (Lightning's global_step is the same)."""
    rec = StepsPerEpoch()
    trainer = fast_trainer(max_epochs=4, callbacks=[GradientAccumulationScheduler({1: 2, 2: 4}), rec])
    trainer.fit(BoringModel(), regression_loader(n=32, batch_size=4))
    assert rec.seen == [(0, 1, 8), (1, 2, 4), (2, 4, 2), (3, 4, 2)]
    assert trainer.global_step == 16


def test_accumulated_steps_equal_the_trainer_argument():
    """An epoch under factor k trains exactly as Trainer(accumulate_grad_batches=k)."""
    torch.manual_seed(0)
    a, b = BoringModel(), BoringModel()
    b.load_state_dict(a.state_dict())
    fast_trainer(callbacks=[GradientAccumulationScheduler({0: 4})]).fit(a, regression_loader(n=32, batch_size=4))
    fast_trainer(accumulate_grad_batches=4).fit(b, regression_loader(n=32, batch_size=4))
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)


def test_bad_schedules_and_conflicts_are_errors():
    with pytest.raises(TypeError, match="non-empty dict"):
        GradientAccumulationScheduler({})
    with pytest.raises(ValueError, match="epochs"):
        GradientAccumulationScheduler({-1: 2})
    with pytest.raises(ValueError, match="factors"):
        GradientAccumulationScheduler({0: 0})
    assert GradientAccumulationScheduler({3: 2}).get_accumulate_grad_batches(2) == 1  # epochs before: 1
    trainer = fast_trainer(accumulate_grad_batches=2, callbacks=[GradientAccumulationScheduler({0: 4})])
    with pytest.raises(ValueError, match="remove one of them"):
        trainer.fit(BoringModel(), regression_loader(n=16))


class Manual(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def test_manual_optimization_is_refused():
    trainer = fast_trainer(callbacks=[GradientAccumulationScheduler({0: 2})])
    with pytest.raises(RuntimeError, match="automatic_optimization=False"):
        trainer.fit(Manual(), regression_loader(n=16))


def _fit(root, **kwargs):
    ember.seed_everything(0)
    module = BoringModel()
    trainer = ember.Trainer(
        enable_progress_bar=False,
        default_root_dir=root,
        max_epochs=3,
        callbacks=[
            GradientAccumulationScheduler({1: 4}),
            ModelCheckpoint(dirpath=os.path.join(root, "c"), every_n_train_steps=1),
        ],
        **{k: v for k, v in kwargs.items() if k != "ckpt_path"},
    )
    trainer.fit(module, regression_loader(n=32, batch_size=4, shuffle=True), ckpt_path=kwargs.get("ckpt_path"))
    return module, trainer


def test_a_mid_epoch_resume_keeps_the_epochs_factor(tmp_path):
    """Stopped after 9 steps (8 in epoch 0, then one window of 4 of epoch 1's 8 batches): the resumed run must
    accumulate 4 batches per step at once, although on_train_epoch_start does not run for a resumed epoch."""
    ref, ref_trainer = _fit(str(tmp_path / "ref"))
    root = str(tmp_path / "run")
    _fit(root, max_steps=9)
    resumed, trainer = _fit(root, ckpt_path=os.path.join(root, "c", "last.ckpt"))
    assert trainer.global_step == ref_trainer.global_step == 8 + 2 + 2
    for x, y in zip(ref.parameters(), resumed.parameters()):
        assert torch.equal(x, y)
