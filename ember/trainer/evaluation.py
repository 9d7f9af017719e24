"""The evaluation and predict loops: ``validation_step`` / ``test_step`` / ``predict_step`` over loaders.

Per batch: on_*_batch_start -> batch_to_device -> *_step (under no_grad and the precision's
autocast) -> on_*_batch_end. Evaluation epochs reduce what ``self.log`` collected (across
processes too) and return one metric dict per loader.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ember.trainer.metrics import to_floats

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


def run_evaluation_loop(trainer: Trainer, stage: str, loaders: list[Any], limits: list[float]) -> list[dict[str, Any]]:
    """Run ``validation_step`` / ``test_step`` over ``loaders``; return one metric dict per loader.

    ``stage`` is "validate", "test" or "sanity" (a validation whose metrics are thrown away).
    """
    t = trainer
    module = t.module
    hook = "validation" if stage in ("validate", "sanity") else "test"
    step_fn = getattr(t.strategy, f"{hook}_step")
    metrics = t._metrics
    was_training = module.training
    module.eval()
    metrics.start_stage(stage)
    batch_start = t._hooks(f"on_{hook}_batch_start")
    batch_end = t._hooks(f"on_{hook}_batch_end")
    t._eval_total = sum(limits)
    t._call(f"on_{hook}_start")
    metrics.fx = f"on_{hook}_epoch_start"
    t._call(f"on_{hook}_epoch_start")
    many = len(loaders) > 1
    suffixes = [f"/dataloader_idx_{i}" if many else "" for i in range(len(loaders))]
    try:
        with torch.no_grad():
            for dl_idx, (loader, limit) in enumerate(zip(loaders, limits)):
                metrics.key_suffix = suffixes[dl_idx]
                extra = (dl_idx,) if many else ()
                for batch_idx, batch in enumerate(loader):
                    if batch_idx >= limit:
                        break
                    metrics.batch = batch
                    metrics.batch_size = None
                    metrics.fx = f"on_{hook}_batch_start"
                    for h in batch_start:
                        h(batch, batch_idx, dl_idx)
                    batch = t._batch_to_device(batch)
                    metrics.fx = f"{hook}_step"
                    with t._precision.autocast():
                        out = step_fn(batch, batch_idx, *extra)
                    metrics.fx = f"on_{hook}_batch_end"
                    for h in batch_end:
                        h(out, batch, batch_idx, dl_idx)
        metrics.key_suffix = ""
        metrics.fx = f"on_{hook}_epoch_end"
        t._call(f"on_{hook}_epoch_end")
        epoch_metrics = metrics.end_stage()
    finally:
        metrics.key_suffix = ""
        module.train(was_training)
    t._call(f"on_{hook}_end")
    floats = to_floats(epoch_metrics)
    if not many:
        return [floats]
    # Each loader's dict: its own keys, and keys logged outside any loader (in the epoch hooks), as Lightning.
    return [{k: v for k, v in floats.items() if k.endswith(s) or "/dataloader_idx_" not in k} for s in suffixes]


def run_predict_loop(trainer: Trainer, loaders: list[Any], limits: list[float]) -> list[list[Any]]:
    """Run ``predict_step`` over ``loaders``; return one list of outputs per loader."""
    t = trainer
    module = t.module
    was_training = module.training
    module.eval()
    t._eval_total = sum(limits)
    t._call("on_predict_start")
    t._call("on_predict_epoch_start")
    batch_start = t._hooks("on_predict_batch_start")
    batch_end = t._hooks("on_predict_batch_end")
    results: list[list[Any]] = []
    try:
        with torch.no_grad():
            for dl_idx, (loader, limit) in enumerate(zip(loaders, limits)):
                extra = (dl_idx,) if len(loaders) > 1 else ()
                outs: list[Any] = []
                for batch_idx, batch in enumerate(loader):
                    if batch_idx >= limit:
                        break
                    for h in batch_start:
                        h(batch, batch_idx, dl_idx)
                    batch = t._batch_to_device(batch)
                    with t._precision.autocast():
                        out = t.strategy.predict_step(batch, batch_idx, *extra)
                    for h in batch_end:
                        h(out, batch, batch_idx, dl_idx)
                    outs.append(out)
                results.append(outs)
    finally:
        module.train(was_training)
    t._call("on_predict_epoch_end")
    t._call("on_predict_end")
    return results
