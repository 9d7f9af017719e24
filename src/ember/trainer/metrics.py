"""What ``self.log`` collects: per-step values, per-epoch reductions, and their cross-rank reduction.
Each logged key, its running epoch total and the reductions themselves are in ``reductions.py``.

Hot-path rule: nothing here calls ``.item()`` or otherwise waits for a device. Values stay tensors
until something actually prints or writes them (the progress bar's refresh, a logger's write),
and ``to_floats`` converts a whole dict with one stack-and-copy.

A ``torchmetrics.Metric`` may be logged instead of a value (as in Lightning). It keeps its own state,
so nothing is accumulated here: a per-step value is the batch value its last ``forward`` returned,
the epoch value is its ``compute()`` at the stage's end, and every logged Metric is ``reset()`` then.
The Metric synchronises its state across processes itself inside ``compute()``, so its epoch value
does not go through ``reduce_across_processes`` (it would be reduced twice).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ember.batches import infer_batch_size
from ember.metric_values import is_torchmetric, to_floats
from ember.trainer.reductions import ENTRY_FIELDS, IDENTITY, MetricEntry, epoch_value, reduce_across_processes
from ember.types import ReduceFx, parse_reduce_fx

if TYPE_CHECKING:
    from ember.strategies.strategy import Strategy

_FLOAT32 = torch.float32
# Hooks whose ``self.log`` defaults to per-step values; everything else defaults to per-epoch (as Lightning).
_STEP_HOOKS = frozenset(
    {
        "training_step",
        "on_train_batch_start",
        "on_train_batch_end",
        "on_before_backward",
        "backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "optimizer_step",
        "configure_gradient_clipping",
        "clip_gradients",
        "on_before_zero_grad",
        "optimizer_zero_grad",
    }
)
# Hooks that run once per run or epoch: Lightning allows only on_step=False, on_epoch=True there.
_EPOCH_ONLY_HOOKS = frozenset(
    {
        "on_train_start",
        "on_validation_start",
        "on_test_start",
        "on_train_epoch_start",
        "on_train_epoch_end",
        "on_validation_epoch_start",
        "on_validation_epoch_end",
        "on_test_epoch_start",
        "on_test_epoch_end",
    }
)
# Inside these, trainer.callback_metrics shows the epoch values reduced so far (as Lightning's does).
_EPOCH_END_HOOKS = frozenset({"on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end"})
# Stages whose per-step values are written to the loggers batch by batch (the sanity check writes nothing).
_EVAL_STAGES = frozenset({"validate", "test"})

_COLLECTION_HINT = "Log a MetricCollection with self.log_dict(collection)."


class MetricCollector:
    """Collects ``self.log`` calls for the current stage and computes what the Trainer exposes.

    Args:
        strategy: used for cross-process reductions.
    """

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.stage = "train"
        self.fx = "training_step"
        #: Appended to logged names while evaluating the i-th of several dataloaders.
        self.key_suffix = ""
        self._stages: dict[str, dict[str, MetricEntry]] = {}
        self._entries: dict[str, MetricEntry] = {}
        #: The batch being processed (set by the loops; :meth:`eval_batch` in evaluation) and its inferred size
        #: (None until a mean needs it).
        self.batch: Any = None
        self.batch_size: int | None = None
        #: Latest value of every key: what callbacks (checkpointing, early stopping) read.
        self._callback_metrics: dict[str, Any] = {}
        self._progress_bar_metrics: dict[str, Any] = {}
        #: Step values logged since the last logger write, for keys with ``logger=True``.
        self.pending_step_logs: dict[str, Any] = {}
        #: Until the epoch ends, the metrics read in an epoch-end hook show the values reduced so far.
        self._epoch_open = False
        #: The logger-bound epoch values reduced so far, shown in ``logged_metrics`` inside an epoch-end hook.
        self._epoch_logs_so_far: dict[str, Any] = {}
        #: ``progress_bar_metrics`` as floats: key -> (the tensor converted, its float), reused while unchanged.
        self._pbar_floats: dict[str, tuple[Any, float]] = {}
        #: In validate / test: batches seen per loader (by key suffix) in this run; the per-step values of the
        #: last batch that logged some (written when another batch logs, or when the stage ends) and their
        #: (loader, step).
        self._counting = False
        self._eval_batches: dict[str, int] = {}
        self.pending_eval_step_logs: dict[str, Any] = {}
        self._eval_pending_at: tuple[str, int] = ("", -1)
        #: Where evaluation step values go, ``(metrics, step)``: set by the LogWriter when it writes.
        self.step_log_sink: Callable[[dict[str, Any], int], None] | None = None
        #: Set by the evaluation loop while it runs a padding batch (a rank whose ddp shard ran out runs
        #: one so that every rank takes the same steps): what is logged then counts toward no epoch value,
        #: and only synced step values are kept.
        self.padding = False
        #: Set by the fit loop when ``training_step`` takes ``dataloader_iter``: no one batch is the step's, so
        #: in training every ``self.log`` must say its ``batch_size`` (as in Lightning).
        self.training_fetches_batches = False
        self._needs_batch_size = False  # in training, with the above

    def eval_batch(self, batch: Any) -> None:
        """The evaluation loops' ``batch = ...``: in validate / test, also counts the loader's batches."""
        self.batch = batch
        if self._counting:
            suffix = self.key_suffix
            self._eval_batches[suffix] = self._eval_batches.get(suffix, -1) + 1

    @property
    def callback_metrics(self) -> dict[str, Any]:
        self.epoch_so_far()
        return self._callback_metrics

    @callback_metrics.setter
    def callback_metrics(self, value: dict[str, Any]) -> None:
        self._callback_metrics = value

    @property
    def progress_bar_metrics(self) -> dict[str, Any]:
        if self._epoch_open and self.fx in _EPOCH_END_HOOKS:  # as callback_metrics: this epoch's values so far
            self._publish_epoch_so_far()
        return self._progress_bar_metrics

    @progress_bar_metrics.setter
    def progress_bar_metrics(self, value: dict[str, Any]) -> None:
        self._progress_bar_metrics = value

    def epoch_so_far(self) -> dict[str, Any]:
        """Inside an epoch-end hook, publish the epoch values reduced so far (as Lightning's metrics
        show them there) and return the logger-bound ones; elsewhere, return nothing."""
        if self._epoch_open and self.fx in _EPOCH_END_HOOKS:
            self._publish_epoch_so_far()
            return self._epoch_logs_so_far
        return {}

    def progress_bar_floats(self) -> dict[str, float]:
        """``progress_bar_metrics`` as Python floats, as Lightning's. Read on demand (never per step); a
        value converted before and unchanged since is the same float object, so that a reader can tell
        what changed by identity."""
        self.epoch_so_far()
        raw, cache = self.progress_bar_metrics, self._pbar_floats
        stale = {k: v for k, v in raw.items() if k not in cache or cache[k][0] is not v}
        if stale:
            cache.update((k, (stale[k], f)) for k, f in to_floats(stale).items())
        return {k: cache[k][1] for k in raw}

    # ------------------------------------------------------------------ loop-facing
    def start_stage(self, stage: str) -> None:
        """Begin an epoch of ``stage``: forget that stage's previous accumulations."""
        self.stage = stage
        self._entries = self._stages[stage] = {}
        self._epoch_open = True
        self.padding = False
        self._counting = stage in _EVAL_STAGES
        self._needs_batch_size = self.training_fetches_batches and stage == "train"

    def resume_stage(self, stage: str) -> None:
        """Switch back to ``stage`` keeping its accumulations (training after a mid-epoch validation)."""
        self.stage = stage
        self._entries = self._stages.setdefault(stage, {})
        self._epoch_open = True
        self.padding = False
        self._counting = stage in _EVAL_STAGES
        self._needs_batch_size = self.training_fetches_batches and stage == "train"

    def state_dict(self) -> list[dict[str, Any]]:
        """The running sums behind the training epoch's ``on_epoch`` metrics (what a mid-epoch checkpoint
        saves, so that a resume logs the same epoch values), as plain data (tensors on their device)."""
        out = []
        for e in self._stages.get("train", {}).values():
            if e.metric is not None:  # its state is the Metric's own (in the module, when persistent)
                continue
            d: dict[str, Any] = {f: getattr(e, f) for f in ENTRY_FIELDS}
            # Copies: the running sums are added to in place by the next step, while the checkpoint must hold
            # this step's values. Made on their device (the writer copies them to the CPU with the weights: a
            # copy to the CPU here would make a background save wait for the GPU).
            d["total"] = e.total.detach().clone() if isinstance(e.total, torch.Tensor) else e.total
            d["weight"] = e.weight.detach().clone() if isinstance(e.weight, torch.Tensor) else e.weight
            out.append(d)
        return out

    def load_state_dict(self, saved: list[dict[str, Any]], device: torch.device) -> None:
        """Put back the training epoch's running sums from ``state_dict()``, on ``device``."""
        stage = {}
        for d in saved:
            e = MetricEntry(*(d[f] for f in ENTRY_FIELDS))
            # A copy of our own: later values are added into it in place.
            e.total = d["total"].to(device, copy=True) if isinstance(d["total"], torch.Tensor) else d["total"]
            e.weight = d["weight"].to(device) if isinstance(d["weight"], torch.Tensor) else d["weight"]
            stage[e.name] = e
        self._stages["train"] = stage

    # ------------------------------------------------------------------ what self.log calls
    def log(
        self,
        name: str,
        value: Any,
        *,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: ReduceFx = "mean",
        batch_size: int | None = None,
        sync_dist: bool = False,
        add_dataloader_idx: bool = True,
        enable_graph: bool = False,
    ) -> None:
        if batch_size is None and self._needs_batch_size:
            raise ValueError(
                f"self.log({name!r}, ...) in training, whose training_step takes dataloader_iter: the step "
                "fetches its own batches, so the Trainer cannot tell how many samples the value covers. Pass "
                f"self.log({name!r}, ..., batch_size=n), n the number of samples it was computed over (as "
                "Lightning requires)."
            )
        loader = self.key_suffix
        key = name + loader if loader and add_dataloader_idx else name
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(
                name,
                key,
                loader if add_dataloader_idx else "",
                prog_bar,
                logger,
                on_step,
                on_epoch,
                reduce_fx,
                sync_dist,
            )
        elif entry.loader != loader:
            first, now = (s.lstrip("/") or "outside any loader" for s in (entry.loader, loader))
            raise ValueError(
                f"self.log({name!r}, add_dataloader_idx=False) was called while evaluating two dataloaders "
                f"({first} and {now}), "
                "so their values would share one key. Log a different name per dataloader, or leave "
                "add_dataloader_idx=True."
            )
        if isinstance(value, torch.Tensor):
            if not enable_graph:
                value = value.detach()
            if value.ndim or value.dtype is not _FLOAT32:  # the common case (a float32 scalar) skips this
                if value.numel() != 1:
                    raise ValueError(
                        f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; only scalars can be "
                        "logged. Reduce it first (e.g. .mean()) or log its elements under separate names."
                    )
                # Half-precision values (bf16/16-mixed autocast) would accumulate in half precision: use float32.
                if not value.is_floating_point() or value.dtype in (torch.float16, torch.bfloat16):
                    value = value.float()
                if value.ndim:
                    value = value.reshape(())
        elif (isinstance(value, (int, float)) or isinstance(value, numbers.Real)) and not isinstance(value, bool):
            # Any real number (NumPy's scalars too), as Lightning. Kept as a tensor, as Lightning: callback_metrics
            # and logged_metrics hold tensors (on the CPU: a number logged every step would otherwise cost a
            # host-to-device copy each time). (scalar_tensor: the same tensor as torch.tensor's, made faster.)
            value = torch.scalar_tensor(float(value), dtype=_FLOAT32)
        elif is_torchmetric(value):
            self._log_metric(entry, key, value)
            return
        else:
            hint = _COLLECTION_HINT if is_torchmetric(value, "MetricCollection") else ""
            raise TypeError(
                f"self.log({name!r}, ...) expects a number or a scalar tensor, got {type(value).__name__} "
                f"(a torchmetrics.Metric may be logged too). {hint}".rstrip()
            )
        # Inline, not _publish_step: this runs for every logged value. A padding batch's own step value
        # describes no new sample: it is dropped. A synced one is every rank's common value (and every rank
        # must join its collective).
        if entry.on_step and (entry.sync_dist or not self.padding):
            step_value = self.strategy.reduce(value, entry.reduce_fx) if entry.sync_dist else value
            step_key = entry.step_key
            if entry.prog_bar:
                self._progress_bar_metrics[step_key] = step_value
            if self.stage == "train":
                self._callback_metrics[step_key] = step_value
                if entry.on_epoch:
                    self._callback_metrics[key] = step_value
                if entry.logger:
                    self.pending_step_logs[step_key] = step_value
            elif entry.logger and self._counting:
                # As Lightning: an evaluation step value goes to the loggers (at this loader's batch count),
                # not to callback_metrics.
                self._eval_step_value(step_key, step_value)
        if entry.on_epoch and not self.padding:
            if batch_size is None and entry.reduce_fx == "mean":
                if self.batch_size is None:
                    self.batch_size = infer_batch_size(self.batch)
                batch_size = self.batch_size
            entry.accumulate(value, batch_size or 1)

    def _publish_step(self, entry: MetricEntry, key: str, step_value: Any) -> None:
        # What log() does inline for a number or a tensor (inline there because it runs for every logged
        # value), for a Metric's batch value.
        step_key = entry.step_key
        if entry.prog_bar:
            self._progress_bar_metrics[step_key] = step_value
        if self.stage == "train":
            self._callback_metrics[step_key] = step_value
            if entry.on_epoch:
                self._callback_metrics[key] = step_value
            if entry.logger:
                self.pending_step_logs[step_key] = step_value
        elif entry.logger and self._counting:
            # As Lightning: an evaluation step value goes to the loggers (at this loader's batch count),
            # not to callback_metrics.
            self._eval_step_value(step_key, step_value)

    def _log_metric(self, entry: MetricEntry, key: str, metric: Any) -> None:
        # Identity, not ``in``: a Metric's == builds a CompositionalMetric.
        mixed = entry.total is not None if entry.metric is None else entry.metric is not metric
        if mixed:
            raise ValueError(
                f"self.log({entry.name!r}, ...) got a torchmetrics.Metric where this name already logged "
                "another value in this epoch. Log each Metric under a name of its own."
            )
        entry.metric = metric
        if not entry.on_step:
            return
        # What the Metric's last forward returned for its batch (None after update() alone: then there is
        # no batch value, and Lightning logs none), as the strategy sees it (DP: the whole batch's, not a replica's).
        batch_value = self.strategy.metric_batch_value(metric)
        if isinstance(batch_value, torch.Tensor) and batch_value.numel() == 1:
            self._publish_step(entry, key, batch_value.detach().float().reshape(()))
        elif batch_value is not None:
            raise ValueError(
                f"self.log({entry.name!r}, metric): its forward returned {type(batch_value).__name__}"
                f"{tuple(batch_value.shape) if isinstance(batch_value, torch.Tensor) else ''}, not a "
                "scalar; only scalars can be logged. Log the values you need under separate names."
            )

    def _new_entry(
        self,
        name: str,
        key: str,
        suffix: str,
        prog_bar: bool,
        logger: bool,
        on_step: bool | None,
        on_epoch: bool | None,
        reduce_fx: ReduceFx,
        sync_dist: bool,
    ) -> MetricEntry:
        if not isinstance(name, str) or not name:
            raise ValueError(f"self.log needs a non-empty string name, got {name!r}.")
        op = parse_reduce_fx(name, reduce_fx)
        fx = self.fx
        step_default = fx in _STEP_HOOKS if self.stage == "train" else False
        on_step = step_default if on_step is None else on_step
        on_epoch = (not step_default) if on_epoch is None else on_epoch
        if fx in _EPOCH_ONLY_HOOKS and (on_step or not on_epoch):
            raise ValueError(
                f"self.log({name!r}, on_step={on_step}, on_epoch={on_epoch}) in {fx}: this hook runs once per "
                "epoch or run, so only on_step=False, on_epoch=True is allowed there (as in Lightning). Drop "
                "on_step / on_epoch, or log per-step values from a step or batch hook."
            )
        if not on_step and not on_epoch:
            raise ValueError(
                f"self.log({name!r}, on_step=False, on_epoch=False) would record nothing; set one of them."
            )
        entry = MetricEntry(name, prog_bar, logger, on_step, on_epoch, op, sync_dist, suffix, self.key_suffix)
        self._entries[key] = entry
        return entry

    # ------------------------------------------------------------------ evaluation step values
    def _eval_step_value(self, key: str, value: Any) -> None:
        loader = self.key_suffix
        at = (loader, self._eval_batches.get(loader, 0))
        if at != self._eval_pending_at:
            self.flush_eval_steps()
            self._eval_pending_at = at
        self.pending_eval_step_logs[key] = value

    def flush_eval_steps(self) -> None:
        """Hand the evaluation step values of the last batch that logged some to ``step_log_sink``."""
        pending = self.pending_eval_step_logs
        if pending:
            if self.step_log_sink is not None:
                self.step_log_sink(dict(pending), self._eval_pending_at[1])
            pending.clear()

    # ------------------------------------------------------------------ epoch end
    def _publish_epoch_so_far(self) -> None:
        """Put the epoch values reduced so far (this process's) into callback_metrics and, for ``prog_bar``
        and ``logger`` ones, progress_bar_metrics and the logged metrics: read inside an epoch-end hook, as in
        Lightning (not the previous epoch's values). ``end_stage`` then publishes the final (cross-process)
        values."""
        cm, bar, logs = self._callback_metrics, self._progress_bar_metrics, self._epoch_logs_so_far
        for e in self._entries.values():
            if not e.on_epoch:
                continue
            if e.metric is not None:
                value = e.metric.compute()  # cached by the Metric until its next update: end_stage reuses it
            elif e.total is not None:
                value = epoch_value(e.reduce_fx, e.total, e.weight)
            else:
                continue
            cm[e.epoch_key] = value
            cm[e.name] = value
            if e.prog_bar:
                bar[e.epoch_key] = value
            if e.logger:
                logs[e.epoch_key] = value

    def end_stage(self) -> dict[str, Any]:
        """Reduce this stage's epoch values (across processes too) and publish them.

        With several processes, the last per-step values are averaged across ranks in the same
        collective, so that after every epoch ``callback_metrics`` is identical on every rank
        (between epochs a step value is this rank's own unless it was logged with ``sync_dist``).

        Returns the epoch-level metrics as tensors, keyed as they appear in ``callback_metrics``.
        """
        self.flush_eval_steps()
        self._epoch_open = False
        self._epoch_logs_so_far.clear()
        cm = self._callback_metrics
        metrics = self._compute_metrics()
        entries = sorted((e for e in self._entries.values() if e.on_epoch and e.metric is None), key=lambda e: e.name)
        # A key this rank logged only in a padding batch has no value here; it joins the reduction with
        # the reduction's identity (the other ranks logged it in real batches).
        rows = [
            (e.name, e.reduce_fx, e.total if e.total is not None else IDENTITY[e.reduce_fx], e.weight) for e in entries
        ]
        steps: list[MetricEntry] = []
        if self.strategy.world_size > 1:
            steps = sorted(
                (e for e in self._entries.values() if e.on_step and not e.sync_dist and e.step_key in cm),
                key=lambda e: e.name,
            )
            rows += [(e.step_key + "/last", e.reduce_fx, cm[e.step_key], 1) for e in steps]
        if not rows and not metrics:
            return {}
        values = reduce_across_processes(self.strategy, rows) if rows else []
        for entry, value in zip(steps, values[len(entries) :]):
            cm[entry.step_key] = value
            if entry.prog_bar:
                self._progress_bar_metrics[entry.step_key] = value
        out: dict[str, Any] = {}
        for entry, value in [*zip(entries, values), *metrics]:
            key = entry.epoch_key
            out[key] = value
            cm[key] = value
            cm[entry.name] = value
            if entry.prog_bar:
                self._progress_bar_metrics[key] = value
        return out

    def _compute_metrics(self) -> list[tuple[MetricEntry, Any]]:
        """``compute()`` every Metric logged per epoch (each synchronises across processes: every rank calls
        them in the same order, by name), then ``reset()`` every logged Metric, as Lightning does."""
        logged = sorted((e for e in self._entries.values() if e.metric is not None), key=lambda e: e.name)
        out = []
        for e in logged:
            if e.on_epoch:
                value = e.metric.compute()
                if not isinstance(value, torch.Tensor) or value.numel() != 1:
                    raise ValueError(
                        f"self.log({e.name!r}, metric): its compute() returned "
                        f"{type(value).__name__}, not a scalar. Log a Metric that computes one "
                        "value, or log the elements of its result under separate names."
                    )
                out.append((e, value.detach().float().reshape(())))
        for e in logged:
            e.metric.reset()
        return out

    def loader_results(self, values: dict[str, Any], suffixes: list[str]) -> list[dict[str, Any]]:
        """Split an evaluation's epoch ``values`` into one dict per loader (``suffixes``: each loader's key
        suffix), as Lightning's ``validate`` / ``test`` return them: the logger-bound values that loader
        logged (``add_dataloader_idx=False`` ones included), and those logged outside any loader (in the
        epoch hooks) in every dict."""
        owner = {e.epoch_key: e.loader for e in self._entries.values() if e.on_epoch and e.logger}
        return [{k: v for k, v in values.items() if k in owner and owner[k] in ("", s)} for s in suffixes]

    def logger_keys(self) -> set[str]:
        return {e.epoch_key for e in self._entries.values() if e.on_epoch and e.logger}
