"""What travels between the caller and the workers of ``ddp_spawn``.

Out: the Trainer entry point and its arguments, pickled by :func:`dumps` with the standard streams
sent as "the worker's own" (:func:`loads` on the other side), and an error that says how to fix
what cannot be pickled. Back: :func:`run_in_worker` runs the entry point in a worker and, on rank
0, returns the trained weights, metrics, progress and callback states, which
:func:`adopt_worker_state` copies into the caller's module and Trainer.
"""

from __future__ import annotations

import io
import pickle
import sys
from collections.abc import Callable
from typing import Any

import torch

from ember.module import TrainModule
from ember.rng import apply_rng
from ember.utils import move_to_device

__all__ = ["run_in_worker", "adopt_worker_state", "dumps", "loads"]


def run_in_worker(fn: Callable[..., Any], args: tuple, kwargs: dict, rng: dict) -> Any:
    """In a spawned worker: run the Trainer entry point; rank 0 also returns what to copy back."""
    apply_rng(rng)
    value = fn(*args, **kwargs)
    trainer = getattr(fn, "__self__", None)
    if trainer is None:
        return value, None
    weights = trainer.strategy.whole_state_dict()  # every rank: a sharding strategy gathers its shards
    if not trainer.is_global_zero:
        return value, None
    state = {
        "weights": {k: v.detach().cpu() for k, v in weights.items()},
        "callback_metrics": _to_cpu(trainer.callback_metrics),
        "logged_metrics": _to_cpu(dict(trainer.logged_metrics)),
        "progress": trainer.progress.state_dict(),
        "history": list(getattr(trainer, "history", [])),
        "callbacks": [(type(cb).__name__, cb.state_dict()) for cb in trainer.callbacks if hasattr(cb, "state_dict")],
        # Where this run wrote: the caller's loggers and checkpoint callbacks point there too, so a
        # later validate/test logs into the same version and nothing warns about another directory.
        "log_dirs": [lg.log_dir for lg in trainer.loggers],
        "dirpaths": [(type(cb).__name__, getattr(cb, "dirpath", None)) for cb in trainer.callbacks],
    }
    return _to_cpu(value), state


def adopt_worker_state(trainer: Any, args: tuple, state: dict | None) -> None:
    """In the caller: make its module and Trainer look as if it had trained itself."""
    if trainer is None or state is None:
        return
    module = next((a for a in args if isinstance(a, TrainModule)), None)
    if module is not None:
        module.load_state_dict(state["weights"])
        trainer.module = module
    trainer.callback_metrics = state["callback_metrics"]
    trainer.logged_metrics = state["logged_metrics"]
    trainer.progress.load_state_dict(state["progress"])
    trainer.history = state["history"]
    for lg, log_dir in zip(trainer.loggers, state["log_dirs"]):
        if log_dir is not None and hasattr(lg, "continue_run"):
            lg.continue_run(log_dir, trainer.default_root_dir)
    for cb, (name, dirpath) in zip(trainer.callbacks, state["dirpaths"]):
        if type(cb).__name__ == name and dirpath is not None and getattr(cb, "dirpath", dirpath) is None:
            cb.dirpath = dirpath
    mine = [cb for cb in trainer.callbacks if hasattr(cb, "load_state_dict")]
    for cb, (name, cb_state) in zip(mine, state["callbacks"]):
        if type(cb).__name__ == name:
            cb.load_state_dict(cb_state)


def _to_cpu(obj: Any) -> Any:
    return move_to_device(obj, torch.device("cpu"))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> str | None:  # streams travel as "the worker's own"
        return "stdout" if obj is sys.stdout else "stderr" if obj is sys.stderr else None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: str) -> Any:
        return getattr(sys, pid)


def dumps(obj: Any) -> bytes:
    """Pickles what a spawned worker needs, explaining how to fix what cannot be pickled."""
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception as exc:
        raise RuntimeError(
            "strategy='ddp_spawn' sends the Trainer, the module and the dataloaders to its worker "
            f"processes by pickling them, and that failed: {exc}. Make them picklable (module-"
            "level functions and classes instead of lambdas or locally defined ones, no open "
            "files or locks), or use strategy='ddp', which re-runs your script instead."
        ) from exc
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()
