"""WandbLogger: metrics and hyper-parameters to Weights & Biases, as Lightning's.

The ``wandb`` package is imported when the logger is built (``pip install 'ember[wandb]'``), so
``import ember.loggers`` works without it. The run is created on first use (``logger.experiment``),
on global rank zero only: other ranks get an experiment whose every method does nothing, as in
Lightning. ``offline=True`` (or ``WANDB_MODE=offline``) writes the run under ``save_dir`` to be
synced later with ``wandb sync``.

As Lightning, the run stays open when a fit ends (a later ``trainer.test`` logs into it); wandb
finishes it when the process exits, or call ``logger.experiment.finish()`` yourself. Metrics are
logged with Lightning's x-axis, ``trainer/global_step``.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from argparse import Namespace
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ember.loggers.logger import DummyExperiment, Logger, hparams_dict
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer
    from ember.types import Stage

log = logging.getLogger(__name__)


def _jsonable(value: Any) -> Any:
    """A hyper-parameter as wandb's config keeps it: containers kept, functions and classes by name, anything
    else JSON cannot hold as its ``str`` (as Lightning's ``_sanitize_callable_params`` and
    ``_convert_json_serializable``)."""
    if isinstance(value, Namespace):
        value = vars(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if callable(value):
        return getattr(value, "__name__", str(value))
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


class WandbLogger(Logger):
    """Log to Weights & Biases (Lightning's ``WandbLogger``, same arguments).

    Args:
        name: the run's display name.
        save_dir: where wandb writes the run's files (``wandb.init(dir=...)``).
        version: the run id, to continue an earlier run (``id`` is the same).
        offline: write the run locally instead of streaming it (``wandb sync`` uploads it later).
        dir: the same as ``save_dir``.
        id: the same as ``version``.
        anonymous: allow anonymous logging.
        project: the wandb project; default ``$WANDB_PROJECT``, else ``"lightning_logs"``.
        log_model: only False: uploading checkpoints as artifacts is not supported yet.
        experiment: a wandb run to log into instead of creating one.
        prefix: put in front of every metric name (joined with ``-``).
        checkpoint_name: kept for Lightning's signature (used with ``log_model``).
        **kwargs: passed on to ``wandb.init`` (``entity``, ``group``, ``tags``, ``mode``, ...).

    Raises:
        ModuleNotFoundError: without the ``wandb`` package.
        NotImplementedError: for ``log_model`` other than False.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        name: str | None = None,
        save_dir: str | os.PathLike[str] = ".",
        version: str | None = None,
        offline: bool = False,
        dir: str | os.PathLike[str] | None = None,
        id: str | None = None,
        anonymous: bool | None = None,
        project: str | None = None,
        log_model: bool | str = False,
        experiment: Any = None,
        prefix: str = "",
        checkpoint_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        try:
            import wandb  # noqa: F401
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(
                "WandbLogger needs the wandb package: pip install 'ember[wandb]' (or pip install wandb)."
            ) from err
        if log_model is not False:
            raise NotImplementedError(
                f"WandbLogger(log_model={log_model!r}) is not supported by ember yet: checkpoints stay in the "
                "ModelCheckpoint directory. Use log_model=False, and log a file with "
                "logger.experiment.log_artifact(...) if you need it in wandb."
            )
        root = save_dir if save_dir is not None else dir
        self._offline = offline
        self._prefix = prefix
        self._experiment = experiment
        self._checkpoint_name = checkpoint_name
        self._rank = int(os.environ.get("RANK", 0))  # exact once setup runs; guards the run until then
        self._wandb_init: dict[str, Any] = {
            "name": name,
            "project": project or os.environ.get("WANDB_PROJECT", "lightning_logs"),
            "dir": None if root is None else os.fspath(root),
            "id": version or id,
            "resume": "allow",
        }
        if anonymous:  # (wandb warns about the setting whenever it is given)
            self._wandb_init["anonymous"] = "allow"
        if offline:
            self._wandb_init["mode"] = "offline"
        self._wandb_init.update(kwargs)
        self._project = self._wandb_init["project"]
        self._save_dir = self._wandb_init["dir"]
        self._name = self._wandb_init["name"]
        self._id = self._wandb_init["id"]

    def __getstate__(self) -> dict[str, Any]:
        # A wandb run cannot be pickled (ddp_spawn pickles the callbacks): a process that unpickles the
        # logger continues the run by its id when it has one, else creates its own on rank zero.
        state = self.__dict__.copy()
        if self._experiment is not None and not isinstance(self._experiment, DummyExperiment):
            state["_id"] = state["_wandb_init"]["id"] = getattr(self._experiment, "id", self._id)
        state["_experiment"] = None
        return state

    def setup(self, trainer: Trainer, module: TrainModule, stage: Stage) -> None:
        self._rank = trainer.global_rank

    @property
    def experiment(self) -> Any:
        """The ``wandb`` run (created on first use); on ranks other than zero, an object that does nothing."""
        if self._rank != 0:
            return DummyExperiment()
        if self._experiment is None:
            import wandb

            if wandb.run is not None:
                warnings.warn(
                    "There is a wandb run already in progress and newly created instances of `WandbLogger` will "
                    "reuse this run. If this is not desired, call `wandb.finish()` before instantiating `WandbLogger`.",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
                self._experiment = wandb.run
            else:
                self._experiment = wandb.init(**self._wandb_init)
                # Lightning's x-axis: every metric is plotted against trainer/global_step.
                if self._wandb_init.get("sync_tensorboard"):
                    self._experiment.define_metric("*", step_metric="global_step")
                else:
                    self._experiment.define_metric("trainer/global_step")
                    self._experiment.define_metric("*", step_metric="trainer/global_step", step_sync=True)
        return self._experiment

    @property
    def name(self) -> str:
        """The project (as Lightning; the run's own name is ``experiment.name``)."""
        return self._project

    @property
    def version(self) -> str | None:
        """The run id: the run's once it exists, else the one given."""
        experiment = self._experiment
        return experiment.id if experiment is not None and not isinstance(experiment, DummyExperiment) else self._id

    @property
    def save_dir(self) -> str | None:
        return self._save_dir

    def log_hyperparams(
        self,
        params: dict[str, Any] | Namespace | None = None,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> None:
        """Put ``params`` in the run's config (changed values replace earlier ones, as Lightning's)."""
        if self._rank != 0:
            return
        self.experiment.config.update(_jsonable(hparams_dict(params)), allow_val_change=True)
        if metrics:
            self.log_metrics(metrics, step)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._rank != 0:
            return
        values = {f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}" if self._prefix else k: v for k, v in metrics.items()}
        if step is not None and not self._wandb_init.get("sync_tensorboard"):
            values["trainer/global_step"] = step
        self.experiment.log(values)

    def log_table(
        self,
        key: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
    ) -> None:
        """Log a ``wandb.Table`` from ``columns`` and ``data``, or from a pandas ``dataframe``."""
        import wandb

        table: Any = wandb.Table(columns=list(columns) if columns is not None else None, data=data, dataframe=dataframe)
        self.log_metrics({key: table}, step)

    def log_text(
        self,
        key: str,
        columns: list[str] | None = None,
        data: list[list[str]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
    ) -> None:
        """Log text as a table (as Lightning's ``log_text``)."""
        self.log_table(key, columns, data, dataframe, step)

    def log_image(self, key: str, images: list[Any], step: int | None = None, **kwargs: list[Any]) -> None:
        """Log ``wandb.Image``s of ``images`` (tensors, numpy arrays, PIL images or file paths) under ``key``;
        each keyword is a list with one value per image (``caption=[...]``, ``masks=[...]``), as Lightning's."""
        self._log_media("Image", key, images, step, kwargs)

    def log_audio(self, key: str, audios: list[Any], step: int | None = None, **kwargs: list[Any]) -> None:
        """Log ``wandb.Audio``s of ``audios`` (numpy arrays or file paths) under ``key``; each keyword is a list
        with one value per audio (``caption=[...]``, ``sample_rate=[...]``), as Lightning's."""
        self._log_media("Audio", key, audios, step, kwargs)

    def log_video(self, key: str, videos: list[Any], step: int | None = None, **kwargs: list[Any]) -> None:
        """Log ``wandb.Video``s of ``videos`` (numpy arrays or file paths) under ``key``; each keyword is a list
        with one value per video (``caption=[...]``, ``fps=[...]``, ``format=[...]``), as Lightning's."""
        self._log_media("Video", key, videos, step, kwargs)

    def _log_media(self, kind: str, key: str, items: list[Any], step: int | None, kwargs: dict[str, list[Any]]) -> None:
        """One ``wandb.<kind>`` per item, with the item's value of each keyword list, logged at ``step``.

        Raises:
            TypeError: when ``items`` is not a list.
            ValueError: when a keyword's list is not as long as ``items``.
        """
        what = f"{kind.lower()}s"
        if not isinstance(items, list):
            raise TypeError(
                f"log_{kind.lower()} expects a list of {what}, got a {type(items).__name__}: wrap one in a list."
            )
        uneven = {k: len(v) for k, v in kwargs.items() if len(v) != len(items)}
        if uneven:
            raise ValueError(
                f"log_{kind.lower()} got {len(items)} {what} but keyword lists of other lengths {uneven}: "
                f"give each keyword one value per item."
            )
        if self._rank != 0:
            return
        import wandb

        make = getattr(wandb, kind)
        media = [make(item, **{k: v[i] for k, v in kwargs.items()}) for i, item in enumerate(items)]
        self.log_metrics({key: media}, step)  # type: ignore[dict-item]  # (wandb objects, as log_table's)

    @staticmethod
    def download_artifact(
        artifact: str,
        save_dir: str | os.PathLike | None = None,
        artifact_type: str | None = None,
        use_artifact: bool | None = True,
    ) -> str:
        """Download a wandb artifact (``"entity/project/name:version"``) and return the folder it went to.

        With a wandb run open and ``use_artifact``, the run records that it used the artifact; otherwise it is
        fetched through wandb's public API. ``save_dir``: where to put it (wandb's default folder when None).
        """
        import wandb

        if wandb.run is not None and use_artifact:
            found = wandb.run.use_artifact(artifact)
        else:
            found = wandb.Api().artifact(artifact, type=artifact_type)
        return str(found.download(root=None if save_dir is None else os.fspath(save_dir)))

    def use_artifact(self, artifact: str, artifact_type: str | None = None) -> Any:
        """Record in this logger's run that it uses ``artifact``; returns wandb's ``Artifact``."""
        return self.experiment.use_artifact(artifact, type=artifact_type)

    def watch(self, model: Any, log: str | None = "gradients", log_freq: int = 100, log_graph: bool = True) -> None:
        """Have wandb record ``model``'s gradients (and parameters with ``log="all"``) every ``log_freq`` steps."""
        self.experiment.watch(model, log=log, log_freq=log_freq, log_graph=log_graph)

    def finalize(self, status: str) -> None:
        """As Lightning: nothing to do without ``log_model``; the run stays open for a later validate / test."""
