"""The Logger members every logger has, as Lightning's: ``group_separator``, ``root_dir``, the no-op
``after_save_checkpoint`` and ``log_graph``; and TensorBoardLogger's ``log_graph``, which writes the graph.

Every expected value was first observed on Lightning 2.6.6 with the same calls, unless a test says that
ember deliberately differs.
"""

from __future__ import annotations

import glob
import os
import warnings
from typing import Any

import pytest
import torch

from ember.loggers import CSVLogger, Logger, TensorBoardLogger
from ember.loggers.logger import DummyLogger
from tests.helpers.models import BoringModel

try:  # imported here, at collection: importing mlflow runs a subprocess (platform's uname)
    import mlflow.tracking
except ImportError:
    mlflow = None


class Minimal(Logger):
    pass


def test_base_members_and_their_defaults(tmp_path):
    for logger in (Minimal(), DummyLogger(), CSVLogger(tmp_path), TensorBoardLogger(tmp_path)):
        assert logger.group_separator == "/"
        assert logger.after_save_checkpoint(object()) is None
        assert logger.log_graph(BoringModel()) is None
        assert logger.log_graph(BoringModel(), torch.zeros(1, 4)) is None
    assert Minimal().root_dir is None and DummyLogger().root_dir is None


def test_root_dir_of_the_file_loggers(tmp_path):
    # <save_dir>/<name>: the directory that holds every version_N.
    assert CSVLogger(tmp_path).root_dir == os.path.join(str(tmp_path), "ember_logs")
    assert TensorBoardLogger(tmp_path, name="exp", version=3).root_dir == os.path.join(str(tmp_path), "exp")
    tb = TensorBoardLogger(tmp_path, name="exp", version=3, sub_dir="sub")
    assert os.path.dirname(os.path.dirname(tb.log_dir)) == tb.root_dir


@pytest.mark.skipif(mlflow is None, reason="needs mlflow")
def test_mlflow_keeps_no_root_dir(tmp_path, monkeypatch):
    from ember.loggers import MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logger = MLFlowLogger(save_dir=str(tmp_path / "mlruns"))
    assert logger.root_dir is None and logger.group_separator == "/"
    assert logger.after_save_checkpoint(object()) is None and logger.log_graph(BoringModel()) is None


# ---------------------------------------------------------------------- TensorBoardLogger.log_graph
def graph_ops(log_dir: Any) -> list[list[str]]:
    """The ops of each graph written under ``log_dir``, one sorted list per event file holding one."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = []
    for path in sorted(glob.glob(os.path.join(str(log_dir), "**", "events.out.tfevents.*"), recursive=True)):
        acc = EventAccumulator(path)
        acc.Reload()
        if acc.Tags().get("graph"):
            found.append(sorted({node.op for node in acc.Graph().node}))
    return found


class WithExample(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(2, 4)
        self.transfers: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).relu()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.transfers.append(f"before {type(batch).__name__} {dataloader_idx}")
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.transfers.append(f"after {type(batch).__name__} {dataloader_idx}")
        return batch


def quiet_log_graph(logger: TensorBoardLogger, *args: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger.log_graph(*args)
    logger.finalize("success")
    return [str(w.message) for w in caught if "Could not log" in str(w.message)]


def test_log_graph_writes_the_traced_graph_when_asked(tmp_path):
    logger = TensorBoardLogger(tmp_path, log_graph=True)
    module = WithExample()  # not attached to a Trainer: tracing reads its trainer property all the same
    assert quiet_log_graph(logger, module) == []
    assert module.transfers == ["before Tensor 0", "after Tensor 0"]  # through its batch-transfer hooks
    (ops,) = graph_ops(logger.log_dir)
    assert "aten::linear" in ops and "aten::relu" in ops
    assert "_exporting" not in module.__dict__  # (the tracing marker is gone)


def test_log_graph_takes_a_given_input_and_a_plain_module(tmp_path):
    logger = TensorBoardLogger(tmp_path, log_graph=True)
    assert quiet_log_graph(logger, torch.nn.Linear(4, 1), torch.zeros(1, 4)) == []
    (ops,) = graph_ops(logger.log_dir)
    assert "aten::linear" in ops


def test_log_graph_does_nothing_unless_asked(tmp_path):
    logger = TensorBoardLogger(tmp_path)  # log_graph=False, Lightning's default
    assert quiet_log_graph(logger, WithExample()) == []
    assert graph_ops(tmp_path) == []


def test_log_graph_warns_without_an_input_it_can_trace(tmp_path):
    logger = TensorBoardLogger(tmp_path, log_graph=True)
    module = WithExample()
    (said,) = quiet_log_graph(logger, module, [torch.zeros(2, 4)])
    assert "is a list, which TensorBoard cannot trace" in said and "tuple" in said
    module.example_input_array = None
    (said,) = quiet_log_graph(logger, module)
    assert "set `model.example_input_array` or pass `input_array`" in said
    assert graph_ops(tmp_path) == []


def test_log_graph_writes_on_rank_zero_only(tmp_path):
    logger = TensorBoardLogger(tmp_path, log_graph=True, version=0)
    logger._rank = 1  # (what setup() records for a worker of a multi-process run)
    assert quiet_log_graph(logger, WithExample()) == []
    assert not os.path.exists(logger.log_dir)


def test_the_trainer_calls_after_save_checkpoint_per_file_and_log_graph_per_run(tmp_path):
    import ember
    from tests.helpers.models import BoringModel, regression_loader

    class Hears(ember.loggers.CSVLogger):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.saves, self.graphs = [], []

        def after_save_checkpoint(self, checkpoint_callback):
            self.saves.append(checkpoint_callback.last_model_path)

        def log_graph(self, model, input_array=None):
            self.graphs.append(type(model).__name__)

    logger = Hears(str(tmp_path))
    trainer = ember.Trainer(max_epochs=2, logger=logger, enable_progress_bar=False, default_root_dir=str(tmp_path))
    trainer.fit(BoringModel(), regression_loader())
    assert len(logger.saves) >= 2 and all(p.endswith("last.ckpt") for p in logger.saves)  # each epoch's save
    assert logger.graphs == ["BoringModel"]
