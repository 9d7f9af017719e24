"""A hyper-parameter that a checkpoint cannot hold as plain data (Lightning pickles it): what ember does."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import BoringModel, fast_trainer, regression_loader


class WithLoss(BoringModel):
    def __init__(self, batch_size: int = 64, my_loss: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.my_loss = my_loss if my_loss is not None else torch.nn.MSELoss()


def test_it_is_left_out_with_a_warning_saying_how_to_give_it_back(tmp_path):
    trainer = fast_trainer(max_steps=1)
    trainer.fit(WithLoss(batch_size=179, my_loss=torch.nn.L1Loss()), regression_loader(n=8))
    path = str(tmp_path / "m.ckpt")
    with pytest.warns(UserWarning, match=r"'my_loss' \(L1Loss\).*load_from_checkpoint.*my_loss=\.\.\..*ignore"):
        trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["hyper_parameters"]
    assert saved == {"batch_size": 179}
    assert isinstance(WithLoss.load_from_checkpoint(path).my_loss, torch.nn.MSELoss)  # the default
    again = WithLoss.load_from_checkpoint(path, my_loss=torch.nn.L1Loss())
    assert isinstance(again.hparams.my_loss, torch.nn.L1Loss) and again.hparams.batch_size == 179
