"""Validating a checkpoint's entries against the run that resumes from it, before anything changes.

A fit resume (``restore.py``) is transactional: it first checks every entry it will apply (progress,
optimizers, schedulers, precision, callbacks, metrics, sampler position, RNG states, weights),
and only then changes the module, the optimizers and the callbacks. A malformed or mismatched
entry raises a ``CheckpointError`` that names the entry and says what is wrong, with nothing
touched. The checks are about shape and type, not about values a run could legitimately have. Each
optimizer's state is checked against the optimizer it would go into (its class, its groups' keys, the
keys and shapes of its per-parameter state: ``optimizers.py``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any

import torch

from ember.checkpoint import optimizers
from ember.checkpoint.io import CheckpointError

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer

_PROGRESS_INTS = (
    "current_epoch",
    "global_step",
    "batch_in_epoch",
    "steps_in_epoch",
    "total_batches",
    "val_checks_in_epoch",
)
_METRIC_FIELDS = ("name", "prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "sync_dist", "total", "weight")


class _Bad(Exception):
    """What is wrong with one entry; turned into a CheckpointError naming the entry.

    Args:
        what: what is wrong.
        advice: what to do, where there is more to say than to resume from another checkpoint.
    """

    def __init__(self, what: str, advice: str | None = None) -> None:
        super().__init__(what)
        self.advice = advice


def _int(value: Any, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise _Bad(f"{what} is {value!r}, not an int >= {low}")
    return int(value)


def _dict(value: Any, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise _Bad(f"{what} is a {type(value).__name__}, not a dict")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise _Bad(f"{what} is a {type(value).__name__}, not a list")
    return list(value)


def validate(trainer: Trainer, ckpt: dict[str, Any], path: str, part: str) -> None:
    """Raise a ``CheckpointError`` unless every entry that ``part`` of a fit resume applies fits ``trainer``.

    ``part`` is "modules" (before ``configure_optimizers``: also every entry that needs neither the
    optimizers nor the loaders, so that a malformed file fails before the weights are touched),
    "training" (the optimizers exist), "data" (the train loader exists), or "evaluation" (validate /
    test / predict from ``ckpt_path``: the callbacks' states are loaded too).
    """
    parts: dict[str, list[tuple[str, Callable[[Trainer, dict[str, Any], Any], None]]]] = {
        "modules": [
            ("precision", _precision),
            ("callbacks", _callbacks),
            ("callback_metrics", _callback_metrics),
            ("epoch_metrics", _epoch_metrics),
            ("strategy", _strategy),
            ("rng", _rng),
            ("progress", _progress),
        ],
        "training": [
            ("optimizer_states", _optimizers),
            ("lr_schedulers", _schedulers),
        ],
        "data": [
            ("progress", _position),
            ("sampler", _sampler),
        ],
        "evaluation": [
            ("callbacks", _callbacks),
        ],
    }
    checks = parts[part]
    for entry, check in checks:
        try:
            check(trainer, ckpt, ckpt.get(entry))
        except _Bad as bad:
            raise CheckpointError(
                f"Checkpoint {path!r} has a malformed or mismatched {entry!r} entry: {bad}. "
                "Nothing was loaded: the module, optimizers and callbacks are unchanged. "
                + (bad.advice or "Resume from another checkpoint (or one written with this configuration).")
            ) from None
        except (KeyError, TypeError, AttributeError, IndexError, ValueError) as err:
            raise CheckpointError(
                f"Checkpoint {path!r} has a malformed {entry!r} entry ({type(err).__name__}: "
                f"{err}). Nothing was loaded: the module, optimizers and callbacks are unchanged. "
                "Resume from another checkpoint."
            ) from None


def _progress(trainer: Trainer, ckpt: dict[str, Any], value: Any) -> None:
    p = _dict(value, "progress")
    for key in _PROGRESS_INTS:
        if key in p or key in ("current_epoch", "global_step", "batch_in_epoch"):
            _int(p.get(key), key)
    if not isinstance(p.get("epoch_finished", False), bool):
        raise _Bad(f"epoch_finished is {p['epoch_finished']!r}, not a bool")


def _position(trainer: Trainer, ckpt: dict[str, Any], value: Any) -> None:
    p = value
    n = trainer.num_training_batches
    saved_world = ckpt.get("strategy", {}).get("world_size", 1) if isinstance(ckpt.get("strategy"), dict) else 1
    if saved_world == trainer.strategy.world_size and n != math.inf and p["batch_in_epoch"] > n:
        raise _Bad(
            f"it is at batch {p['batch_in_epoch']} of an epoch that has {int(n)} batches in this run; the "
            "training data or limit_train_batches differ from the run that wrote it"
        )


def _optimizers(trainer: Trainer, ckpt: dict[str, Any], value: Any) -> None:
    opts, scheds = trainer.optimizers, trainer.lr_scheduler_configs
    saved = _list(value, "optimizer_states")
    saved_scheds = ckpt.get("lr_schedulers")
    n_scheds = len(saved_scheds) if isinstance(saved_scheds, (list, tuple)) else "?"
    # What to do when the optimizers differ from the ones that wrote the file.
    advice = (
        "Resume with the optimizers that wrote it (configure_optimizers as it was then), or start a new fit "
        f"from its weights alone: {type(trainer.module).__name__}.load_from_checkpoint(path), then fit without "
        "ckpt_path."
    )
    if len(saved) != len(opts) or n_scheds != len(scheds):
        raise _Bad(
            f"it has {len(saved)} optimizer(s) and {n_scheds} LR scheduler(s) but configure_optimizers "
            f"returned {len(opts)} and {len(scheds)}",
            advice,
        )
    for i, (opt, state) in enumerate(zip(opts, saved)):
        state = _dict(state, f"optimizer {i}'s state")
        groups = _list(state.get("param_groups"), f"optimizer {i}'s param_groups")
        _dict(state.get("state", {}), f"optimizer {i}'s per-parameter state")
        ours = [len(g["params"]) for g in opt.param_groups]
        theirs = [len(_list(_dict(g, "a parameter group").get("params"), "a group's params")) for g in groups]
        if ours != theirs:
            raise _Bad(
                f"optimizer {i} has parameter groups of sizes {theirs}, but the optimizer now has {ours}", advice
            )
        try:
            optimizers.check(i, opt, state)
        except optimizers.Mismatch as mismatch:
            raise _Bad(str(mismatch), advice) from None


def _schedulers(trainer: Trainer, ckpt: dict[str, Any], value: Any) -> None:
    for i, state in enumerate(_list(value, "lr_schedulers")):
        _dict(state, f"LR scheduler {i}'s state")


def _precision(trainer: Trainer, ckpt: dict[str, Any], value: Any) -> None:
    if value is not None:
        _dict(value, "precision")


def _callbacks(trainer: Trainer, ckpt: dict[str, Any], value: Any) -> None:
    if value is None:
        return
    for key, state in _dict(value, "callbacks").items():
        if not isinstance(key, str):
            raise _Bad(f"key {key!r} is not a callback's state key (a string)")
        if state is not None:
            _dict(state, f"the state of callback {key!r}")


def _callback_metrics(trainer: Trainer, ckpt: dict[str, Any], value: Any) -> None:
    if value is None:
        return
    for key, v in _dict(value, "callback_metrics").items():
        if not isinstance(key, str) or not isinstance(v, (torch.Tensor, Real)):
            raise _Bad(f"{key!r}: {type(v).__name__} is not a metric name with a number or tensor")


def _epoch_metrics(trainer: Trainer, ckpt: dict[str, Any], value: Any) -> None:
    if value is None:
        return
    for i, entry in enumerate(_list(value, "epoch_metrics")):
        missing = [f for f in _METRIC_FIELDS if f not in _dict(entry, f"epoch metric {i}")]
        if missing:
            raise _Bad(f"epoch metric {i} lacks {missing}")


def _strategy(trainer: Trainer, ckpt: dict[str, Any], value: Any) -> None:
    if value is not None:
        _int(_dict(value, "strategy").get("world_size", 1), "world_size", low=1)


def _sampler(trainer: Trainer, ckpt: dict[str, Any], value: Any) -> None:
    if value is None:
        return
    s = _dict(value, "sampler")
    if s.get("seed") is not None:
        _int(s["seed"], "seed", low=-(2**63))
    _int(s.get("epoch"), "epoch")
    position = _int(s.get("position"), "position")
    try:
        total = len(trainer.train_dataloader.dataset)
    except (AttributeError, TypeError):
        return
    if position > total:
        raise _Bad(
            f"its position {position} is beyond the {total} samples of this run's training dataset; the "
            "training data differ from the run that wrote it"
        )


def _rng(trainer: Trainer, ckpt: dict[str, Any], value: Any) -> None:
    if value is None:
        return
    per_rank = _list(_dict(value, "rng").get("per_rank"), "per_rank")
    torch_len = torch.get_rng_state().numel()
    py_len = len(random.getstate()[1])
    for r, state in enumerate(per_rank):
        state = _dict(state, f"rank {r}'s state")
        t = state.get("torch")
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.numel() != torch_len:
            raise _Bad(f"rank {r}'s torch generator state is not a uint8 tensor of {torch_len} bytes")
        py = _dict(state.get("python"), f"rank {r}'s Python generator state")
        if not isinstance(py.get("state"), torch.Tensor) or py["state"].numel() != py_len:
            raise _Bad(f"rank {r}'s Python generator state is not {py_len} numbers")
        np_state = state.get("numpy")
        np_keys = None if np_state is None else _dict(np_state, f"rank {r}'s NumPy state").get("keys")
        if np_state is not None and not isinstance(np_keys, torch.Tensor):
            raise _Bad(f"rank {r}'s NumPy generator state has no keys tensor")
