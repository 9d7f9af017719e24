"""What validate / test return per loader, and what ``trainer.logged_metrics`` holds, as Lightning's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ember.callbacks import Callback
from tests.helpers.models import BoringModel, RecordingLogger, fast_trainer, regression_loader, value_loader


class PerLoader(BoringModel):
    """Logs, from each of several test loaders, a shared name, a name of its own without the loader index,
    a value kept from the loggers, and step values; and one value in each epoch hook."""

    def on_test_epoch_start(self) -> None:
        self.log("at_start", 5.0)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("shared", float(dataloader_idx + 1))
        self.log(f"own_{dataloader_idx}", 10.0 * (dataloader_idx + 1), add_dataloader_idx=False)
        self.log("not_logged", 1.0, logger=False)
        self.log("step_only", 2.0, on_step=True, on_epoch=False)
        self.log("both", 3.0, on_step=True, on_epoch=True)

    def on_test_epoch_end(self) -> None:
        self.log("at_end", 6.0)


@pytest.mark.parametrize("logger", [False, True])
def test_each_loader_result_holds_its_own_logger_bound_epoch_values_and_the_epoch_hooks_values(logger):
    trainer = fast_trainer(logger=RecordingLogger() if logger else False)
    results = trainer.test(PerLoader(), [value_loader([1.0, 2.0]), value_loader([3.0])], verbose=False)
    common = {"at_start": 5.0, "at_end": 6.0}
    assert results == [
        {"shared/dataloader_idx_0": 1.0, "own_0": 10.0, "both_epoch/dataloader_idx_0": 3.0, **common},
        {"shared/dataloader_idx_1": 2.0, "own_1": 20.0, "both_epoch/dataloader_idx_1": 3.0, **common},
    ]
    # logger=False values are for callbacks only: not returned, not in logged_metrics.
    assert trainer.callback_metrics["not_logged/dataloader_idx_1"] == 1.0
    assert not any(k.startswith("not_logged") for k in trainer.logged_metrics)
    # The step values are in logged_metrics with or without a logger, as in Lightning.
    assert trainer.logged_metrics["step_only/dataloader_idx_0"] == 2.0
    assert trainer.logged_metrics["both_step/dataloader_idx_1"] == 3.0
    assert set(trainer.logged_metrics) == {
        *(k for r in results for k in r),
        "step_only/dataloader_idx_0",
        "step_only/dataloader_idx_1",
        "both_step/dataloader_idx_0",
        "both_step/dataloader_idx_1",
    }
    if logger:
        written = {k for _, m in trainer.logger.records for k in m}
        assert not any(k.startswith("not_logged") for k in written)
        assert "step_only/dataloader_idx_1" in written and "own_1" in written


def test_one_loader_result_leaves_out_values_logged_with_logger_false():
    class Model(BoringModel):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.log("kept", 1.0)
            self.log("for_callbacks", torch.tensor(2.0), logger=False, prog_bar=True)

    trainer = fast_trainer()
    results = trainer.validate(Model(), regression_loader(n=8), verbose=False)
    assert results == [{"kept": 1.0}]
    assert trainer.callback_metrics["for_callbacks"] == 2.0
    assert "for_callbacks" not in trainer.logged_metrics


def test_validation_step_values_are_in_logged_metrics_without_a_logger():
    class Model(BoringModel):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.log("val_step", float(batch_idx), on_step=True, on_epoch=False)

    trainer = fast_trainer(num_sanity_val_steps=0, limit_train_batches=1)
    trainer.fit(Model(), regression_loader(n=8), regression_loader(n=24))
    assert trainer.logged_metrics["val_step"] == 2.0  # the last of the three validation batches
    trainer.validate(trainer.model, regression_loader(n=16), verbose=False)
    assert trainer.logged_metrics == {"val_step": 1.0}


class EvalLogs(Callback):
    """Logs from evaluation hooks with the callback's own ``self.log`` / ``self.log_dict``."""

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.log("val_batch", float(batch_idx))

    def on_validation_epoch_end(self, trainer, module):
        self.log("val_end", 2.0)

    def on_train_epoch_end(self, trainer, module):
        self.log("train_end", 3.0, prog_bar=True)

    def on_test_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.log_dict({"test_batch": float(batch_idx)}, on_step=True)


def test_a_callback_logs_from_evaluation_hooks_with_the_hooks_defaults():
    # Lightning 2.6.6 (limit_val_batches=3, limit_test_batches=2): callback_metrics and logged_metrics
    # {'train_end': 3, 'val_batch': 1, 'val_end': 2}, progress bar ['train_end'] (plus the module's own);
    # test returns [{'test_batch_epoch': 0.5}] and logged_metrics gains test_batch_step 1.
    trainer = fast_trainer(limit_train_batches=2, limit_val_batches=3, num_sanity_val_steps=0, callbacks=[EvalLogs()])
    module = BoringModel()
    trainer.fit(module, regression_loader(n=16, batch_size=4), regression_loader(n=16, batch_size=4))
    mine = {"train_end": 3.0, "val_batch": 1.0, "val_end": 2.0}
    assert {k: v for k, v in trainer.callback_metrics.items() if k in mine} == mine
    assert {k: v for k, v in trainer.logged_metrics.items() if k in mine} == mine
    assert "train_end" in trainer.progress_bar_metrics and "val_end" not in trainer.progress_bar_metrics
    results = trainer.test(module, regression_loader(n=8, batch_size=4), verbose=False)
    assert results == [{"test_loss": results[0]["test_loss"], "test_batch_epoch": 0.5}]
    assert trainer.logged_metrics["test_batch_step"] == 1.0


def test_a_callback_that_defines_its_own_log_keeps_it():
    # Lightning 2.6.6 replaces it with the module's log, so a callback's own log(msg) raises a TypeError
    # there (a missing 'value'); ember gives the module's log only to callbacks without one.
    class OwnLog(Callback):
        def __init__(self) -> None:
            self.messages: list[str] = []

        def log(self, message: str) -> None:
            self.messages.append(message)

        def on_train_start(self, trainer, module):
            self.log("started")

    cb = OwnLog()
    fast_trainer(max_steps=1, callbacks=[cb]).fit(BoringModel(), regression_loader(n=8))
    assert cb.messages == ["started"]


def test_the_loggers_get_the_epoch_and_logged_metrics_does_not_unless_the_module_logs_it():
    logger = RecordingLogger()
    trainer = fast_trainer(logger=logger, log_every_n_steps=1, max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(BoringModel(), regression_loader(n=8), regression_loader(n=8))
    assert [m["epoch"] for _, m in logger.records if "val_loss" in m] == [0.0, 1.0]
    assert "epoch" not in trainer.logged_metrics and "val_loss" in trainer.logged_metrics

    class LogsEpoch(BoringModel):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.log("epoch", 7.0)

    trainer = fast_trainer(logger=RecordingLogger(), num_sanity_val_steps=0)
    trainer.fit(LogsEpoch(), regression_loader(n=8), regression_loader(n=8))
    assert trainer.logged_metrics["epoch"] == 7.0
