"""MLFlowLogger against a real local MLflow tracking store (a file store in tmp_path; no server)."""

from __future__ import annotations

from argparse import Namespace

import pytest

pytest.importorskip("mlflow")

import ember  # noqa: E402
from ember.loggers import MLFlowLogger  # noqa: E402
from tests.helpers.models import BoringModel, OtherRank, regression_loader  # noqa: E402


@pytest.fixture(autouse=True)
def _file_store(monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it for new file stores
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_a_fit_logs_metrics_params_and_status_to_the_store(tmp_path):
    """The default configuration (checkpointing on): metrics at their steps, flattened hyper-parameters, the run
    FINISHED, and the checkpoints under <save_dir>/<experiment id>/<run id>/checkpoints as in Lightning."""
    logger = MLFlowLogger("exp", run_name="first", save_dir=str(tmp_path / "mlruns"), tags={"team": "x"})
    trainer = ember.Trainer(
        max_epochs=2, logger=logger, log_every_n_steps=1, enable_progress_bar=False, default_root_dir=str(tmp_path)
    )
    module = BoringModel()
    module.save_hyperparameters({"lr": 0.1, "opt": {"name": "sgd"}, "ns": Namespace(k=3)})
    trainer.fit(module, regression_loader(n=16), regression_loader(n=8))
    client, run_id = logger.experiment, logger.run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow.runName"] == "first" and run.data.tags["team"] == "x"
    assert run.data.params == {"lr": "0.1", "opt/name": "sgd", "ns/k": "3"}
    assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == [0, 1, 2, 3]
    assert [m.step for m in client.get_metric_history(run_id, "val_loss")] == [1, 3]
    assert client.get_experiment_by_name("exp").experiment_id == logger.name == run.info.experiment_id
    assert logger.version == run_id
    ckpts = tmp_path / "mlruns" / logger.name / run_id / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=1-step=4.ckpt", "last.ckpt"]


def test_a_failed_run_is_marked_failed_and_a_second_logger_continues_a_run(tmp_path):
    class Boom(BoringModel):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    logger = MLFlowLogger("exp", save_dir=str(tmp_path))
    logger.log_hyperparams({"a": 1})  # creates the run before the fit
    trainer = ember.Trainer(max_epochs=1, logger=logger, enable_progress_bar=False, enable_checkpointing=False)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Boom(), regression_loader(n=8))
    assert logger.experiment.get_run(logger.run_id).info.status == "FAILED"
    again = MLFlowLogger(save_dir=str(tmp_path), run_id=logger.run_id, prefix="p")
    again.log_metrics({"x": 2.0}, step=5)
    assert [(m.step, m.value) for m in again.experiment.get_metric_history(logger.run_id, "p-x")] == [(5, 2.0)]


def test_other_ranks_never_touch_the_store(tmp_path):
    logger = MLFlowLogger("exp", save_dir=str(tmp_path / "store"))
    trainer = ember.Trainer(
        max_epochs=1,
        logger=logger,
        strategy=OtherRank(),
        enable_progress_bar=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    trainer.fit(BoringModel(), regression_loader(n=8))
    assert logger.experiment is None and logger.run_id is None
    from mlflow.tracking import MlflowClient

    assert MlflowClient(f"file:{tmp_path / 'store'}").get_experiment_by_name("exp") is None  # nothing created


def test_unsupported_log_model_and_bad_metric_names_are_said(tmp_path):
    with pytest.raises(NotImplementedError, match="log_model"):
        MLFlowLogger(save_dir=str(tmp_path), log_model=True)
    logger = MLFlowLogger(save_dir=str(tmp_path))
    with pytest.warns(RuntimeWarning, match="is logged as 'ab'") as record:
        logger.log_metrics({"a!b": 1.0}, step=0)
    assert record[0].filename == __file__  # the user's line, not ember's (tests/test_warning_origins.py)
    assert ember.loggers.MLFlowLogger is MLFlowLogger


def test_a_test_alone_and_after_a_fit_logs_to_the_run_and_finishes_it(tmp_path):
    """As Lightning 2.6.6: every stage hands its hyper-parameters and metrics to the logger and ends with its
    finalize (the run FINISHED); the test's value at trainer.global_step."""
    logger = MLFlowLogger("exp", save_dir=str(tmp_path / "mlruns"))
    trainer = ember.Trainer(logger=logger, enable_progress_bar=False, default_root_dir=str(tmp_path))
    module = BoringModel()
    module.save_hyperparameters({"lr": 0.1})
    (result,) = trainer.test(module, regression_loader(n=8), verbose=False)
    client, run_id = logger.experiment, logger.run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1"}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "test_loss")] == [(0, result["test_loss"])]
    trainer = ember.Trainer(
        max_epochs=1, logger=logger, enable_progress_bar=False, default_root_dir=str(tmp_path), log_every_n_steps=1
    )
    trainer.fit(module, regression_loader(n=16))  # 2 steps
    (after,) = trainer.test(module, regression_loader(n=8), verbose=False)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "test_loss")] == [
        (0, result["test_loss"]),
        (2, after["test_loss"]),
    ]
    assert client.get_run(run_id).info.status == "FINISHED"
