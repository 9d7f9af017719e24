"""The evaluation and predict loops: ``validation_step`` / ``test_step`` / ``predict_step`` over loaders.

Per batch: on_before_batch_transfer -> transfer_batch_to_device -> on_after_batch_transfer ->
on_*_batch_start -> *_step (under no_grad and the precision's
autocast) -> on_*_batch_end. Evaluation epochs reduce what ``self.log`` collected (across
processes too) and return one metric dict per loader.

Under several processes each rank runs its own number of batches: the steps do not communicate,
and the epoch-end reduction is one collective weighted by sample counts, so ranks whose loaders
yield different numbers of batches still get the exact metric over all of them. Loaders with a
length are sharded by the strategy with at least one sample per rank; for loaders without one
(an ``IterableDataset`` each rank feeds itself), the ranks compare their batch counts once at the
end, so that a rank with no batch at all, which has nothing to reduce, raises on every rank
instead of leaving the others waiting in the reduction.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ember.module import TrainModule, _restore_modes
from ember.profilers.base import wrap
from ember.trainer.loaders import batch_transfer
from ember.utils import to_floats

if TYPE_CHECKING:
    from ember.strategies.strategy import Strategy
    from ember.trainer.hooks import Hooks
    from ember.trainer.metrics import MetricCollector
    from ember.trainer.precision import Precision
    from ember.trainer.trainer import Trainer


def _overrides(module: Any, name: str) -> bool:
    return getattr(type(module), name) is not getattr(TrainModule, name)


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

    def __init__(self, trainer: Trainer, module: TrainModule, hooks: Hooks, metrics: MetricCollector,
                 precision: Precision, input_dtype: torch.dtype | None) -> None:
        self.trainer, self.module, self.hooks, self.metrics, self.precision = trainer, module, hooks, metrics, precision
        self.input_dtype = input_dtype
        self.strategy = trainer.strategy

    # ------------------------------------------------------------------ model mode
    def _to_eval(self, hook: str) -> None:
        """``on_{hook}_model_eval``: remember each submodule's ``training`` flag, then the hook (default ``eval()``)."""
        module = self.module
        module.__dict__["_ember_saved_modes"] = [(m, m.training) for m in module.modules()]  # read by _restore_modes
        if _overrides(module, f"on_{hook}_model_eval"):
            getattr(module, f"on_{hook}_model_eval")()
        else:
            module.eval()

    def _back_to_train(self, hook: str) -> None:
        """``on_{hook}_model_train`` (default: every submodule gets back its own previous flag)."""
        module = self.module
        try:
            name = f"on_{hook}_model_train"
            if hook != "predict" and _overrides(module, name):
                getattr(module, name)()
            else:
                _restore_modes(module)
        finally:
            module.__dict__.pop("_ember_saved_modes", None)

    # ------------------------------------------------------------------ one loader
    def _run_loader(self, hook: str, loader: Any, limit: float, dl_idx: int, many: bool,
                    keep: list[Any] | None) -> int:
        """Run ``{hook}_step`` with its batch hooks over the first ``limit`` batches of ``loader``, under
        no_grad and autocast; append each output to ``keep`` (predict). Returns the batches run."""
        metrics = self.metrics
        step_fn = wrap(self.trainer.profiler, f"[Strategy]{type(self.strategy).__name__}.{hook}_step",
                       getattr(self.strategy, f"{hook}_step"))  # (the method itself when not profiling)
        batch_start = self.hooks.get(f"on_{hook}_batch_start")
        batch_end = self.hooks.get(f"on_{hook}_batch_end")
        fx_start, fx_step, fx_end = f"on_{hook}_batch_start", f"{hook}_step", f"on_{hook}_batch_end"
        extra = (dl_idx,) if many else ()  # dataloader_idx only with several loaders, as in Lightning
        transfer = batch_transfer(self.trainer, dl_idx, self.input_dtype)
        autocast = self.precision.autocast
        ran = 0
        for batch_idx, batch in enumerate(loader):
            if batch_idx >= limit:
                break
            ran += 1
            batch = transfer(batch)
            metrics.batch = batch
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
            if keep is not None:
                keep.append(out)
        return ran

    # ------------------------------------------------------------------ evaluation
    def run(self, stage: str, loaders: list[Any], limits: list[float]) -> list[dict[str, Any]]:
        """Run ``validation_step`` / ``test_step`` over ``loaders``; return one metric dict per loader.

        ``stage`` is "validate", "test" or "sanity" (a validation whose metrics are thrown away).
        With no batch to run at all, no hook runs (as in Lightning) and the result is empty.
        """
        many = len(loaders) > 1
        if not any(limits):
            return [{} for _ in loaders]
        hook = "validation" if stage in ("validate", "sanity") else "test"
        metrics, hooks = self.metrics, self.hooks
        metrics.start_stage(stage)
        self._to_eval(hook)
        try:
            hooks.call(f"on_{hook}_start")
            hooks.call(f"on_{hook}_epoch_start")
            suffixes = [f"/dataloader_idx_{i}" if many else "" for i in range(len(loaders))]
            ran: list[int] = []  # batches run per loader
            self.strategy.prepare_for_evaluation()
            try:
                with torch.no_grad():
                    for dl_idx, (loader, limit) in enumerate(zip(loaders, limits)):
                        metrics.key_suffix = suffixes[dl_idx]
                        ran.append(self._run_loader(hook, loader, limit, dl_idx, many, None))
                if self.strategy.world_size > 1 and _has_unsized(loaders):
                    # Each rank ran its own number of batches (evaluation steps do not communicate), but the
                    # epoch-end reduction below needs every rank to have logged something for each loader.
                    _check_counts(self.strategy, ran, stage)
                metrics.key_suffix = ""
                hooks.call(f"on_{hook}_epoch_end")
                epoch_metrics = metrics.end_stage()
            finally:
                metrics.key_suffix = ""
            hooks.call(f"on_{hook}_end")
        finally:
            self._back_to_train(hook)
        floats = to_floats(epoch_metrics)
        if not many:
            return [floats]
        # Each loader's dict: its own keys, and keys logged outside any loader (in the epoch hooks), as Lightning.
        return [{k: v for k, v in floats.items() if k.endswith(s) or "/dataloader_idx_" not in k} for s in suffixes]

    # ------------------------------------------------------------------ predict
    def predict(self, loaders: list[Any], limits: list[float], keep: bool = True) -> list[list[Any]]:
        """Run ``predict_step`` over ``loaders``; return one list of outputs per loader (empty lists when
        ``keep`` is False: ``return_predictions=False`` holds no output in memory)."""
        if not any(limits):
            return [[] for _ in loaders]
        many = len(loaders) > 1
        hooks = self.hooks
        self._to_eval("predict")
        results: list[list[Any]] = []
        try:
            self.strategy.prepare_for_evaluation()
            hooks.call("on_predict_start")
            hooks.call("on_predict_epoch_start")
            with torch.no_grad():
                for dl_idx, (loader, limit) in enumerate(zip(loaders, limits)):
                    results.append([])
                    self._run_loader("predict", loader, limit, dl_idx, many, results[-1] if keep else None)
            hooks.call("on_predict_epoch_end")
            hooks.call("on_predict_end")
        finally:
            self._back_to_train("predict")
        return results


def _check_counts(strategy: Strategy, counts: list[int], stage: str) -> None:
    """Raise on every rank if some rank ran no batch of an evaluation loader that others ran (a collective).

    Args:
        strategy: supplies ``world_size`` and ``all_gather``.
        counts: batches this rank ran, per loader.
        stage: "validate", "sanity", "test" for the message.
    """
    rows = strategy.all_gather(torch.tensor(counts)).tolist()  # [world][loader]
    for dl_idx in range(len(counts)):
        per_rank = [row[dl_idx] for row in rows]
        if min(per_rank) == 0 < max(per_rank):
            which = f" {dl_idx}" if len(counts) > 1 else ""
            name = {"sanity": "validation", "validate": "validation"}.get(stage, stage)
            listed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(per_rank))
            raise ValueError(
                f"The {name} dataloader{which} yielded no batch on some ranks and batches on others ({listed}). "
                "Epoch metrics are reduced across ranks from what each rank logged, so every rank needs at least "
                "one batch of each evaluation loader. Give every rank's IterableDataset at least one batch "
                "(split the data by trainer.global_rank and trainer.world_size), or evaluate with fewer processes.")


def _has_unsized(loaders: list[Any]) -> bool:
    """Whether any of ``loaders`` has no length."""
    for loader in loaders:
        try:
            len(loader)
        except TypeError:
            return True
    return False
