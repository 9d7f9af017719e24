"""A DataModule's state in a checkpoint: where Lightning puts it, and every way it comes back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ember
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


class Stateful(ember.DataModule):
    def __init__(self, state: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.state = state if state is not None else {"seen": 7}
        self.loaded: list[dict[str, Any]] = []

    def train_dataloader(self):
        return regression_loader(n=8)

    def val_dataloader(self):
        return regression_loader(n=8)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded.append(state_dict)


def _fit_and_save(tmp_path, dm: ember.DataModule) -> str:
    trainer = fast_trainer(num_sanity_val_steps=0)
    trainer.fit(BoringModel(), datamodule=dm)
    path = str(tmp_path / "dm.ckpt")
    trainer.save_checkpoint(path)
    return path


def test_the_state_is_saved_under_the_class_qualname_and_restored_by_every_entry_point(tmp_path):
    path = _fit_and_save(tmp_path, Stateful())
    ckpt = torch.load(path, weights_only=True)
    assert ckpt[Stateful.__qualname__] == {"seen": 7}
    assert "datamodule" not in ckpt
    for run in ("fit", "validate", "test"):
        dm = Stateful()
        trainer = fast_trainer(max_epochs=2, num_sanity_val_steps=0)
        if run == "fit":
            trainer.fit(BoringModel(), datamodule=dm, ckpt_path=path)
        elif run == "validate":
            trainer.validate(BoringModel(), datamodule=dm, ckpt_path=path, verbose=False)
        else:
            dm.test_dataloader = lambda: regression_loader(n=8)  # type: ignore[method-assign]
            trainer.test(BoringModel(), datamodule=dm, ckpt_path=path, verbose=False)
        assert dm.loaded == [{"seen": 7}], run
    assert Stateful.load_from_checkpoint(path).loaded == [{"seen": 7}]


def test_an_empty_state_is_not_saved_and_not_loaded(tmp_path):
    path = _fit_and_save(tmp_path, Stateful(state={}))
    assert Stateful.__qualname__ not in torch.load(path, weights_only=True)
    dm = Stateful()
    fast_trainer(max_epochs=2, num_sanity_val_steps=0).fit(BoringModel(), datamodule=dm, ckpt_path=path)
    assert dm.loaded == []


def test_a_checkpoint_of_an_earlier_ember_version_still_restores_the_state(tmp_path):
    path = _fit_and_save(tmp_path, Stateful())
    ckpt = torch.load(path, weights_only=True)
    ckpt["datamodule"] = ckpt.pop(Stateful.__qualname__)
    old = str(tmp_path / "old.ckpt")
    torch.save(ckpt, old)
    assert Stateful.load_from_checkpoint(old).loaded == [{"seen": 7}]


def test_a_class_name_that_is_a_checkpoint_entry_is_refused_with_what_to_do(tmp_path):
    Clash = type("epoch", (Stateful,), {})  # a class named like the checkpoint's own "epoch" entry
    trainer = fast_trainer(num_sanity_val_steps=0)
    trainer.fit(BoringModel(), datamodule=Clash())
    with pytest.raises(ValueError, match=r"'epoch'.*Rename the datamodule class"):
        trainer.save_checkpoint(str(tmp_path / "x.ckpt"))
