"""The worker processes of a stage's loaders end when the stage ends (as Lightning): fit, validate, test and
predict leave no worker alive, persistent ones included, and dropping the loaders afterwards is immediate."""

from __future__ import annotations

import gc
import multiprocessing
import time
from typing import Any

import pytest
import torch

from ember.callbacks import Callback
from tests.helpers.models import BoringModel, fast_trainer, regression_loader

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def workers_loader(**kwargs: Any) -> Any:
    return regression_loader(num_workers=2, persistent_workers=True, **kwargs)


class TeardownClock(Callback):
    """The time the stage's ``teardown`` hook ran: the loaders' workers are stopped after it."""

    def __init__(self) -> None:
        self.at = 0.0

    def teardown(self, trainer: Any, module: Any, stage: str) -> None:
        self.at = time.monotonic()


class Predicting(BoringModel):
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self(batch[0])


def children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def test_fit_stops_every_loaders_workers_when_it_ends_and_a_second_fit_works():
    before = children()
    during: list[int] = []

    class Model(BoringModel):
        def on_validation_epoch_end(self) -> None:  # the train and the validation loader's workers, alive
            during.append(len(children() - before))

    clock = TeardownClock()
    train, val = workers_loader(), workers_loader()
    trainer = fast_trainer(max_epochs=2, callbacks=[clock])
    trainer.fit(Model(), train, val)
    returned = time.monotonic()
    assert during[-1] == 4, during
    assert children() - before == set(), "a loader's worker outlived the fit"
    assert returned - clock.at < 1.0, f"stopping the workers took {returned - clock.at:.2f} s"
    second = Model()
    fast_trainer(max_epochs=1).fit(second, train, val)  # the same loaders start new workers
    assert during[-1] == 4 and children() - before == set()
    assert second.trainer.global_step == 4
    start = time.monotonic()
    del trainer, train, val, second
    gc.collect()
    assert time.monotonic() - start < 1.0, "dropping the loaders waited for their workers"


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_validate_test_and_predict_stop_their_loaders_workers(stage):
    before = children()
    clock = TeardownClock()
    loaders = [workers_loader(), workers_loader(n=16)]
    trainer = fast_trainer(callbacks=[clock])
    getattr(trainer, stage)(Predicting(), loaders)
    returned = time.monotonic()
    assert all(d._iterator is None for d in loaders)
    assert children() - before == set(), f"a loader's worker outlived {stage}"
    assert returned - clock.at < 1.0, f"stopping the workers took {returned - clock.at:.2f} s"
    getattr(trainer, stage)(Predicting(), loaders)  # and they run again
    assert children() - before == set()


def test_a_combined_loaders_inner_loaders_and_a_reloaded_validation_loader_are_stopped():
    """The inner loaders of a CombinedLoader each; a validation loader a reload replaces, when it is replaced."""
    before = children()
    made: list[Any] = []
    replaced: list[bool] = []

    class Reloading(BoringModel):
        def train_dataloader(self) -> Any:
            return {"a": workers_loader(), "b": workers_loader(n=16)}

        def val_dataloader(self) -> Any:
            made.append(workers_loader())
            return made[-1]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(batch["a"], batch_idx)

        def on_validation_start(self) -> None:
            if self.current_epoch == 2:  # the reload has just replaced the first validation loader
                replaced.append(len(made) == 2 and made[0]._iterator is None)

    trainer = fast_trainer(max_epochs=3, reload_dataloaders_every_n_epochs=2, num_sanity_val_steps=0)
    trainer.fit(Reloading())
    assert replaced == [True]
    assert len(made) == 2 and children() - before == set()
