"""What reaches the loggers, and when: step metrics, epoch metrics, hyper-parameters, the final status.

Only global rank zero writes. ``trainer.logged_metrics`` mirrors what was written last per key, as
tensors (as Lightning's); the loggers get floats, and with them the epoch, which ``logged_metrics`` does
not hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.logger_writes import logger_step
from ember.metric_values import to_floats

if TYPE_CHECKING:
    from ember.trainer.metrics import MetricCollector
    from ember.trainer.trainer import Trainer


class LogWriter:
    """Writes one run's metrics to the Trainer's loggers.

    Args:
        trainer: its loggers, rank, progress (the step and epoch written), ``logged_metrics`` and ``history``.
        metrics: the run's ``self.log`` collector.
    """

    def __init__(self, trainer: Trainer, metrics: MetricCollector) -> None:
        self._trainer = trainer
        self._metrics = metrics
        #: With loggers, every process keeps ``logged_metrics`` (as Lightning); global rank zero alone writes.
        self.enabled = bool(trainer.loggers)
        self._writes = self.enabled and trainer.is_global_zero
        # Evaluation step values reach logged_metrics (and the loggers) from the collector, batch by batch:
        # as Lightning's, logged_metrics holds them without loggers too.
        metrics.step_log_sink = self.eval_step_metrics

    def write(self, metrics: dict[str, Any], step: int | None = None, with_epoch: bool = True) -> None:
        """Keep ``metrics`` in ``logged_metrics`` (as tensors) and, on global rank zero, hand them (as floats,
        with the epoch unless ``with_epoch=False``) to every logger at ``step`` (default: the current one, see
        ``logger_step``)."""
        t = self._trainer
        logged: dict[str, Any] = t.logged_metrics
        logged.update({k: v if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for k, v in metrics.items()})
        if not self._writes:
            return
        floats = to_floats(metrics)
        if with_epoch:
            floats["epoch"] = float(t.progress.current_epoch)
        if step is None:
            step = logger_step(t)
        for lg in t.loggers:
            lg.log_metrics(floats, step)

    def eval_step_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """One evaluation batch's per-step values, at ``step`` (that loader's batches so far in this run),
        without the epoch: as Lightning writes them."""
        self.write(metrics, step, with_epoch=False)

    def step_metrics(self) -> None:
        """Write the step values logged since the last write (called every ``log_every_n_steps``)."""
        pending = self._metrics.pending_step_logs
        if pending and self.enabled:
            self.write(pending)
        pending.clear()

    def epoch_metrics(self, epoch_metrics: dict[str, Any]) -> None:
        """Write the logger-bound part of an epoch's reduced metrics (into ``logged_metrics`` even without
        loggers, as Lightning)."""
        if epoch_metrics:
            keys = self._metrics.logger_keys()
            logged = {k: v for k, v in epoch_metrics.items() if k in keys}
            if logged:
                self.write(logged)

    def record_epoch(self, epoch_metrics: dict[str, Any]) -> None:
        """A training epoch ended: one row of ``trainer.history``, and its metrics to the loggers."""
        t = self._trainer
        row: dict[str, Any] = {"epoch": t.progress.current_epoch, "step": t.progress.global_step}
        row.update(to_floats({k: v for k, v in self._metrics.callback_metrics.items() if not k.endswith("_step")}))
        t.history.append(row)
        self.epoch_metrics(epoch_metrics)

    def hyperparams(self) -> None:
        """Hand the module's (and datamodule's) hyper-parameters to every logger once per fit, validate and test
        (not predict, which logs nothing), as Lightning: the values given to ``__init__`` (``hparams_initial``), of
        the sources that saved them with ``save_hyperparameters(logger=True)``, refusing a key the two give
        different values."""
        if not self._writes:
            return
        t = self._trainer
        params: dict[str, Any] = {}
        for source in (t.module, t.datamodule):
            if source is None or not source.__dict__.get("_log_hyperparams", False):
                continue
            hp = dict(getattr(source, "hparams_initial", None) or {})
            clash = sorted(k for k in hp if k in params and not _same(params[k], hp[k]))
            if clash:
                raise RuntimeError(
                    f"The hyper-parameters {clash} are saved by both {type(t.module).__name__} and "
                    f"{type(source).__name__} with different values, so the loggers cannot record "
                    "one set. Rename them in one of the two, or leave them out of one with "
                    "save_hyperparameters(ignore=[...])."
                )
            params.update(hp)
        for lg in t.loggers:
            if params:  # as Lightning: nothing saved with save_hyperparameters, nothing logged (no empty hparams.yaml)
                lg.log_hyperparams(params)
            if t.module is not None:
                lg.log_graph(t.module)  # a no-op but for TensorBoardLogger(log_graph=True), as Lightning

    def finalize(self, status: str) -> None:
        """Tell every logger the run ended ("success", "failed" or "interrupted")."""
        t = self._trainer
        if t.is_global_zero:
            for lg in t.loggers:
                lg.finalize(status)


def _same(a: Any, b: Any) -> bool:
    """Whether two hyper-parameter values are equal (tensors compared by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # values whose == does not give a bool (arrays): compare identity
        return a is b
