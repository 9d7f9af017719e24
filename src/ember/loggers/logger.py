"""The Logger base class: a callback the Trainer feeds with metrics at its logging cadence.

The Trainer converts collected tensors to floats once per logging event and calls
``log_metrics`` on every logger; loggers only write (on global rank zero).

``DummyLogger`` is what ``fast_dev_run`` puts in place of the user's loggers (as Lightning): nothing is
written, yet a module that calls ``self.logger.experiment.add_image(...)`` runs unchanged.
"""

from __future__ import annotations

import os
from argparse import Namespace
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from torch import nn


class Logger(Callback):
    """Base class of metric loggers (TensorBoard, CSV, ...).

    A subclass that writes files gives a ``save_dir``; its ``log_dir`` (where checkpoints go by default)
    is then ``<save_dir>/<name>/<version>``, with whatever its ``name`` and ``version`` properties return
    (an int version ``N`` is the directory ``version_N``, as Lightning names it).
    """

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def version(self) -> int | str | None:
        return None

    @property
    def save_dir(self) -> str | None:
        """The root directory this logger writes under, or None for a logger that writes no files."""
        return None

    @property
    def root_dir(self) -> str | None:
        """The directory holding every version of the experiment, or None (as here) for a logger that keeps
        no local files by version (Lightning's MLflow and wandb loggers too)."""
        return None

    @property
    def group_separator(self) -> str:
        """What joins a group and a name in a metric key (``"/"``: ``grad_2.0_norm/layer.weight``), so that
        a logger's UI can group them."""
        return "/"

    @property
    def log_dir(self) -> str | None:
        """Directory this logger writes into (checkpoints go beside it by default): ``<save_dir>/<name>/<version>``,
        or None without a ``save_dir``."""
        save_dir = self.save_dir
        return None if save_dir is None else self.run_dir(save_dir)

    def run_dir(self, root: str | os.PathLike[str]) -> str:
        """``<root>/<name>/<version>`` (a version that is an int reads ``version_<N>``)."""
        parts = [os.fspath(root)]
        if self.name:
            parts.append(str(self.name))
        version = self.version
        if version is not None:
            parts.append(version if isinstance(version, str) else f"version_{version}")
        return os.path.join(*parts)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Record ``metrics`` at ``step`` (the Trainer always gives one; a direct call may leave it out)."""

    def log_hyperparams(
        self,
        params: dict[str, Any] | Namespace | None = None,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> None:
        """Record the run's hyper-parameters (a dict or an ``argparse.Namespace``; none at all is allowed) and,
        optionally, final metrics beside them (at ``step``)."""

    def log_graph(self, model: nn.Module, input_array: Any = None) -> None:
        """Record ``model``'s computational graph (``input_array``: an input of its ``forward``). Does nothing
        here; TensorBoardLogger(log_graph=True) writes it."""

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Called after the ``ModelCheckpoint`` ``checkpoint_callback`` saved a checkpoint (does nothing here)."""

    def save(self) -> None:
        """Flush what is buffered."""

    def finalize(self, status: str) -> None:
        """Called once when a run ends: ``"success"``, ``"failed"`` or ``"interrupted"``."""
        self.save()


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


class DummyExperiment:
    """An experiment whose every method does nothing (``experiment.add_scalar(...)``, ``experiment[0]``)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("__"):
            raise AttributeError(name)
        return _no_op

    def __getitem__(self, idx: int) -> DummyExperiment:
        return self


class DummyLogger(Logger):
    """A logger that writes nothing: ``Trainer(fast_dev_run=...)`` uses it instead of the loggers given, so
    that ``self.logger.experiment...`` and any other logger method still run (and do nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self._experiment = DummyExperiment()

    @property
    def experiment(self) -> DummyExperiment:
        return self._experiment

    @property
    def name(self) -> str:
        return ""

    @property
    def version(self) -> str:
        return ""

    def __getitem__(self, idx: int) -> DummyLogger:  # self.logger[0].experiment...
        return self

    def __getattr__(self, name: str) -> Callable[..., None]:
        # Methods of other loggers (log_image, log_graph, ...) do nothing. Private names and hooks stay
        # missing, so the Trainer's look-ups of optional callback methods see what a Logger has.
        if name.startswith("_") or name.startswith("on_"):
            raise AttributeError(name)
        return _no_op


def hparams_dict(params: Mapping[str, Any] | Namespace | None) -> dict[str, Any]:
    """``log_hyperparams``' ``params`` as a dict: a mapping, an ``argparse.Namespace`` (its attributes) or None (empty).

    Raises:
        TypeError: for anything else, saying what is accepted.
    """
    if params is None:
        return {}
    if isinstance(params, Namespace):
        return dict(vars(params))
    if isinstance(params, Mapping):
        return dict(params)
    raise TypeError(f"log_hyperparams expects a dict, an argparse.Namespace or None, got {type(params).__name__}.")
