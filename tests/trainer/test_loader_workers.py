"""The worker processes of a stage's loaders end when the stage ends (as Lightning): fit, validate, test and
predict leave no worker alive, persistent ones included, each told to stop and ending on its own (status 0, not
terminated after a wait), and nothing is left for dropping the loaders to wait for."""

from __future__ import annotations

import gc
import multiprocessing
from typing import Any

import pytest
import torch

from tests.helpers.models import BoringModel, fast_trainer, regression_loader

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def workers_loader(**kwargs: Any) -> Any:
    return regression_loader(num_workers=2, persistent_workers=True, **kwargs)


class Predicting(BoringModel):
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self(batch[0])


def children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def workers() -> list[multiprocessing.process.BaseProcess]:
    return multiprocessing.active_children()


def assert_ended_on_their_own(procs: list[multiprocessing.process.BaseProcess]) -> None:
    """Each worker ended by itself, told to stop (status 0): a worker the loader gave up waiting for is
    terminated after seconds (SIGTERM, status -15), and one never told keeps running."""
    assert procs and [p.exitcode for p in procs] == [0] * len(procs), [(p.pid, p.exitcode) for p in procs]


def test_fit_stops_every_loaders_workers_when_it_ends_and_a_second_fit_works():
    before = children()
    during: list[list[multiprocessing.process.BaseProcess]] = []

    class Model(BoringModel):
        def on_validation_epoch_end(self) -> None:  # the train and the validation loader's workers, alive
            during.append([p for p in workers() if p.pid not in before])

    train, val = workers_loader(), workers_loader()
    trainer = fast_trainer(max_epochs=2)
    trainer.fit(Model(), train, val)
    assert len(during[-1]) == 4, during
    assert children() - before == set(), "a loader's worker outlived the fit"
    assert_ended_on_their_own(during[-1])
    assert train._iterator is None and val._iterator is None  # nothing left for dropping them to wait for
    second = Model()
    fast_trainer(max_epochs=1).fit(second, train, val)  # the same loaders start new workers
    assert len(during[-1]) == 4 and children() - before == set()
    assert_ended_on_their_own(during[-1])
    assert second.trainer.global_step == 4
    assert train._iterator is None and val._iterator is None
    del trainer, train, val, second
    gc.collect()
    assert children() - before == set()


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_validate_test_and_predict_stop_their_loaders_workers(stage):
    before = children()
    during: list[list[multiprocessing.process.BaseProcess]] = []

    class Watching(Predicting):
        def on_validation_epoch_end(self) -> None:
            during.append([p for p in workers() if p.pid not in before])

        on_test_epoch_end = on_validation_epoch_end

        def on_predict_epoch_end(self) -> None:
            during.append([p for p in workers() if p.pid not in before])

    loaders = [workers_loader(), workers_loader(n=16)]
    trainer = fast_trainer()
    getattr(trainer, stage)(Watching(), loaders)
    assert all(d._iterator is None for d in loaders)
    assert children() - before == set(), f"a loader's worker outlived {stage}"
    assert_ended_on_their_own(during[-1])
    getattr(trainer, stage)(Watching(), loaders)  # and they run again
    assert children() - before == set()
    assert_ended_on_their_own(during[-1])


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
