"""The evaluation and predict loops: ``validation_step`` / ``test_step`` / ``predict_step`` over loaders.

Per batch: on_before_batch_transfer -> transfer_batch_to_device -> on_after_batch_transfer ->
on_*_batch_start -> *_step (under no_grad and the precision's
autocast) -> on_*_batch_end. Evaluation epochs reduce what ``self.log`` collected (across
processes too) and return one metric dict per loader.

Under several processes every rank must run the same number of steps, because a step may hold a
collective (``self.log(..., on_step=True, sync_dist=True)``, an all-gather) that every rank has to
join. Loaders with a length are sharded by the strategy with at least one sample per rank, and a
shard that would yield a batch fewer than the longest ends with a *padding batch* (see
``data/sampler.py``). The padding batch goes through the batch transfer, the batch hooks and
the step like any other, but nothing logged while it runs counts toward an epoch value, so the
epoch-end reduction, one collective weighted by sample counts, gives the exact metric over the
real samples. Over loaders without a length (an ``IterableDataset`` each rank feeds itself) the
ranks agree before each step, in one small all-reduce, whether any of them still has a batch; a
rank whose stream ended first runs copies of its own first batch as padding batches meanwhile,
and a rank with no batch at all raises on every rank. Predict is not padded (as in Lightning):
its outputs are the dataset's, each sample once, and each rank runs its own batches.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from ember.batches import sized_len
from ember.callbacks.prediction_writer import BasePredictionWriter
from ember.data.batch_indices import IndexRecorder, track_batch_indices
from ember.data.resumable import resumable_sampler_of, shutdown_workers
from ember.metric_values import to_floats
from ember.module import TrainModule
from ember.module_hooks import restore_modes
from ember.overrides import defines_hook, is_overridden
from ember.profilers.base import wrap
from ember.signatures import hook_parameters, takes_dataloader_iter
from ember.trainer.dataloader_iter import DataLoaderIter, Fetched, last_by_count, last_by_lookahead
from ember.trainer.loader_checks import warn_if_short
from ember.trainer.loaders import batch_transfer
from ember.trainer.lockstep import COUNT_REST_SECONDS

if TYPE_CHECKING:
    from ember.strategies.strategy import Strategy
    from ember.trainer.hooks import Hooks
    from ember.trainer.metrics import MetricCollector
    from ember.trainer.precision import Precision
    from ember.trainer.trainer import Trainer


_END = object()
_KIND = {"sanity": "val", "validate": "val", "test": "test", "predict": "predict"}  # a loader's name, by stage
_Batches = Iterator[tuple[Any, bool]]  # (batch, whether it is a padding batch)


class EvaluationLoop:
    """Runs evaluation (validate, test, the sanity check) and predict over a run's loaders.

    Args:
        trainer: the run's Trainer (datamodule and strategy, for the batch transfer).
        module: the run's TrainModule.
        hooks: the run's hooks.
        metrics: the run's ``self.log`` collector.
        precision: autocast around the steps.
        input_dtype: floating inputs are cast to it (64-true), or None.
    """

    def __init__(
        self,
        trainer: Trainer,
        module: TrainModule,
        hooks: Hooks,
        metrics: MetricCollector,
        precision: Precision,
        input_dtype: torch.dtype | None,
    ) -> None:
        self.trainer, self.module, self.hooks, self.metrics, self.precision = trainer, module, hooks, metrics, precision
        self.input_dtype = input_dtype
        self.strategy = trainer.strategy

    # ------------------------------------------------------------------ model mode
    def _to_eval(self, hook: str) -> None:
        """``on_{hook}_model_eval``: remember each submodule's ``training`` flag, then the hook (default ``eval()``)."""
        module = self.module
        module.__dict__["_ember_saved_modes"] = [(m, m.training) for m in module.modules()]  # read by restore_modes
        if defines_hook(f"on_{hook}_model_eval", module, TrainModule):
            getattr(module, f"on_{hook}_model_eval")()
        else:
            module.eval()

    def _back_to_train(self, hook: str) -> None:
        """``on_{hook}_model_train`` (default: every submodule gets back its own previous flag)."""
        module = self.module
        try:
            name = f"on_{hook}_model_train"
            if hook != "predict" and is_overridden(name, module, TrainModule):
                getattr(module, name)()
            else:
                restore_modes(module)
        finally:
            module.__dict__.pop("_ember_saved_modes", None)

    # ------------------------------------------------------------------ one loader
    def _run_loader(
        self,
        hook: str,
        loader: Any,
        limit: float,
        dl_idx: int,
        many: bool,
        keep: list[Any] | None,
        stage: str,
        recorder: IndexRecorder | None = None,
    ) -> None:
        """Run ``{hook}_step`` with its batch hooks over the first ``limit`` batches of ``loader`` (and a
        padding batch where this rank has fewer than another), under no_grad and autocast; append each
        output of a real batch to ``keep`` (predict)."""
        metrics = self.metrics
        step_fn = wrap(
            self.trainer.profiler,
            f"[Strategy]{type(self.strategy).__name__}.{hook}_step",
            getattr(self.strategy, f"{hook}_step"),
        )  # (the method itself when not profiling)
        batch_start = self.hooks.get(f"on_{hook}_batch_start")
        batch_end = self.hooks.get(f"on_{hook}_batch_end")
        fx_start, fx_step, fx_end = f"on_{hook}_batch_start", f"{hook}_step", f"on_{hook}_batch_end"
        extra = (dl_idx,) if many else ()  # dataloader_idx only with several loaders, as in Lightning
        transfer = batch_transfer(self.trainer, dl_idx, self.input_dtype)
        autocast = self.precision.autocast
        if self.strategy.world_size > 1 and hook != "predict" and _unsized(loader):
            batches = _agreed(loader, limit, self.strategy, dl_idx if many else None, stage)
        else:
            batches = _sharded(loader, limit, f"{_KIND[stage]} dataloader {dl_idx}")
        record = self.trainer.predict_loop if hook == "predict" else None
        for batch_idx, (batch, padding) in enumerate(batches):
            metrics.padding = padding
            if record is not None:
                record.batch(recorder, dl_idx, padding)
            if transfer is not None:
                batch = transfer(batch)
            metrics.eval_batch(batch)
            metrics.batch_size = None
            metrics.fx = fx_start
            for h in batch_start:
                h(batch, batch_idx, *extra)
            metrics.fx = fx_step
            with autocast():
                out = step_fn(batch, batch_idx, *extra)
            metrics.fx = fx_end
            for h in batch_end:
                h(out, batch, batch_idx, *extra)
            if keep is not None and not padding:
                keep.append(out)
        metrics.padding = False

    # ------------------------------------------------------------------ a step that fetches its own batches
    def _run_iter(
        self,
        hook: str,
        loaders: list[Any],
        limits: list[float],
        suffixes: list[str],
        keep: list[list[Any]] | None,
        stage: str,
    ) -> None:
        """Run ``{hook}_step(self, dataloader_iter)`` until its batches run out (``trainer/dataloader_iter.py``):
        one iterator over the loaders one after the other (the first ``limit`` batches of each, with the padding
        batches of ``_run_loader``), the batch hooks around each step with the last batch fetched, and each
        output of a step appended to ``keep`` under the loader of the last batch it fetched (predict)."""
        metrics, strategy = self.metrics, self.strategy
        step_fn = wrap(
            self.trainer.profiler, f"[Strategy]{type(strategy).__name__}.{hook}_step", getattr(strategy, f"{hook}_step")
        )
        batch_start = self.hooks.get(f"on_{hook}_batch_start")
        batch_end = self.hooks.get(f"on_{hook}_batch_end")
        fx_start, fx_step, fx_end = f"on_{hook}_batch_start", f"{hook}_step", f"on_{hook}_batch_end"
        many = len(loaders) > 1  # hooks get dataloader_idx only then, as in Lightning
        autocast = self.precision.autocast
        agree = strategy.world_size > 1 and hook != "predict"

        def entries() -> Iterator[tuple[Fetched, bool]]:
            for dl_idx, (loader, limit) in enumerate(zip(loaders, limits)):
                if agree and _unsized(loader):
                    batches = _agreed(loader, limit, strategy, dl_idx if many else None, stage)
                else:
                    batches = _sharded(loader, limit, f"{_KIND[stage]} dataloader {dl_idx}")
                for batch_idx, (batch, padding) in enumerate(batches):
                    yield (batch, batch_idx, dl_idx), padding

        def on_fetch(entry: tuple[Fetched, bool]) -> Fetched:
            # What self.log in the step weighs its value by, and under which loader's name it goes: the batch
            # fetched last (set before the batch: eval_batch counts the loader's batches).
            fetched, metrics.padding = entry
            metrics.key_suffix = suffixes[fetched[2]]
            metrics.eval_batch(fetched[0])
            metrics.batch_size = None
            return fetched

        total = sum(limits)
        stream = last_by_count(entries(), int(total)) if total != math.inf else last_by_lookahead(entries())
        fetcher = DataLoaderIter(stream, total if total != math.inf else None, on_fetch)
        metrics.key_suffix = suffixes[0]
        metrics.eval_batch(None)
        metrics.batch_size = None
        while not fetcher.done:
            args = (fetcher.batch, fetcher.batch_idx, fetcher.dataloader_idx)[: 3 if many else 2]
            metrics.fx = fx_start
            for h in batch_start:
                h(*args)
            metrics.fx = fx_step
            try:
                with autocast():
                    out = step_fn(fetcher, 0)
            except StopIteration:  # it asked for a batch past the last: the step is dropped, the loop ends
                break
            args = (fetcher.batch, fetcher.batch_idx, fetcher.dataloader_idx)[: 3 if many else 2]
            metrics.fx = fx_end
            for h in batch_end:
                h(out, *args)
            if keep is not None and not metrics.padding:
                keep[fetcher.dataloader_idx].append(out)
        metrics.padding = False

    # ------------------------------------------------------------------ evaluation
    def run(self, stage: str, loaders: list[Any], limits: list[float]) -> list[dict[str, Any]]:
        """Run ``validation_step`` / ``test_step`` over ``loaders``; return one metric dict per loader.

        ``stage`` is "validate", "test" or "sanity" (a validation whose metrics are thrown away).
        With no batch to run at all, no hook runs and the result is an empty list (as in Lightning).
        """
        many = len(loaders) > 1
        if not any(limits):
            return []
        hook = "validation" if stage in ("validate", "sanity") else "test"
        iterator_step = takes_dataloader_iter(getattr(self.module, f"{hook}_step"))
        check_dataloader_idx(self.module, hook, many, iterator_step)
        metrics, hooks = self.metrics, self.hooks
        metrics.start_stage(stage)
        self._to_eval(hook)
        try:
            hooks.call(f"on_{hook}_start")
            hooks.call(f"on_{hook}_epoch_start")
            suffixes = [f"/dataloader_idx_{i}" if many else "" for i in range(len(loaders))]
            self.strategy.prepare_for_evaluation()
            try:
                with torch.no_grad():
                    if iterator_step:
                        self._run_iter(hook, loaders, limits, suffixes, None, stage)
                    else:
                        for dl_idx, (loader, limit) in enumerate(zip(loaders, limits)):
                            metrics.key_suffix = suffixes[dl_idx]
                            self._run_loader(hook, loader, limit, dl_idx, many, None, stage)
                metrics.key_suffix = ""
                hooks.call(f"on_{hook}_epoch_end")
                epoch_metrics = metrics.end_stage()
            finally:
                metrics.key_suffix = ""
            hooks.call(f"on_{hook}_end")
        finally:
            self._back_to_train(hook)
        return metrics.loader_results(to_floats(epoch_metrics), suffixes)

    # ------------------------------------------------------------------ predict
    def predict(self, loaders: list[Any], limits: list[float], keep: bool = True) -> list[list[Any]]:
        """Run ``predict_step`` over ``loaders``; return one list of outputs per loader (empty lists when
        ``keep`` is False: ``return_predictions=False`` holds no output in memory); none at all when there is
        no batch to run (then ``Trainer.predict`` returns None, as in Lightning)."""
        if not any(limits):
            return []
        many = len(loaders) > 1
        iterator_step = takes_dataloader_iter(self.module.predict_step)
        check_dataloader_idx(self.module, "predict", many, iterator_step)
        hooks = self.hooks
        self._to_eval("predict")
        results: list[list[Any]] = [[] for _ in loaders]
        self.trainer.predict_loop.start(results, len(loaders))
        # As Lightning: the outputs are kept for a writer that writes them all at the end, whatever the caller keeps.
        keep = keep or any(
            isinstance(cb, BasePredictionWriter) and cb.interval.on_epoch for cb in self.trainer.callbacks
        )
        tracked = [(loader, None) for loader in loaders] if iterator_step else list(map(track_batch_indices, loaders))
        try:
            self.strategy.prepare_for_evaluation()
            hooks.call("on_predict_start")
            hooks.call("on_predict_epoch_start")
            with torch.no_grad():
                if iterator_step:
                    self._run_iter(
                        "predict", loaders, limits, [""] * len(loaders), results if keep else None, "predict"
                    )
                else:
                    for dl_idx, ((loader, recorder), limit) in enumerate(zip(tracked, limits)):
                        kept = results[dl_idx] if keep else None
                        self._run_loader("predict", loader, limit, dl_idx, many, kept, "predict", recorder)
            hooks.call("on_predict_epoch_end")
            hooks.call("on_predict_end")
        finally:
            for loader, recorder in tracked:
                if recorder is not None:  # the copies made to follow the indices: their workers end here
                    shutdown_workers(loader)
            self._back_to_train("predict")
        return results


def _sharded(loader: Any, limit: float, name: str) -> _Batches:
    """``(batch, padding)`` for the first ``limit`` batches of a loader whose padding, if any, its
    sampler placed (``data/sampler.py``): batches from ``real_batches`` on are padding. ``name``: the loader,
    for the warning that it yielded fewer batches than its length."""
    real = getattr(resumable_sampler_of(loader), "real_batches", None)
    real = math.inf if real is None else real
    batch_idx = -1
    for batch_idx, batch in enumerate(loader):
        if batch_idx >= limit:
            return
        yield batch, batch_idx >= real
    warn_if_short(loader, batch_idx + 1, limit, name)


def _agreed(loader: Any, limit: float, strategy: Strategy, dl_idx: int | None, stage: str) -> _Batches:
    """``(batch, padding)`` over a loader without a length, under several processes, until no rank has
    a batch left: every rank runs the same steps.

    Each rank feeds itself here (an ``IterableDataset`` split by rank), so only the ranks can tell
    when all of them are done: before each step they count, in one all-reduce of one element, how
    many still have a batch. A rank whose stream ended while others go on runs a copy of its own
    first batch (copied before any hook could change it) as a padding batch. A rank with no batch at
    all has nothing to pad with: then every rank raises, naming each rank's count.
    """
    batches = iter(loader)
    first: Any = _END
    position = 0
    while True:
        batch = next(batches, _END) if position < limit else _END
        holders = int(strategy.reduce(torch.tensor(0 if batch is _END else 1), "sum"))
        if holders == 0:
            return
        if position == 0 and holders < strategy.world_size:
            _raise_empty(strategy, batch, batches, limit, dl_idx, stage)
        if batch is _END:
            yield copy.deepcopy(first), True
        else:
            if position == 0:
                first = copy.deepcopy(batch)
            yield batch, False
        position += 1


def _raise_empty(
    strategy: Strategy, batch: Any, batches: Iterator[Any], limit: float, dl_idx: int | None, stage: str
) -> NoReturn:
    """Raise on every rank that some rank's loader yielded no batch while others' did (a collective):
    a rank with batches counts them first, for at most ``COUNT_REST_SECONDS``, for the message."""
    count, exact = 0, True
    if batch is not _END:
        count, deadline = 1, time.monotonic() + COUNT_REST_SECONDS
        for _ in batches:
            if count >= limit:
                break
            if time.monotonic() > deadline:
                exact = False
                break
            count += 1
    rows = strategy.gather_per_rank(torch.tensor([count, int(exact)])).tolist()
    listed = ", ".join(f"rank {r}: {n}" if e else f"rank {r}: at least {n}" for r, (n, e) in enumerate(rows))
    which = "" if dl_idx is None else f" {dl_idx}"
    name = {"sanity": "validation", "validate": "validation"}.get(stage, stage)
    raise ValueError(
        f"The {name} dataloader{which} yielded no batch on some ranks and batches on others ({listed}). "
        "Every rank runs the same evaluation steps, and a rank whose loader ran out repeats its own first batch, "
        "so every rank needs at least one batch of each evaluation loader. Give every rank's IterableDataset at "
        "least one batch (split the data by trainer.global_rank and trainer.world_size), or evaluate with fewer "
        "processes."
    )


def _unsized(loader: Any) -> bool:
    """Whether ``loader`` has no length."""
    return sized_len(loader) is None


def check_dataloader_idx(module: TrainModule, hook: str, many: bool, iterator_step: bool) -> None:
    """As Lightning, before an evaluation or predict run: with several loaders, ``{hook}_step`` (unless it takes
    ``dataloader_iter``) and the module's ``on_{hook}_batch_start`` / ``_end`` must take ``dataloader_idx``
    (``*args`` will do); with one loader they get none, so a ``dataloader_idx`` without a default is refused."""
    names = [f"on_{hook}_batch_start", f"on_{hook}_batch_end"]
    if not iterator_step:
        names.insert(0, f"{hook}_step")
    loader = "test" if hook == "test" else "val" if hook == "validation" else hook
    for name in names:
        fn = getattr(module, name, None)
        params = hook_parameters(fn) if callable(fn) else None
        if params is None:
            continue
        args, varargs, required = params
        if many and "dataloader_idx" not in args and not varargs:
            raise RuntimeError(
                f"There are several {loader} dataloaders, but {type(module).__name__}.{name}() takes no "
                f"dataloader_idx: add `dataloader_idx=0` to its arguments (it is told which loader each batch is from)."
            )
        if not many and "dataloader_idx" in args[:required]:
            raise RuntimeError(
                f"There is one {loader} dataloader, but {type(module).__name__}.{name}() requires "
                "dataloader_idx, which is given only with several: give it a default "
                "(`dataloader_idx=0`) or remove it."
            )
