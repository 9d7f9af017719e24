"""Checking a checkpoint before a resume changes anything.

Two kinds of checks, both run before the entries they look at are loaded, so that a malformed or
mismatched entry raises a ``CheckpointError`` that names it and says what is wrong, with nothing touched:

- **the form of the file's entries** (:func:`check_entries`): types and shapes, against nothing of this
  run but the sizes of Python's and torch's generator states. A resume checks every entry it reads when
  it opens the file (``restore.py``), so a malformed file fails before the weights are touched.
- **each part against this run**, when the part is loaded: the part's ``check`` (``ember/state.py``),
  built on the functions below: the optimizers' states against the optimizers (their groups here, their
  class, group keys and per-parameter state in ``optimizers.py``), the data position against the train
  loader; the weights against the module with ``weights.check_state_dict``.

The checks are about shape and type, not about values a run could legitimately have. What they find is
an :class:`Invalid` naming the entry; the restore raises it as a ``CheckpointError`` naming the file too.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from numbers import Integral, Real
from typing import Any

import torch

from ember.checkpoint import optimizers as optimizer_states
from ember.checkpoint.format import CheckpointError

_PROGRESS_INTS = (
    "current_epoch",
    "global_step",
    "batch_in_epoch",
    "steps_in_epoch",
    "total_batches",
    "val_checks_in_epoch",
)
_METRIC_FIELDS = ("name", "prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "sync_dist", "total", "weight")


class Bad(Exception):
    """What is wrong with one entry, raised by a check; :func:`check` names the entry.

    Args:
        what: what is wrong.
        advice: what to do, where there is more to say than to resume from another checkpoint.
    """

    def __init__(self, what: str, advice: str | None = None) -> None:
        super().__init__(what)
        self.advice = advice


class Invalid(Exception):
    """A checkpoint entry that does not fit, by name; :meth:`error` says so for a file.

    Args:
        entry: the checkpoint's key (``"optimizer_states"``).
        detail: what is wrong.
        advice: what to do, or None for the usual (resume from another checkpoint).
        malformed: the entry could not even be read (a missing key, a wrong type deep inside it).
    """

    def __init__(self, entry: str, detail: str, advice: str | None = None, malformed: bool = False) -> None:
        super().__init__(f"{entry!r}: {detail}")
        self.entry, self.detail, self.advice, self.malformed = entry, detail, advice, malformed

    def error(self, path: str) -> CheckpointError:
        unchanged = "Nothing was loaded: the module, optimizers and callbacks are unchanged."
        if self.malformed:
            return CheckpointError(
                f"Checkpoint {path!r} has a malformed {self.entry!r} entry ({self.detail}). {unchanged} "
                "Resume from another checkpoint."
            )
        return CheckpointError(
            f"Checkpoint {path!r} has a malformed or mismatched {self.entry!r} entry: {self.detail}. {unchanged} "
            + (self.advice or "Resume from another checkpoint (or one written with this configuration).")
        )


def check(entry: str, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(*args)``, a check of the checkpoint entry ``entry``; raise what it finds as :class:`Invalid`."""
    try:
        fn(*args)
    except Bad as bad:
        raise Invalid(entry, str(bad), bad.advice) from None
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as err:
        raise Invalid(entry, f"{type(err).__name__}: {err}", malformed=True) from None


def check_entries(ckpt: dict[str, Any], entries: tuple[str, ...]) -> None:
    """Raise :class:`Invalid` for the first of ``entries`` whose form is wrong (see :data:`FORM`)."""
    for entry in entries:
        check(entry, FORM[entry], ckpt.get(entry))


# ---------------------------------------------------------------------------------------------- helpers
def _int(value: Any, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise Bad(f"{what} is {value!r}, not an int >= {low}")
    return int(value)


def _dict(value: Any, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise Bad(f"{what} is a {type(value).__name__}, not a dict")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise Bad(f"{what} is a {type(value).__name__}, not a list")
    return list(value)


# ---------------------------------------------------------------------------------------------- the form of entries
def _progress(value: Any) -> None:
    p = _dict(value, "progress")
    for key in _PROGRESS_INTS:
        if key in p or key in ("current_epoch", "global_step", "batch_in_epoch"):
            _int(p.get(key), key)
    if not isinstance(p.get("epoch_finished", False), bool):
        raise Bad(f"epoch_finished is {p['epoch_finished']!r}, not a bool")


def _precision(value: Any) -> None:
    if value is not None:
        _dict(value, "precision")


def _callbacks(value: Any) -> None:
    if value is None:
        return
    for key, state in _dict(value, "callbacks").items():
        if not isinstance(key, str):
            raise Bad(f"key {key!r} is not a callback's state key (a string)")
        if state is not None:
            _dict(state, f"the state of callback {key!r}")


def _callback_metrics(value: Any) -> None:
    if value is None:
        return
    for key, v in _dict(value, "callback_metrics").items():
        if not isinstance(key, str) or not isinstance(v, (torch.Tensor, Real)):
            raise Bad(f"{key!r}: {type(v).__name__} is not a metric name with a number or tensor")


def _epoch_metrics(value: Any) -> None:
    if value is None:
        return
    for i, entry in enumerate(_list(value, "epoch_metrics")):
        missing = [f for f in _METRIC_FIELDS if f not in _dict(entry, f"epoch metric {i}")]
        if missing:
            raise Bad(f"epoch metric {i} lacks {missing}")


def _strategy(value: Any) -> None:
    if value is not None:
        _int(_dict(value, "strategy").get("world_size", 1), "world_size", low=1)


def _rng(value: Any) -> None:
    if value is None:
        return
    per_rank = _list(_dict(value, "rng").get("per_rank"), "per_rank")
    torch_len = torch.get_rng_state().numel()
    py_len = len(random.getstate()[1])
    for r, state in enumerate(per_rank):
        state = _dict(state, f"rank {r}'s state")
        t = state.get("torch")
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.numel() != torch_len:
            raise Bad(f"rank {r}'s torch generator state is not a uint8 tensor of {torch_len} bytes")
        py = _dict(state.get("python"), f"rank {r}'s Python generator state")
        if not isinstance(py.get("state"), torch.Tensor) or py["state"].numel() != py_len:
            raise Bad(f"rank {r}'s Python generator state is not {py_len} numbers")
        np_state = state.get("numpy")
        np_keys = None if np_state is None else _dict(np_state, f"rank {r}'s NumPy state").get("keys")
        if np_state is not None and not isinstance(np_keys, torch.Tensor):
            raise Bad(f"rank {r}'s NumPy generator state has no keys tensor")


#: The entries whose form is checked when a file is opened, and how.
FORM: dict[str, Callable[[Any], None]] = {
    "precision": _precision,
    "callbacks": _callbacks,
    "callback_metrics": _callback_metrics,
    "epoch_metrics": _epoch_metrics,
    "strategy": _strategy,
    "rng": _rng,
    "progress": _progress,
}
#: What a fit resume checks on opening a file (every entry it reads that needs neither the optimizers nor
#: the loaders), and what validate / test / predict from ``ckpt_path`` check (they load the callbacks).
FIT_ENTRIES = ("precision", "callbacks", "callback_metrics", "epoch_metrics", "strategy", "rng", "progress")
EVALUATION_ENTRIES = ("callbacks",)


# ---------------------------------------------------------------------------------------------- against this run
def optimizers(
    saved: Any, saved_schedulers: Any, opts: list[torch.optim.Optimizer], n_schedulers: int, module_name: str
) -> None:
    """The ``optimizer_states`` entry against this fit's optimizers (and its number of LR schedulers)."""
    states = _list(saved, "optimizer_states")
    n_saved = len(saved_schedulers) if isinstance(saved_schedulers, (list, tuple)) else "?"
    # What to do when the optimizers differ from the ones that wrote the file.
    advice = (
        "Resume with the optimizers that wrote it (configure_optimizers as it was then), or start a new fit "
        f"from its weights alone: {module_name}.load_from_checkpoint(path), then fit without ckpt_path."
    )
    if len(states) != len(opts) or n_saved != n_schedulers:
        raise Bad(
            f"it has {len(states)} optimizer(s) and {n_saved} LR scheduler(s) but configure_optimizers "
            f"returned {len(opts)} and {n_schedulers}",
            advice,
        )
    for i, (opt, state) in enumerate(zip(opts, states)):
        state = _dict(state, f"optimizer {i}'s state")
        groups = _list(state.get("param_groups"), f"optimizer {i}'s param_groups")
        _dict(state.get("state", {}), f"optimizer {i}'s per-parameter state")
        ours = [len(g["params"]) for g in opt.param_groups]
        theirs = [len(_list(_dict(g, "a parameter group").get("params"), "a group's params")) for g in groups]
        if ours != theirs:
            raise Bad(f"optimizer {i} has parameter groups of sizes {theirs}, but the optimizer now has {ours}", advice)
        try:
            optimizer_states.check(i, opt, state)
        except optimizer_states.Mismatch as mismatch:
            raise Bad(str(mismatch), advice) from None


def schedulers(saved: Any) -> None:
    """The ``lr_schedulers`` entry: one dict per scheduler (their number is checked with the optimizers)."""
    for i, state in enumerate(_list(saved, "lr_schedulers")):
        _dict(state, f"LR scheduler {i}'s state")


def position(progress: Any, n_batches: float, same_world: bool) -> None:
    """The ``progress`` entry's place in the epoch against this run's number of training batches (only
    comparable when as many ranks wrote it as this run has)."""
    if same_world and n_batches != math.inf and progress["batch_in_epoch"] > n_batches:
        raise Bad(
            f"it is at batch {progress['batch_in_epoch']} of an epoch that has {int(n_batches)} batches in this "
            "run; the training data or limit_train_batches differ from the run that wrote it"
        )


def sampler(value: Any, dataset_len: int | None) -> None:
    """The ``sampler`` entry, and its position against this run's training dataset (None: no length)."""
    if value is None:
        return
    s = _dict(value, "sampler")
    if s.get("seed") is not None:
        _int(s["seed"], "seed", low=-(2**63))
    _int(s.get("epoch"), "epoch")
    generator = s.get("generator")
    if generator is not None and not (isinstance(generator, torch.Tensor) and generator.dtype == torch.uint8):
        raise Bad(f"its generator state is a {type(generator).__name__}, not the uint8 tensor torch saves")
    at = _int(s.get("position"), "position")
    if dataset_len is not None and at > dataset_len:
        raise Bad(
            f"its position {at} is beyond the {dataset_len} samples of this run's training dataset; the "
            "training data differ from the run that wrote it"
        )
