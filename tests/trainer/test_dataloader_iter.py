"""The ``dataloader_iter`` step signature (Lightning's experimental ``training_step(self, dataloader_iter)``) is
not supported yet: every run refuses it up front, naming the step and the signature to write instead,
rather than handing the step a batch where it expects an iterator."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.models import BoringModel, fast_trainer, regression_loader


class IterTraining(BoringModel):
    def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
        batch, _, _ = next(dataloader_iter)
        return super().training_step(batch, 0)


class IterEvaluation(BoringModel):
    def validation_step(self, dataloader_iter: Any) -> None:  # type: ignore[override]
        next(dataloader_iter)

    def test_step(self, dataloader_iter: Any) -> None:  # type: ignore[override]
        next(dataloader_iter)

    def predict_step(self, dataloader_iter: Any, dataloader_idx: int = 0) -> None:  # type: ignore[override]
        next(dataloader_iter)


@pytest.mark.parametrize(
    ("module", "run", "step"),
    [
        (IterTraining(), "fit", "training_step"),
        (IterEvaluation(), "validate", "validation_step"),
        (IterEvaluation(), "test", "validation_step"),  # the first step found that takes the iterator
        (IterEvaluation(), "predict", "validation_step"),
    ],
)
def test_a_step_taking_dataloader_iter_is_refused_with_what_to_write(module: Any, run: str, step: str) -> None:
    trainer = fast_trainer()
    with pytest.raises(
        NotImplementedError,
        match=rf"{type(module).__name__}\.{step} takes `dataloader_iter`.*"
        rf"define {step}\(self, batch, batch_idx\)",
    ):
        getattr(trainer, run)(module, regression_loader(n=8))
    assert trainer.global_step == 0


def test_a_step_with_batch_and_batch_idx_runs() -> None:
    trainer = fast_trainer()
    trainer.fit(BoringModel(), regression_loader(n=16))
    assert trainer.global_step == 2
