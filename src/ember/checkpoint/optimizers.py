"""Checking a checkpoint's optimizer states against the optimizers they would go into.

``torch.optim.Optimizer.load_state_dict`` checks only the number of parameter groups and their sizes.
Everything else it takes as it is: an SGD state loads into an Adam, whose first step then fails with
``KeyError: 'betas'``, and an AdamW state turns an Adam into an AdamW without a word. A resume checks,
for every optimizer, before any is loaded (``validation.py`` raises what this module finds as a
``CheckpointError``, and ``restore.py`` puts back what earlier parts of the resume had changed):

- its class, which checkpoints record beside each state (``CLASS_KEY``; files written before it was
  recorded are checked by the rest alone);
- the hyper-parameter keys of each parameter group (``betas`` against ``momentum``; keys added by LR
  schedulers, such as OneCycleLR's ``max_lr``, count too). A key that the optimizer's class fills in
  itself when it loads an older file (torch's ``__setstate__`` does so for flags added in later
  releases) is not missing;
- the state of each parameter: its keys (an SGD with momentum keeps a ``momentum_buffer``, one
  without keeps none; Adam with ``amsgrad`` keeps ``max_exp_avg_sq``) and the shapes of its tensors.

What state an optimizer keeps for a parameter, and in which shapes, is the optimizer's own business:
most keep tensors shaped like the parameter, Adafactor factored ones (a row and a column), LBFGS flat
vectors over all its parameters under the first. So the check asks the optimizer: a fresh optimizer
of the same class and group settings steps once over *stand-ins*, tiny tensors with the parameters'
numbers of dimensions (each dimension 2) on their devices, and the state it keeps is the reference. A
dimension of a stand-in state that is 2 follows the parameter's, one that is 1 stays 1; a state of
any other shape (LBFGS's) is compared by key only. The stand-in step runs only for the classes of
``torch.optim``, whose steps have no effect beyond the stand-ins (but for hooks registered for every
optimizer with ``torch.optim.optimizer.register_optimizer_step_pre_hook``, which see it too): an
optimizer of another package or the user's may communicate or count in its step, so its states are
checked by class and parameter-group keys only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

#: The key of each saved optimizer state under which checkpoints record the optimizer's class
#: (``"torch.optim.adam.Adam"``); ``torch.optim.Optimizer.load_state_dict`` ignores it.
CLASS_KEY = "optimizer_class"

_NOT_HYPERPARAMETERS = ("params", "param_names")


class Mismatch(Exception):
    """What differs between a saved optimizer state and the optimizer it would go into."""


def class_name(optimizer: torch.optim.Optimizer) -> str:
    """``"module.QualifiedName"`` of ``optimizer``'s class, as checkpoints record it."""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def check(index: int, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Raise :class:`Mismatch` unless ``saved`` (a ``state_dict`` whose group sizes were already checked)
    is a state of an optimizer like ``optimizer``: the same class, the same group keys, per-parameter
    state of the same keys and shapes."""
    name = f"optimizer {index} ({type(optimizer).__name__})"
    recorded = saved.get(CLASS_KEY)
    if isinstance(recorded, str) and recorded.rsplit(".", 1)[-1] != type(optimizer).__qualname__.rsplit(".", 1)[-1]:
        raise Mismatch(
            f"this fit's optimizer {index} is a {class_name(optimizer)}, but the checkpoint's is a {recorded}"
        )
    for g, (ours, theirs) in enumerate(zip(optimizer.param_groups, saved["param_groups"])):
        missing = _hyperparameters(ours) - _hyperparameters(_as_loaded(optimizer, theirs))
        extra = _hyperparameters(theirs) - _hyperparameters(ours)
        if missing or extra:
            parts = [f"lacks {_names(missing)}"] if missing else []
            parts += [f"has {_names(extra)}, which its groups do not"] if extra else []
            raise Mismatch(
                f"the checkpoint's parameter group {g} of {name} {' and '.join(parts)}: it was written by "
                "another optimizer (or with other LR schedulers, which add keys such as 'initial_lr')"
            )
    _check_parameter_states(name, optimizer, saved)


def _check_parameter_states(name: str, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    # The saved ids are positions in the saved groups; match them to this run's parameters.
    params = {
        pid: p
        for g_saved, g in zip(saved["param_groups"], optimizer.param_groups)
        for pid, p in zip(g_saved["params"], g["params"])
    }
    reference = _stand_in_states(optimizer)
    for pid, state in saved.get("state", {}).items():
        if pid not in params:
            raise Mismatch(f"{name} has state for parameter id {pid!r}, which none of its groups lists")
        if not isinstance(state, dict):
            raise Mismatch(f"{name}'s state of parameter {pid} is a {type(state).__name__}, not a dict")
        if reference is None:
            continue
        param, (kept, stand_in) = params[pid], reference[pid]
        # Buffers (tensors) of a key it does not keep: LBFGS adds plain values to its history as it goes,
        # so only tensors are compared this way.
        unknown = sorted(k for k, v in state.items() if k not in kept and isinstance(v, torch.Tensor) and v.dim() > 0)
        if unknown:
            raise Mismatch(
                f"{name}'s {unknown[0]!r} for parameter {pid} has shape {tuple(state[unknown[0]].shape)}, but this "
                f"{type(optimizer).__name__} keeps no {_names(unknown)} (it keeps {_names(kept) or 'nothing'}): it "
                "was written by another optimizer, or with other settings (momentum, amsgrad, centered, ...)"
            )
        expected = {key: _shape_like(value, stand_in, param) for key, value in kept.items()}
        # A parameter's buffers (tensors shaped like it) are all there once it has any state; LBFGS's flat
        # vectors and scalars such as a step count may come later or not at all, and are not asked for.
        absent = [key for key, shape in expected.items() if shape and key not in state]
        if state and absent:
            raise Mismatch(
                f"{name}'s state for parameter {pid} lacks {_names(absent)}, which this {type(optimizer).__name__} "
                "keeps: it was written by another optimizer, or with other settings (momentum, amsgrad, centered, ...)"
            )
        for key, value in state.items():
            shape = expected.get(key)
            if shape is not None and isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
                raise Mismatch(
                    f"{name}'s {key!r} for parameter {pid} has shape {tuple(value.shape)}, where this optimizer "
                    f"keeps {shape} for a parameter of shape {tuple(param.shape)}"
                )


def _hyperparameters(group: dict[str, Any]) -> set[str]:
    return {k for k in group if k not in _NOT_HYPERPARAMETERS}


def _names(keys: Iterable[str]) -> str:
    return ", ".join(repr(k) for k in sorted(keys))


def _as_loaded(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    """``group`` (a saved parameter group) with the keys ``optimizer``'s class fills in when it loads a
    file of an older torch: its ``__setstate__`` sets the flags added since. Runs on an empty copy (the
    pickling protocol every optimizer follows); ``group`` itself when the class cannot be built so."""
    try:
        empty = type(optimizer).__new__(type(optimizer))
        empty.__setstate__(
            {"defaults": dict(optimizer.defaults), "state": {}, "param_groups": [{**group, "params": []}]}
        )
        return empty.param_groups[0]
    except Exception:
        return group


def _stand_in_states(optimizer: torch.optim.Optimizer) -> dict[int, tuple[dict[str, Any], torch.Tensor]] | None:
    """For each parameter position of ``optimizer``'s groups (the ids of its ``state_dict``): the state a
    fresh optimizer of its class and group settings keeps after one step over a stand-in of the parameter,
    and that stand-in. None for a class outside ``torch.optim``, or when the step over stand-ins fails."""
    module = type(optimizer).__module__
    if module != "torch.optim" and not module.startswith("torch.optim."):
        return None
    stand_ins = [
        [torch.full((2,) * p.dim(), 0.5, dtype=p.dtype, device=p.device, requires_grad=True) for p in g["params"]]
        for g in optimizer.param_groups
    ]
    flat = [s for group in stand_ins for s in group]
    build: Any = type(optimizer)  # (torch's optimizers take their groups alone; the base class wants defaults too)

    def closure() -> float:  # a loss over the stand-ins, for optimizers that evaluate it (LBFGS)
        probe.zero_grad()
        loss = torch.stack([(s.float() ** 2).sum() for s in flat]).sum()
        loss.backward()
        return float(loss.detach())

    try:
        probe = build([{**g, "params": s} for g, s in zip(optimizer.param_groups, stand_ins)])
        with torch.enable_grad():
            closure()  # gradients for optimizers that step without calling it
        probe.step(closure)
    except Exception:
        return None
    return {i: (dict(probe.state.get(s, {})), s) for i, s in enumerate(flat)}


def _shape_like(value: Any, stand_in: torch.Tensor, param: torch.Tensor) -> tuple[int, ...] | None:
    """The shape a state tensor of ``param`` has, given the stand-in state ``value`` the reference optimizer
    kept for ``stand_in``: each dimension the stand-in's is the parameter's, each 1 stays 1 (Adafactor's
    factored states). None when that says nothing (not a tensor, a scalar, or another shape: LBFGS's)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.dim() != stand_in.dim():
        return None
    if any(d not in (1, s) for d, s in zip(value.shape, stand_in.shape)):
        return None
    return tuple(1 if d == 1 else n for d, n in zip(value.shape, param.shape))
