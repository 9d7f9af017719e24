"""TensorBoardLogger: event files (scalars and hyper-parameters) under ``<save_dir>/<name>/version_N/``.

The ``tensorboard`` package is imported when the first event is written, not when this module is
imported: ``Trainer(logger=True)`` builds this logger for every run, and a run that never logs
should not pay for the import.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch

from ember.loggers.file_logger import HPARAMS_FILE, FileLogger, write_hparams_file
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from argparse import Namespace

    from torch import nn
    from torch.utils.tensorboard import SummaryWriter

    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer
    from ember.types import Stage

# The HParams plugin knows only success, failure, running and unknown: an interrupted run did not succeed.
_STATUS = {"success": "STATUS_SUCCESS", "failed": "STATUS_FAILURE", "interrupted": "STATUS_FAILURE"}


class TensorBoardLogger(FileLogger):
    """Log scalars and hyper-parameters for TensorBoard, on global rank zero.

    Scalars are written at the Trainer's ``log_every_n_steps`` cadence and at epoch ends, with the
    global step. Hyper-parameters go to ``hparams.yaml`` and to TensorBoard's HParams dashboard;
    when the run ends the dashboard's metric list is filled with every scalar logged, so it shows
    each run's final values beside its hyper-parameters.

    Args:
        save_dir: the root directory; defaults to the Trainer's ``default_root_dir``.
        name: experiment sub-directory ("ember_logs"; "" for none).
        version: int, string (directory name) or None for the next free ``version_N``.
        prefix: put in front of every metric name, joined with ``-`` (``train-loss``).
        flush_secs: how often written events are flushed to disk. Events are also flushed when
            a run ends, successfully or with an error.
        max_queue: scalar events queued before they are written (and for ``experiment``, the
            ``SummaryWriter`` for your own images, histograms...).
        sub_dir: a directory inside the version's, where this logger writes (as Lightning's).
        log_graph: let ``log_graph(model)`` write the module's graph, traced on ``model.example_input_array``
            (as Lightning's; otherwise ``log_graph`` does nothing).
        **writer_kwargs: passed on to ``torch.utils.tensorboard.SummaryWriter`` (``experiment``).

    Scalars and hyper-parameters are written by this logger itself, from the training thread, rather
    than through ``SummaryWriter``'s background thread: a writer thread competes with the training
    loop for the GIL at every logging event, while a direct append (serialise, frame, write,
    ``max_queue`` events at a time and at least every ``flush_secs``) costs a fraction of that.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str] | None = None,
        name: str = "ember_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_secs: float = 30.0,
        max_queue: int = 10,
        sub_dir: str | os.PathLike[str] | None = None,
        log_graph: bool = False,
        **writer_kwargs: Any,
    ) -> None:
        super().__init__(save_dir, name, version, prefix)
        self.sub_dir = os.fspath(sub_dir) if sub_dir is not None else None
        self._log_graph = bool(log_graph)
        if flush_secs <= 0:
            raise ValueError(f"flush_secs must be positive, got {flush_secs!r}.")
        self.flush_secs = flush_secs
        self.max_queue = max_queue
        self._writer_kwargs = writer_kwargs
        self._writer: SummaryWriter | None = None
        self._events: _EventFile | None = None
        self._metric_tags: dict[str, None] = {}  # ordered set of scalar tags written
        self._session_started = False
        self._experiment_written = False
        # The highest step scalars were written at, and each write there (a checkpoint carries them,
        # ``state_dict``); and, from a checkpoint a fit resumes from, the same pair of the run it continues.
        self._last_step = -1
        self._last_writes: list[dict[str, float]] = []
        self._carried: tuple[int, list[dict[str, float]]] | None = None

    @property
    def log_dir(self) -> str:
        """``<root_dir>/<version>[/<sub_dir>]``, with ``~`` and ``$VARS`` expanded, as Lightning's."""
        log_dir = super().log_dir
        if self.sub_dir is not None:
            log_dir = os.path.join(log_dir, self.sub_dir)
        return os.path.expanduser(os.path.expandvars(log_dir))

    @property
    def experiment(self) -> SummaryWriter | None:
        """The ``SummaryWriter`` (opened on first use), or None on processes other than rank zero."""
        if self._writer is None and self._writes:
            from torch.utils.tensorboard import SummaryWriter

            if self._rewind_step is not None:
                self._event_file()  # the purge marker goes first, ahead of this writer's events (rewind)
            os.makedirs(self.log_dir, exist_ok=True)
            self._writer = SummaryWriter(
                log_dir=self.log_dir, flush_secs=self.flush_secs, max_queue=self.max_queue, **self._writer_kwargs
            )
        return self._writer

    def _event_file(self) -> _EventFile | None:
        if self._events is None and self._writes:
            purge, again = self._purge_point()
            self._events = _EventFile(self.log_dir, self.flush_secs, self.max_queue, purge_step=purge)
            for metrics in again:
                self.log_metrics(metrics, purge)
        return self._events

    def _purge_point(self) -> tuple[int | None, list[dict[str, float]]]:
        """Where the next event file's purge marker goes (``rewind``), and the values to write there again.

        A resumed fit may write the checkpoint's last step (``step - 1``) again: the end of an epoch whose
        last batch the checkpoint follows, whose values the stopped run wrote there after the checkpoint.
        When the checkpoint carries what this logger had written at its highest step, the marker goes
        at ``step - 1`` and what was written there before the checkpoint is written again.
        """
        step, carried = self._rewind_step, self._carried
        self._rewind_step = self._carried = None
        if step is None or carried is None:
            return step, []
        at = max(step - 1, 0)
        last_step, writes = carried
        return at, (writes if last_step == at else [])

    def rewind(self, step: int) -> None:
        """Hide from TensorBoard what was logged at ``step`` and later: the next event file starts with
        TensorBoard's purge marker (what ``SummaryWriter(purge_step=step)`` writes), and TensorBoard drops
        every event of this directory read before it with a step from ``step`` on. Event files are read in
        name order, which is the order they were made in."""
        super().rewind(step)
        self._last_step, self._last_writes = -1, []  # (rebuilt by the writes after the marker)
        if self._events is not None:  # the marker heads a file: the next one
            self._events.close()
            self._events = None

    def on_load_checkpoint(self, trainer: Trainer, module: TrainModule, checkpoint: dict[str, Any]) -> None:
        self._carried = None  # (load_state_dict, called after this hook, gives the checkpoint's)
        super().on_load_checkpoint(trainer, module, checkpoint)

    def state_dict(self) -> dict[str, Any]:
        """The highest step scalars were written at and each write there (see ``_purge_point``)."""
        if self._last_step < 0:
            return {}
        return {"last_step": self._last_step, "last_writes": [dict(w) for w in self._last_writes]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._carried = (int(state_dict["last_step"]), [dict(w) for w in state_dict["last_writes"]])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Write ``metrics`` (numbers or scalar tensors) at ``step``; without one, at step 0 (as ``SummaryWriter``)."""
        events = self._event_file()
        if events is None:
            return
        # One event holding every value of this call (SummaryWriter.add_scalar builds one per value).
        values = {
            self.prefixed(key): (float(value) if isinstance(value, torch.Tensor) else value)
            for key, value in metrics.items()
        }
        for key in metrics:
            if key != "epoch":
                self._metric_tags[self.prefixed(key)] = None
        step = 0 if step is None else step
        if step > self._last_step:
            self._last_step, self._last_writes = step, []
        if step == self._last_step:
            self._last_writes.append({key: float(value) for key, value in metrics.items()})
        events.add_scalars(values, step)

    def log_hyperparams(
        self,
        params: dict[str, Any] | Namespace | None = None,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> None:
        """Write ``params`` (a dict, a Namespace or None) to ``hparams.yaml`` and to the HParams dashboard;
        log ``metrics`` at ``step`` (default 0)."""
        if not self._writes:
            return
        super().log_hyperparams(params, metrics, step)
        flat = _flatten(self.hparams)
        events = self._event_file()
        assert events is not None  # this logger writes (checked above)
        events.add_summary(_hparams_summary(session_start=flat))
        self._session_started = True

    def log_graph(self, model: nn.Module, input_array: Any = None) -> None:
        """Write ``model``'s graph (``SummaryWriter.add_graph``), traced on ``input_array`` (default
        ``model.example_input_array``) after the module's batch-transfer hooks, as Lightning's. Only with
        ``TensorBoardLogger(log_graph=True)``, on global rank zero; without a usable input, a warning says why."""
        if not self._log_graph or not self._writes:
            return
        if input_array is None:
            input_array = getattr(model, "example_input_array", None)
        if input_array is None:
            warnings.warn(
                "Could not log the computational graph to TensorBoard: set `model.example_input_array` "
                "or pass `input_array` to log_graph.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        elif not isinstance(input_array, (torch.Tensor, tuple)):
            warnings.warn(
                "Could not log the computational graph to TensorBoard: the `input_array` or "
                f"`model.example_input_array` is a {type(input_array).__name__}, which TensorBoard cannot trace. "
                "Make it a tensor, or a tuple of the positional arguments of the model's `forward()`.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        else:
            from ember.module import TrainModule

            if isinstance(model, TrainModule):  # to the module's device, through its hooks, as a batch
                input_array = model.on_before_batch_transfer(input_array, 0)
                input_array = model.transfer_batch_to_device(input_array, model.device, 0)
                input_array = model.on_after_batch_transfer(input_array, 0)
            experiment = self.experiment
            assert experiment is not None  # this logger writes (checked above)
            # Tracing reads every attribute: a TrainModule's ``trainer`` is None meanwhile (as while exporting).
            already = "_exporting" in model.__dict__
            model.__dict__["_exporting"] = True
            try:
                experiment.add_graph(model, input_array)
            finally:
                if not already:
                    model.__dict__.pop("_exporting", None)

    def save(self) -> None:
        """Flush what was written; as Lightning, an ``hparams.yaml`` (empty if nothing was logged) is
        written once the run's directory exists."""
        if self._events is not None:
            self._events.flush()
        if self._writer is not None:
            self._writer.flush()
        hparams_file = os.path.join(self.log_dir, HPARAMS_FILE)
        if self._writes and os.path.isdir(self.log_dir) and not os.path.isfile(hparams_file):
            write_hparams_file(self.log_dir, self.hparams)

    def finalize(self, status: str) -> None:
        """Record the run's metric names and end status for the HParams dashboard, then flush and close."""
        if self._events is not None and self._session_started:
            file_writer = self._events
            if not self._experiment_written:
                # TensorBoard keeps the first experiment summary of a run, so it is written once, at
                # the end, when every metric name is known.
                file_writer.add_summary(_hparams_summary(experiment=(_flatten(self.hparams), list(self._metric_tags))))
                self._experiment_written = True
            file_writer.add_summary(_hparams_summary(session_end=status))
        self._close()
        if status == "success":
            self.save()  # as Lightning: hparams.yaml exists after a successful run, empty if nothing was logged

    def teardown(self, trainer: Trainer, module: TrainModule, stage: Stage) -> None:
        # Whatever ended the run (finalize ran or not): no event file left open, no writer thread left running.
        self._close()
        self._carried = None  # a checkpoint's writes are for the fit that resumed from it only

    def _close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


def _flatten(params: dict[str, Any], parent: str = "") -> dict[str, Any]:
    """Nested dicts become ``a/b`` keys; values TensorBoard cannot show become strings."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent}/{key}" if parent else str(key)
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            out[name] = value.item()
        else:
            out[name] = str(value)
    return out


def _hparams_summary(
    session_start: dict[str, Any] | None = None,
    experiment: tuple[dict[str, Any], list[str]] | None = None,
    session_end: str | None = None,
) -> Any:
    """One HParams-plugin summary: the session start (values), the experiment (names) or the end (status)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    if session_start is not None:
        info = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
        for key, value in session_start.items():
            if isinstance(value, bool):
                info.hparams[key].bool_value = value
            elif isinstance(value, (int, float)):
                info.hparams[key].number_value = float(value)
            else:
                info.hparams[key].string_value = value
        data, tag = plugin_data_pb2.HParamsPluginData(session_start_info=info), metadata.SESSION_START_INFO_TAG
    elif experiment is not None:
        params, metric_tags = experiment
        kinds = {bool: "DATA_TYPE_BOOL", str: "DATA_TYPE_STRING"}
        exp = api_pb2.Experiment(
            time_created_secs=time.time(),
            hparam_infos=[
                api_pb2.HParamInfo(name=k, type=api_pb2.DataType.Value(kinds.get(type(v), "DATA_TYPE_FLOAT64")))
                for k, v in params.items()
            ],
            metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=t)) for t in metric_tags],
        )
        data, tag = plugin_data_pb2.HParamsPluginData(experiment=exp), metadata.EXPERIMENT_TAG
    else:
        status = api_pb2.Status.Value(_STATUS.get(session_end or "", "STATUS_UNKNOWN"))
        end = plugin_data_pb2.SessionEndInfo(status=status, end_time_secs=time.time())
        data, tag = plugin_data_pb2.HParamsPluginData(session_end_info=end), metadata.SESSION_END_INFO_TAG
    data.version = metadata.PLUGIN_DATA_VERSION
    meta = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME, content=data.SerializeToString())
    )
    return Summary(value=[Summary.Value(tag=tag, metadata=meta)])


def default_logger(save_dir: str) -> TensorBoardLogger:
    """The logger ``Trainer(logger=True)`` uses: TensorBoard under ``<save_dir>/ember_logs/``."""
    return TensorBoardLogger(save_dir=save_dir)


class _EventFile:
    """Appends TensorBoard events to one event file, from the calling thread (headed by a purge marker at
    ``purge_step``, if given).

    Scalars are queued as plain ``(step, wall time, values)`` and turned into events (protobuf,
    CRC framing, write) ``max_queue`` at a time or every ``flush_secs``: building and framing an
    event is the expensive part (the CRC is pure Python), and doing it in batches keeps it out of
    most training steps. ``flush`` and ``close`` write whatever is queued.
    """

    _count = itertools.count()

    def __init__(self, log_dir: str, flush_secs: float, max_queue: int, purge_step: int | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        os.makedirs(log_dir, exist_ok=True)
        # TensorBoard's name scheme (time, host, process), ending in our own zero-padded counter after a
        # "-": never the name of a SummaryWriter's file (``experiment``) made in the same second, which
        # ends in that writer's counter (a digit), so neither truncates the other's file; and it sorts
        # before such files, so a purge marker here is read before what that writer wrote in this run.
        stamp = f"{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        name = f"events.out.tfevents.{stamp}.-ember.{next(self._count):04d}"
        self._event, self._summary = Event, Summary
        self._records = RecordWriter(open(os.path.join(log_dir, name), "wb"))
        self._flush_secs = flush_secs
        self._max_queue = max(1, max_queue)
        self._queued: list[tuple[int, float, dict[str, float]]] = []
        self._last_flush = time.monotonic()
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            # TensorBoard discards the events read before this one whose step is purge_step or later.
            start = SessionLog(status=SessionLog.START)
            self._write(Event(wall_time=time.time(), step=purge_step, session_log=start))
        self.flush()

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        self._queued.append((step, time.time(), values))
        if len(self._queued) >= self._max_queue or time.monotonic() - self._last_flush >= self._flush_secs:
            self.flush()

    def add_summary(self, summary: Any, step: int | None = None) -> None:
        self._write_queued()  # keep events in the order they were logged
        event = self._event(wall_time=time.time(), summary=summary)
        if step is not None:
            event.step = int(step)
        self._write(event)

    def _write_queued(self) -> None:
        value = self._summary.Value
        for step, wall_time, values in self._queued:
            summary = self._summary(value=[value(tag=tag, simple_value=v) for tag, v in values.items()])
            self._write(self._event(wall_time=wall_time, step=step, summary=summary))
        self._queued.clear()

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        self._write_queued()
        self._records.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()
        self._records.close()
