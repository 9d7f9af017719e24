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
from ember.utils import to_floats

if TYPE_CHECKING:
    from ember.strategies.strategy import Strategy
    from ember.trainer.trainer import Trainer


def _overrides(module: Any, name: str) -> bool:
    return getattr(type(module), name) is not getattr(TrainModule, name)


def _to_eval(trainer: Trainer, hook: str) -> None:
    """``on_{hook}_model_eval``: remember each submodule's ``training`` flag, then the hook (default ``eval()``)."""
    module = trainer.module
    module._ember_saved_modes = [(m, m.training) for m in module.modules()]
    if _overrides(module, f"on_{hook}_model_eval"):
        getattr(module, f"on_{hook}_model_eval")()
    else:
        module.eval()


def _back_to_train(trainer: Trainer, hook: str) -> None:
    """``on_{hook}_model_train`` (default: every submodule gets back its own previous flag)."""
    module = trainer.module
    try:
        name = f"on_{hook}_model_train"
        if hook != "predict" and _overrides(module, name):
            getattr(module, name)()
        else:
            _restore_modes(module)
    finally:
        module.__dict__.pop("_ember_saved_modes", None)


def run_evaluation_loop(trainer: Trainer, stage: str, loaders: list[Any], limits: list[float]) -> list[dict[str, Any]]:
    """Run ``validation_step`` / ``test_step`` over ``loaders``; return one metric dict per loader.

    ``stage`` is "validate", "test" or "sanity" (a validation whose metrics are thrown away).
    With no batch to run at all, no hook runs (as in Lightning) and the result is empty.
    """
    t = trainer
    many = len(loaders) > 1
    if not any(limits):
        return [{} for _ in loaders]
    hook = "validation" if stage in ("validate", "sanity") else "test"
    step_fn = getattr(t.strategy, f"{hook}_step")
    metrics = t._metrics
    metrics.start_stage(stage)
    batch_start = t._hooks(f"on_{hook}_batch_start")
    batch_end = t._hooks(f"on_{hook}_batch_end")
    t._eval_total = sum(limits)
    _to_eval(t, hook)
    try:
        t._call(f"on_{hook}_start")
        metrics.fx = f"on_{hook}_epoch_start"
        t._call(f"on_{hook}_epoch_start")
        suffixes = [f"/dataloader_idx_{i}" if many else "" for i in range(len(loaders))]
        ran: list[int] = []  # batches run per loader
        t.strategy.prepare_for_evaluation()
        try:
            with torch.no_grad():
                for dl_idx, (loader, limit) in enumerate(zip(loaders, limits)):
                    metrics.key_suffix = suffixes[dl_idx]
                    # dataloader_idx is passed only when there are several loaders, as in Lightning.
                    extra = (dl_idx,) if many else ()
                    transfer = t._transfer(dl_idx)
                    ran.append(0)
                    for batch_idx, batch in enumerate(loader):
                        if batch_idx >= limit:
                            break
                        ran[-1] += 1
                        batch = transfer(batch)
                        metrics.batch = batch
                        metrics.batch_size = None
                        metrics.fx = f"on_{hook}_batch_start"
                        for h in batch_start:
                            h(batch, batch_idx, *extra)
                        metrics.fx = f"{hook}_step"
                        with t._precision.autocast():
                            out = step_fn(batch, batch_idx, *extra)
                        metrics.fx = f"on_{hook}_batch_end"
                        for h in batch_end:
                            h(out, batch, batch_idx, *extra)
            if t.strategy.world_size > 1 and _has_unsized(loaders):
                # Each rank ran its own number of batches (evaluation steps do not communicate), but the
                # epoch-end reduction below needs every rank to have logged something for each loader.
                _check_counts(t.strategy, ran, stage)
            metrics.key_suffix = ""
            metrics.fx = f"on_{hook}_epoch_end"
            t._call(f"on_{hook}_epoch_end")
            epoch_metrics = metrics.end_stage()
        finally:
            metrics.key_suffix = ""
        t._call(f"on_{hook}_end")
    finally:
        _back_to_train(t, hook)
    floats = to_floats(epoch_metrics)
    if not many:
        return [floats]
    # Each loader's dict: its own keys, and keys logged outside any loader (in the epoch hooks), as Lightning.
    return [{k: v for k, v in floats.items() if k.endswith(s) or "/dataloader_idx_" not in k} for s in suffixes]


def run_predict_loop(trainer: Trainer, loaders: list[Any], limits: list[float]) -> list[list[Any]]:
    """Run ``predict_step`` over ``loaders``; return one list of outputs per loader."""
    t = trainer
    if not any(limits):
        return [[] for _ in loaders]
    many = len(loaders) > 1
    t._eval_total = sum(limits)
    _to_eval(t, "predict")
    results: list[list[Any]] = []
    try:
        t.strategy.prepare_for_evaluation()
        t._call("on_predict_start")
        t._call("on_predict_epoch_start")
        batch_start = t._hooks("on_predict_batch_start")
        batch_end = t._hooks("on_predict_batch_end")
        with torch.no_grad():
            for dl_idx, (loader, limit) in enumerate(zip(loaders, limits)):
                extra = (dl_idx,) if many else ()
                transfer = t._transfer(dl_idx)
                outs: list[Any] = []
                for batch_idx, batch in enumerate(loader):
                    if batch_idx >= limit:
                        break
                    batch = transfer(batch)
                    for h in batch_start:
                        h(batch, batch_idx, *extra)
                    with t._precision.autocast():
                        out = t.strategy.predict_step(batch, batch_idx, *extra)
                    for h in batch_end:
                        h(out, batch, batch_idx, *extra)
                    outs.append(out)
                results.append(outs)
        t._call("on_predict_epoch_end")
        t._call("on_predict_end")
    finally:
        _back_to_train(t, "predict")
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
