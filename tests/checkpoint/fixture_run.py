"""The small fit behind ``fixtures/mid_epoch_v1.ckpt``: a checkpoint written by an earlier ember, which
``test_format_compat.py`` resumes and loads to prove that the file format still reads the same.

A module with dropout (so the resume needs the RNG states), Adam and an epoch-interval StepLR, a logged
epoch mean (the epoch's running sums), a datamodule with a state of its own and a ModelCheckpoint that
writes every 3 steps: the file is the one written after step 3, mid-epoch (batch 3 of 8). Writing the
fixture again (``python -c "from tests.checkpoint.fixture_run import write_fixture; write_fixture()"``)
records what the ember of the day writes, so do it only with the code the fixture stands for.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ModelCheckpoint

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
FIXTURE = os.path.join(HERE, "mid_epoch_v1.ckpt")
EXPECTED = os.path.join(HERE, "mid_epoch_v1.json")
#: The step after which the fixture was written (ModelCheckpoint(every_n_train_steps=3)).
SAVED_AT = 3
#: How the ModelCheckpoint state names its files in the fixture: relative to this folder name, not to
#: the temporary directory the fixture was written in.
DIR_IN_FIXTURE = "checkpoints"


class FixtureNet(ember.TrainModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(3, 2)
        self.drop = torch.nn.Dropout(0.25)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layer(self.drop(x)), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


class FixtureData(ember.DataModule):
    """16 samples in batches of 2, shuffled; its state counts the loaders it made."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0

    def train_dataloader(self) -> DataLoader:
        self.made += 1
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(16, 3, generator=g), torch.randn(16, 2, generator=g))
        return DataLoader(data, batch_size=2, shuffle=True)

    def state_dict(self) -> dict[str, Any]:
        return {"made": self.made}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.made = state["made"]


def fit(root: str, ckpt_path: str | None = None) -> tuple[FixtureNet, ember.Trainer]:
    """Two epochs (16 steps), from scratch or resumed from ``ckpt_path``; checkpoints under ``root``."""
    ember.seed_everything(7)
    module = FixtureNet()
    trainer = ember.Trainer(
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=root,
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(root, DIR_IN_FIXTURE), every_n_train_steps=SAVED_AT, save_top_k=-1)
        ],
    )
    trainer.fit(module, datamodule=FixtureData(), ckpt_path=ckpt_path)
    return module, trainer


def weights(module: torch.nn.Module) -> dict[str, list[Any]]:
    return {k: v.tolist() for k, v in module.state_dict().items()}


def _relative(value: Any, root: str) -> Any:
    """``value`` with the paths under ``root`` named relative to it (the fixture names no machine's paths)."""
    if isinstance(value, str) and value.startswith(root + os.sep):
        return os.path.relpath(value, root)
    if isinstance(value, str) and value == root:
        return "."
    if isinstance(value, dict):
        return {k: _relative(v, root) for k, v in value.items()}
    return value


def write_fixture() -> None:
    """Write the fixture and the weights a resume from it ends with (the code of the day's; see above)."""
    with tempfile.TemporaryDirectory() as root:
        whole, _ = fit(os.path.join(root, "whole"))
        first = os.path.join(root, "first")
        fit(first)
        saved = os.path.join(first, DIR_IN_FIXTURE, f"epoch=0-step={SAVED_AT}.ckpt")
        resumed, _ = fit(os.path.join(root, "resumed"), ckpt_path=saved)
        if weights(resumed) != weights(whole):
            raise AssertionError("this ember's mid-epoch resume is not exact: no fixture written")
        ckpt = torch.load(saved, weights_only=True)
        ckpt["callbacks"] = _relative(ckpt["callbacks"], first)
        os.makedirs(HERE, exist_ok=True)
        torch.save(ckpt, FIXTURE)
    with open(EXPECTED, "w", encoding="utf-8") as fh:
        json.dump(
            {
                "written_by": f"ember {ckpt['ember_version']} (torch {ckpt['torch_version']})",
                "saved_at_step": SAVED_AT,
                "final_weights": weights(resumed),
                "keys": list(ckpt),
            },
            fh,
            indent=1,
        )
        fh.write("\n")
