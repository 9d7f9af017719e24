"""MLFlowLogger: metrics and hyper-parameters to an MLflow tracking store, as Lightning's.

The ``mlflow`` package (``mlflow-skinny`` is enough) is imported when the logger is built, so
``import ember.loggers`` works without it. Only global rank zero talks to the tracking store: on the
other ranks the run is never created and the writes are no-ops.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from argparse import Namespace
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ember.loggers.logger import Logger, hparams_dict
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer
    from ember.types import Stage

LOCAL_FILE_URI_PREFIX = "file:"
_STATUS = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``a/b`` keys, as Lightning flattens hyper-parameters for MLflow."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, Namespace):
            v = vars(v)
        if isinstance(v, Mapping):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


class MLFlowLogger(Logger):
    """Log to MLflow: one run in experiment ``experiment_name`` (created if missing).

    Args:
        experiment_name: the experiment the run goes into.
        run_name: the run's name (the ``mlflow.runName`` tag).
        tracking_uri: where the tracking store is (``sqlite:///path/mlflow.db``, ``file:path``,
            ``http://server``); default ``$MLFLOW_TRACKING_URI``, else ``file:<save_dir>``.
        tags: tags of the new run.
        save_dir: the directory of the default ``file:`` store. (MLflow 3 refuses new file stores
            unless ``MLFLOW_ALLOW_FILE_STORE=true``; a ``sqlite:`` URI needs no server either.)
        log_model: only False: uploading checkpoints as artifacts is not supported yet.
        prefix: put in front of every metric name (joined with ``-``).
        artifact_location: where a newly created experiment keeps its artifacts.
        run_id: continue this existing run instead of creating one.
        synchronous: passed to MLflow's ``log_batch`` (None: MLflow's default).

    Raises:
        ModuleNotFoundError: without the ``mlflow`` package (``pip install mlflow-skinny``).
        NotImplementedError: for ``log_model`` other than False.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        experiment_name: str = "lightning_logs",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: dict[str, Any] | None = None,
        save_dir: str | None = "./mlruns",
        log_model: bool | str = False,
        prefix: str = "",
        artifact_location: str | None = None,
        run_id: str | None = None,
        synchronous: bool | None = None,
    ) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(
                "MLFlowLogger needs the mlflow package: pip install mlflow-skinny (or pip install 'ember[loggers]')."
            ) from err
        if log_model is not False:
            raise NotImplementedError(
                f"MLFlowLogger(log_model={log_model!r}) is not supported by ember yet: "
                "checkpoints stay in the ModelCheckpoint directory. Use log_model=False."
            )
        tracking_uri = tracking_uri or os.getenv("MLFLOW_TRACKING_URI") or f"{LOCAL_FILE_URI_PREFIX}{save_dir}"
        self._experiment_name = experiment_name
        self._experiment_id: str | None = None
        self._tracking_uri = tracking_uri
        self._run_name = run_name
        self._run_id = run_id
        self.tags = dict(tags) if tags else {}
        self._prefix = prefix
        self._artifact_location = artifact_location
        self._log_batch_kwargs = {} if synchronous is None else {"synchronous": synchronous}
        self._initialized = False
        self._rank = int(os.environ.get("RANK", 0))  # exact once setup runs; guards the store until then
        self._client = MlflowClient(tracking_uri)

    def setup(self, trainer: Trainer, module: TrainModule, stage: Stage) -> None:
        self._rank = trainer.global_rank

    @property
    def experiment(self) -> Any:
        """The ``MlflowClient`` (the run created on first use), or None on ranks other than zero."""
        if self._rank != 0:
            return None
        if self._initialized:
            return self._client
        client = self._client
        if self._run_id is not None:
            self._experiment_id = client.get_run(self._run_id).info.experiment_id
            self._initialized = True
            return client
        if self._experiment_id is None:
            found = client.get_experiment_by_name(self._experiment_name)
            if found is not None and found.lifecycle_stage != "deleted":
                self._experiment_id = found.experiment_id
            else:
                self._experiment_id = client.create_experiment(
                    name=self._experiment_name, artifact_location=self._artifact_location
                )
        if self._run_name is not None:
            self.tags["mlflow.runName"] = self._run_name
        run = client.create_run(experiment_id=self._experiment_id, tags=self.tags)
        self._run_id = run.info.run_id
        self._initialized = True
        return client

    @property
    def run_id(self) -> str | None:
        _ = self.experiment
        return self._run_id

    @property
    def experiment_id(self) -> str | None:
        _ = self.experiment
        return self._experiment_id

    @property
    def name(self) -> str:
        """The experiment id (Lightning's ``name`` for this logger)."""
        return self.experiment_id or ""

    @property
    def version(self) -> str | None:
        """The run id."""
        return self.run_id

    @property
    def save_dir(self) -> str | None:
        """The local directory of a ``file:`` store, else None."""
        if self._tracking_uri.startswith(LOCAL_FILE_URI_PREFIX):
            return self._tracking_uri[len(LOCAL_FILE_URI_PREFIX) :]
        return None

    def log_hyperparams(
        self,
        params: dict[str, Any] | Namespace | None = None,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> None:
        """Log ``params`` (nested dicts flattened to ``a/b``; values as text, cut at 250 characters)."""
        client = self.experiment
        if client is None:
            return
        from mlflow.entities import Param

        flat = _flatten(hparams_dict(params))
        items = [Param(key=k, value=str(v)[:250]) for k, v in flat.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run_id=self._run_id, params=items[i : i + 100], **self._log_batch_kwargs)
        if metrics:
            self.log_metrics(metrics, step)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        client = self.experiment
        if client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = []
        for k, v in metrics.items():
            if isinstance(v, str):
                warnings.warn(
                    f"MLFlowLogger: discarding metric {k}={v!r}: MLflow metrics are numbers.",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
                continue
            key = f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}" if self._prefix else k
            clean = re.sub("[^a-zA-Z0-9_/. -]+", "", key)
            if clean != key:
                warnings.warn(
                    f"MLflow allows only '_', '/', '.', ' ' and '-' besides letters and digits in metric "
                    f"names: {key!r} is logged as {clean!r}.",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
            items.append(Metric(key=clean, value=float(v), timestamp=now, step=step or 0))
        client.log_batch(run_id=self._run_id, metrics=items, **self._log_batch_kwargs)

    def finalize(self, status: str) -> None:
        """Mark the run FINISHED, FAILED or KILLED (an interrupted run)."""
        if not self._initialized or self._rank != 0 or self._run_id is None:
            return
        self._client.set_terminated(self._run_id, _STATUS.get(status, status))
