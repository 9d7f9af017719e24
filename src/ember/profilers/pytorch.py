"""``PyTorchProfiler``: ``torch.profiler`` over the run, each action a ``record_function`` range, and
a Chrome trace that TensorBoard's profiler plugin (``torch-tb-profiler``) and ``chrome://tracing`` open.

The operator table (``key_averages``) is the report. The trace is written by
``torch.profiler.tensorboard_trace_handler`` into ``dirpath`` (the trainer's log folder by default),
one ``<stage>[-<filename>][-<rank>].<time>.pt.trace.json`` per run and rank, so
``tensorboard --logdir <dirpath>`` finds it. A ``schedule`` (``torch.profiler.schedule``) limits
recording to some training batches: the profiler steps once per training batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ember.profilers.base import Profiler


class PyTorchProfiler(Profiler):
    """Records operators (CPU, and CUDA when available) with ``torch.profiler``.

    Args:
        dirpath, filename: where the report and the trace go (see ``Profiler``).
        export_to_chrome: write the trace (``*.pt.trace.json``) for TensorBoard / chrome://tracing.
        sort_by_key: the column the operator table is sorted by (default: total CPU time, or CUDA
            time when CUDA is recorded).
        row_limit: rows in the operator table (-1: all).
        record_module_names: also name each ``nn.Module``'s forward in the trace (slower).
        **profiler_kwargs: passed to ``torch.profiler.profile`` (``activities``, ``schedule``,
            ``record_shapes``, ``profile_memory``, ``with_stack``...).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = None,
        export_to_chrome: bool = True,
        sort_by_key: str | None = None,
        row_limit: int = 20,
        record_module_names: bool = False,
        **profiler_kwargs: Any,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.export_to_chrome = export_to_chrome
        self.row_limit = row_limit
        self.record_module_names = record_module_names
        self.profiler_kwargs = profiler_kwargs
        cuda = torch.cuda.is_available()
        if "activities" not in profiler_kwargs:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            profiler_kwargs["activities"] = acts
        self.sort_by_key = sort_by_key or ("cuda_time_total" if cuda else "cpu_time_total")
        self.profiler: torch.profiler.profile | None = None
        self._ranges: dict[str, Any] = {}
        self._table = ""
        #: The trace files written so far.
        self.trace_paths: list[str] = []

    def _begin(self) -> None:
        on_ready: Callable[..., Any] | None = None
        if self.export_to_chrome:
            folder = self.dirpath or os.getcwd()
            name = (
                os.path.basename(self.report_path(extension="") or "")
                or "-".join(p for p in (self._stage, None if self._rank is None else str(self._rank)) if p)
                or "trace"
            )

            def on_ready(prof: torch.profiler.profile) -> None:
                before = set(os.listdir(folder)) if os.path.isdir(folder) else set()
                torch.profiler.tensorboard_trace_handler(folder, worker_name=name)(prof)
                self.trace_paths += [os.path.join(folder, f) for f in sorted(set(os.listdir(folder)) - before)]

        self.profiler = torch.profiler.profile(
            on_trace_ready=on_ready, with_modules=self.record_module_names, **self.profiler_kwargs
        )
        self.profiler.__enter__()

    def start(self, action_name: str) -> None:
        if self.profiler is None:
            self._begin()
        if action_name in self._ranges:
            raise ValueError(f"Attempted to start {action_name!r}, which has already started; stop it first.")
        rf = torch.profiler.record_function(action_name)
        rf.__enter__()
        self._ranges[action_name] = rf

    def stop(self, action_name: str) -> None:
        rf = self._ranges.pop(action_name, None)
        if rf is None:
            raise ValueError(f"Attempted to stop {action_name!r}, which was never started.")
        rf.__exit__(None, None, None)
        if action_name == "run_training_batch" and self.profiler is not None and "schedule" in self.profiler_kwargs:
            self.profiler.step()

    def _finish(self) -> None:
        prof, self.profiler = self.profiler, None
        if prof is None:
            return
        for rf in reversed(list(self._ranges.values())):
            rf.__exit__(None, None, None)
        self._ranges = {}
        prof.__exit__(None, None, None)  # writes the trace (on_trace_ready)
        try:
            self._table = prof.key_averages().table(sort_by=self.sort_by_key, row_limit=self.row_limit)
        except (AssertionError, RuntimeError, KeyError):  # nothing recorded (a schedule that never became active)
            self._table = ""

    def summary(self) -> str:
        self._finish()
        return self._stats_to_str({"records": self._table}) if self._table else ""

    def teardown(self, stage: str | None = None) -> None:
        self._finish()
        super().teardown(stage)
