"""Loading a PyTorch Lightning checkpoint: load_from_checkpoint builds the module from its hyper-parameters and
weights, ember.load_lightning_checkpoint reads it, both refuse pickled objects unless told the file is trusted,
and a fit refuses to resume from one with what to do instead.

The files are written here by hand in Lightning 2.6's format (the keys and value types of a checkpoint that
pytorch-lightning 2.6.6's Trainer.save_checkpoint wrote, checked once against such a file); the suite does not
depend on Lightning.
"""

from __future__ import annotations

import pathlib
from collections import OrderedDict

import pytest
import torch

import ember
from ember.checkpoint import CheckpointError
from tests.helpers.models import fast_trainer, regression_loader


class Net(ember.TrainModule):
    def __init__(self, hidden: int = 3, lr: float = 0.1, data_dir: object = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.l = torch.nn.Linear(4, hidden)
        self.o = torch.nn.Linear(hidden, 1)

    def training_step(self, batch, batch_idx):
        return self.o(self.l(batch[0])).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def lightning_file(path: pathlib.Path, hyper_parameters: dict, state_dict: dict) -> str:
    torch.save(
        {
            "epoch": 1,
            "global_step": 4,
            "pytorch-lightning_version": "2.6.6",
            "state_dict": OrderedDict(state_dict),
            "loops": {
                "fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1, "completed": 1}}},
                "validate_loop": {},
                "test_loop": {},
                "predict_loop": {},
            },
            "callbacks": {"ModelCheckpoint{'monitor': None, 'mode': 'min'}": {"best_model_score": None}},
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.2, "params": [0, 1, 2, 3]}]}],
            "lr_schedulers": [],
            "hparams_name": "kwargs",
            "hyper_parameters": hyper_parameters,
        },
        path,
    )
    return str(path)


def weights(hidden: int) -> dict:
    torch.manual_seed(1)
    return {k: v.clone() for k, v in Net(hidden).state_dict().items()}


def test_load_from_checkpoint_builds_the_module_from_a_lightning_file(tmp_path):
    saved = weights(5)
    path = lightning_file(tmp_path / "lightning.ckpt", {"hidden": 5, "lr": 0.2}, saved)
    module = Net.load_from_checkpoint(path)
    assert module.hparams == {"hidden": 5, "lr": 0.2, "data_dir": None}
    assert all(torch.equal(saved[k], v) for k, v in module.state_dict().items())
    # overrides win, as for ember's own files, and the module trains on from there
    assert Net.load_from_checkpoint(path, lr=0.5).hparams.lr == 0.5
    fast_trainer(max_steps=1).fit(module, regression_loader())


def test_load_lightning_checkpoint_returns_its_contents_and_refuses_an_ember_file(tmp_path):
    path = lightning_file(tmp_path / "lightning.ckpt", {"hidden": 5}, weights(5))
    ckpt = ember.load_lightning_checkpoint(path)
    assert (ckpt["epoch"], ckpt["global_step"], ckpt["hyper_parameters"]) == (1, 4, {"hidden": 5})
    trainer = fast_trainer(max_steps=1)
    trainer.fit(Net(), regression_loader())
    trainer.save_checkpoint(tmp_path / "ember.ckpt")
    with pytest.raises(CheckpointError, match="an ember checkpoint, not a Lightning one"):
        ember.load_lightning_checkpoint(tmp_path / "ember.ckpt")


def test_pickled_objects_are_refused_unless_the_file_is_trusted(tmp_path):
    path = lightning_file(
        tmp_path / "lightning.ckpt", {"hidden": 5, "data_dir": pathlib.PurePosixPath("data")}, weights(5)
    )
    with pytest.raises(CheckpointError, match="pass weights_only=False"):
        Net.load_from_checkpoint(path)
    with pytest.raises(CheckpointError, match="pass weights_only=False"):
        ember.load_lightning_checkpoint(path)
    module = Net.load_from_checkpoint(path, weights_only=False)
    assert module.hparams.data_dir == pathlib.PurePosixPath("data")


def test_a_fit_does_not_resume_from_a_lightning_file_and_says_what_to_do(tmp_path):
    path = lightning_file(tmp_path / "lightning.ckpt", {"hidden": 5}, weights(5))
    with pytest.raises(CheckpointError, match=r"Lightning checkpoint: YourModule\.load_from_checkpoint\(path\)"):
        fast_trainer(max_steps=1).fit(Net(5), regression_loader(), ckpt_path=path)


def test_a_lightning_file_for_another_model_names_the_mismatch(tmp_path):
    path = lightning_file(tmp_path / "lightning.ckpt", {"hidden": 5}, weights(6))
    with pytest.raises(CheckpointError, match="shape mismatches: l.weight"):
        Net.load_from_checkpoint(path)
