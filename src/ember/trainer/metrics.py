"""What ``self.log`` collects: per-step values, per-epoch reductions, and their cross-rank reduction.

Hot-path rule: nothing here calls ``.item()`` or otherwise waits for a device. Values stay tensors
until something actually prints or writes them (the progress bar's refresh, a logger's write),
and ``to_floats`` converts a whole dict with one stack-and-copy.
"""
from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import torch

from ember.types import REDUCE_OPS, ReduceOp
from ember.utils import infer_batch_size

if TYPE_CHECKING:
    from ember.strategies.strategy import Strategy

_REDUCE_FX = REDUCE_OPS
_FLOAT32 = torch.float32
# Hooks whose ``self.log`` defaults to per-step values; everything else defaults to per-epoch.
_STEP_HOOKS = frozenset({
    "training_step", "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad",
})


_ENTRY_FIELDS = ("name", "prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "sync_dist")


class _Entry:
    __slots__ = ("name", "prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "sync_dist", "total", "weight",
                 "step_key")

    def __init__(self, name: str, prog_bar: bool, logger: bool, on_step: bool, on_epoch: bool,
                 reduce_fx: ReduceOp, sync_dist: bool) -> None:
        self.name, self.prog_bar, self.logger = name, prog_bar, logger
        self.on_step, self.on_epoch, self.reduce_fx, self.sync_dist = on_step, on_epoch, reduce_fx, sync_dist
        self.total: Any = None
        self.weight: Any = 0
        #: Where this entry's per-step value appears in callback_metrics.
        self.step_key = name + "_step" if on_epoch else name

    def accumulate(self, value: Any, batch_size: int) -> None:
        fx = self.reduce_fx
        if self.total is None:
            self.total = value * batch_size if fx == "mean" else value
            self.weight = batch_size
            return
        if fx == "mean":
            self.total = self.total + value * batch_size
            self.weight += batch_size
        elif fx == "sum":
            self.total = self.total + value
        elif fx == "max":
            self.total = torch.maximum(self.total, value) if isinstance(value, torch.Tensor) else max(self.total, value)
        else:
            self.total = torch.minimum(self.total, value) if isinstance(value, torch.Tensor) else min(self.total, value)


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
        self._stages: dict[str, dict[str, _Entry]] = {}
        self._entries: dict[str, _Entry] = {}
        #: The batch being processed and its inferred size (None until a mean needs it). The loops
        #: set both per batch as plain attribute stores (no call on the per-step path).
        self.batch: Any = None
        self.batch_size: int | None = None
        #: Latest value of every key: what callbacks (checkpointing, early stopping) read.
        self.callback_metrics: dict[str, Any] = {}
        self.progress_bar_metrics: dict[str, Any] = {}
        #: Step values logged since the last logger write, for keys with ``logger=True``.
        self.pending_step_logs: dict[str, Any] = {}

    # ------------------------------------------------------------------ loop-facing
    def start_stage(self, stage: str) -> None:
        """Begin an epoch of ``stage``: forget that stage's previous accumulations."""
        self.stage = stage
        self._entries = self._stages[stage] = {}

    def resume_stage(self, stage: str) -> None:
        """Switch back to ``stage`` keeping its accumulations (training after a mid-epoch validation)."""
        self.stage = stage
        self._entries = self._stages.setdefault(stage, {})

    def state_dict(self) -> list[dict[str, Any]]:
        """The running sums behind the training epoch's ``on_epoch`` metrics (what a mid-epoch checkpoint
        saves, so that a resume logs the same epoch values), as plain data on the CPU."""
        out = []
        for e in self._stages.get("train", {}).values():
            d: dict[str, Any] = {f: getattr(e, f) for f in _ENTRY_FIELDS}
            d["total"] = e.total.detach().to("cpu") if isinstance(e.total, torch.Tensor) else e.total
            d["weight"] = e.weight.detach().to("cpu") if isinstance(e.weight, torch.Tensor) else e.weight
            out.append(d)
        return out

    def load_state_dict(self, saved: list[dict[str, Any]], device: torch.device) -> None:
        """Put back the training epoch's running sums from ``state_dict()``, on ``device``."""
        stage = {}
        for d in saved:
            e = _Entry(*(d[f] for f in _ENTRY_FIELDS))
            e.total = d["total"].to(device) if isinstance(d["total"], torch.Tensor) else d["total"]
            e.weight = d["weight"].to(device) if isinstance(d["weight"], torch.Tensor) else d["weight"]
            stage[e.name] = e
        self._stages["train"] = stage

    # ------------------------------------------------------------------ what self.log calls
    def log(self, name: str, value: Any, *, prog_bar: bool = False, logger: bool = True, on_step: bool | None = None,
            on_epoch: bool | None = None, reduce_fx: ReduceOp = "mean", batch_size: int | None = None,
            sync_dist: bool = False) -> None:
        if self.key_suffix:
            name += self.key_suffix
        entry = self._entries.get(name)
        if entry is None:
            entry = self._new_entry(name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist)
        if isinstance(value, torch.Tensor):
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
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
        else:
            raise TypeError(f"self.log({name!r}, ...) expects a number or a scalar tensor, got {type(value).__name__}.")
        if entry.on_step:
            synced = entry.sync_dist and isinstance(value, torch.Tensor)
            step_value = self.strategy.reduce(value, entry.reduce_fx) if synced else value
            key = entry.step_key
            self.callback_metrics[key] = step_value
            if entry.on_epoch:
                self.callback_metrics[name] = step_value
            if entry.prog_bar:
                self.progress_bar_metrics[key] = step_value
            if entry.logger and self.stage == "train":
                self.pending_step_logs[key] = step_value
        if entry.on_epoch:
            if batch_size is None and entry.reduce_fx == "mean":
                if self.batch_size is None:
                    self.batch_size = infer_batch_size(self.batch)
                batch_size = self.batch_size
            entry.accumulate(value, batch_size or 1)

    def _new_entry(self, name: str, value: Any, prog_bar: bool, logger: bool, on_step: bool | None,
                   on_epoch: bool | None, reduce_fx: ReduceOp, sync_dist: bool) -> _Entry:
        if not isinstance(name, str) or not name:
            raise ValueError(f"self.log needs a non-empty string name, got {name!r}.")
        if reduce_fx not in _REDUCE_FX:
            raise ValueError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): reduce_fx must be one of {_REDUCE_FX}.")
        step_default = self.stage == "train" and self.fx in _STEP_HOOKS
        on_step = step_default if on_step is None else on_step
        on_epoch = (not step_default) if on_epoch is None else on_epoch
        if self.stage != "train" and on_step:
            on_step = False  # evaluation values are only meaningful over the whole evaluation epoch
            on_epoch = True
        if not on_step and not on_epoch:
            raise ValueError(f"self.log({name!r}, on_step=False, on_epoch=False) would record nothing; "
                             "set one of them.")
        entry = _Entry(name, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist)
        self._entries[name] = entry
        return entry

    # ------------------------------------------------------------------ epoch end
    def end_stage(self) -> dict[str, Any]:
        """Reduce this stage's epoch values (across processes too) and publish them.

        With several processes, the last per-step values are averaged across ranks in the same
        collective, so that after every epoch ``callback_metrics`` is identical on every rank
        (between epochs a step value is this rank's own unless it was logged with ``sync_dist``).

        Returns the epoch-level metrics as tensors/floats, keyed as they appear in ``callback_metrics``.
        """
        entries = sorted((e for e in self._entries.values() if e.on_epoch), key=lambda e: e.name)
        rows = [(e.name, e.reduce_fx, e.total, e.weight) for e in entries]
        steps: list[_Entry] = []
        if self.strategy.world_size > 1:
            steps = sorted((e for e in self._entries.values() if e.on_step and not e.sync_dist
                            and e.step_key in self.callback_metrics), key=lambda e: e.name)
            rows += [(e.step_key + "/last", e.reduce_fx, self.callback_metrics[e.step_key], 1) for e in steps]
        if not rows:
            return {}
        values = self._reduce_across_processes(rows)
        for entry, value in zip(steps, values[len(entries):]):
            self.callback_metrics[entry.step_key] = value
            if entry.prog_bar:
                self.progress_bar_metrics[entry.step_key] = value
        out: dict[str, Any] = {}
        for entry, value in zip(entries, values):
            key = entry.name + "_epoch" if entry.on_step else entry.name
            out[key] = value
            self.callback_metrics[key] = value
            self.callback_metrics[entry.name] = value
            if entry.prog_bar:
                self.progress_bar_metrics[key] = value
        return out

    def logger_keys(self) -> set[str]:
        return {(e.name + "_epoch" if e.on_step else e.name) for e in self._entries.values() if e.on_epoch and e.logger}

    def _reduce_across_processes(self, rows: list[tuple[str, ReduceOp, Any, Any]]) -> list[Any]:
        """Reduce ``(name, reduce_fx, total, weight)`` rows: a weighted mean, or a sum / max / min."""
        if self.strategy.world_size == 1:
            return [total / weight if fx == "mean" else total for _, fx, total, weight in rows]
        # One collective per epoch: gather (total, weight) of every key from every rank, reduce here.
        device = self.strategy.root_device
        names_hash = float(zlib.crc32("\0".join(name for name, *_ in rows).encode()))
        flat = [torch.tensor(names_hash, dtype=torch.float64, device=device)]
        for _, _, total, weight in rows:
            flat.append(torch.as_tensor(total, dtype=torch.float64, device=device).reshape(()))
            flat.append(torch.as_tensor(weight, dtype=torch.float64, device=device).reshape(()))
        gathered = self.strategy.all_gather(torch.stack(flat))  # [world, 1 + 2k]
        if not bool((gathered[:, 0] == gathered[0, 0]).all()):
            raise RuntimeError(
                "Processes logged different metric names at epoch end, so their values cannot be reduced together. "
                f"This process logged {[name for name, *_ in rows]}. Log the same names on every rank."
            )
        results = []
        for i, (_, fx, _, _) in enumerate(rows):
            totals, weights = gathered[:, 1 + 2 * i], gathered[:, 2 + 2 * i]
            if fx == "mean":
                v = totals.sum() / weights.sum()
            elif fx == "sum":
                v = totals.sum()
            elif fx == "max":
                v = totals.max()
            else:
                v = totals.min()
            results.append(v.float())
        return results
