"""torchmetrics Metrics inside ``dp`` replicas: a state of their own each, merged back in replica order.

A replica is a shallow copy of the module (:mod:`ember.parallel.replicate`), so its Metric would hold
the original's state tensors and lists, with ``update`` and ``compute`` still bound to the original:
every replica would append to one list from its own thread, the ``reset()`` inside a replica's
``forward`` would empty the original's lists, and on a second GPU the states would stay on the first
(with ``Metric.device`` copied from the original saying all is well). So :func:`give_own_state` gives
each replica's Metric

- ``update`` and ``compute`` bound to itself (torchmetrics' pickling protocol binds them anew);
- lists of its own, and its defaults and tensor states on its own device, which ``device`` reports;
- a ``forward`` that sets the states gathered so far aside while it runs, so that what the last
  forward's batch alone left is kept (for the step value: one device's is what its last ``forward``
  returned, whatever ``update`` adds in the same step), then adds it to them.

After the step, :func:`merge_into` folds the replicas' states into the original in replica order, so
that the original holds what one device would have gathered from the whole batch:

- a list state gets each replica's items appended in order (those on the replica's device moved to
  the original's): the same items in the same order as on one device, whatever its reduction (with
  several ``update`` calls in one step, one replica's items come together, as one rank's under ddp);
- a tensor state with ``dist_reduce_fx="cat"`` is concatenated in order; with "sum", "max", "min" or a
  function of its own, that function is applied to the stacked values (the original's, then each
  replica's), as a sync across processes applies it; with "mean", the values are averaged weighted by
  update counts, as torchmetrics' own ``forward`` folds a batch into the state;
- a tensor state with no reduction (``dist_reduce_fx=None``) has no defined merge, and a Metric whose
  ``full_state_update`` is not False may read in ``update`` the state gathered so far, which a replica
  does not have: both are refused with an error saying what to do. (So are torchmetrics' wrappers,
  ``ClasswiseWrapper``, ``MinMaxMetric``, ``Running``...: their ``full_state_update`` is not False.)

A ``MetricCollection`` in a replica gets compute groups of its own (:func:`give_own_groups`).

torchmetrics offers no public way to do this (``merge_state`` puts the incoming state first, moves no
tensor between devices, and neither counts updates nor drops a cached ``compute()``). What is used of
its internals is in this file alone: the pickled state (``__getstate__`` / ``__setstate__``) with its
``_defaults`` and ``_device`` entries, ``_reductions``, ``_update_count`` and ``_computed``;
tests/strategies/test_dp_metrics.py fails if any of them changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["States", "batch_value", "give_own_groups", "give_own_state", "merge_into", "states_of"]


class States(NamedTuple):
    """What a Metric has gathered: its states by name (tensors or lists), update count and device."""

    values: dict[str, Any]
    updates: int
    device: torch.device


def states_of(metric: Any) -> States:
    """``metric``'s states as they are now."""
    return States(metric.metric_state, metric.update_count, metric.device)


def give_own_state(metric: Any, device: torch.device, forwards: dict[int, States]) -> None:
    """Make a replica's Metric (a shallow copy of the original) independent of the original.

    Args:
        metric: the replica's ``torchmetrics.Metric``.
        device: where its states go (the replica's device).
        forwards: where its ``forward`` files, under ``id(metric)``, what the last forward's batch alone
            left in the states (for the step's batch value).
    """
    device = torch.device(device)  # Metric.device is a torch.device, whatever named the replica's
    state = metric.__getstate__()  # the instance dict without update and compute (bound to the original)
    defaults: dict[str, Any] = {
        name: d.to(device) if isinstance(d, Tensor) else [] for name, d in state["_defaults"].items()
    }
    # Placeholders on the device, never the original's: reset() clones the tensors and clears the lists.
    state.update((name, d if isinstance(d, Tensor) else []) for name, d in defaults.items())
    state.update(_defaults=defaults, _device=device)
    metric.__dict__.clear()
    metric.__setstate__(state)  # binds update and compute to this object
    metric.reset()
    metric.forward = _forward_apart(metric, forwards)


def give_own_groups(collection: Any) -> None:
    """Give a replica's ``MetricCollection`` compute groups of its own.

    The first ``update`` of a collection merges its compute groups in place (``pop`` and ``extend`` on the
    dict of lists): on a shallow replica that is the original's dict, which the replica threads would change
    at once (a ``KeyError`` in one of them) and leave merged on the original.
    """
    collection._groups = {k: list(members) for k, members in collection._groups.items()}  # noqa: SLF001


def merge_into(target: Any, parts: list[States]) -> None:
    """Fold ``parts`` (each gathered from empty states by a Metric of ``target``'s class) into ``target``.

    The parts come after ``target``'s states, in their order (see the module docstring for each kind of
    state); their values are moved to ``target.device``. The update count grows by the largest of the
    parts' (they ran side by side on chunks of one batch), and a cached ``compute()`` is dropped.

    Raises:
        RuntimeError: ``target`` cannot be merged: its ``full_state_update`` is not False, or it has a
            tensor state without a reduction.
    """
    if not parts:
        return
    _check_mergeable(target)
    count, batch_count = target.update_count, max(p.updates for p in parts)
    merged = {}
    with torch.no_grad():
        for name, reduce_fx in target._reductions.items():  # noqa: SLF001  (no public reader)
            values = [_moved(p.values[name], p.device, target.device) for p in parts]
            merged[name] = _fold(getattr(target, name), values, reduce_fx, count, batch_count)
    _put(target, States(merged, count + batch_count, target.device))


def batch_value(scratch: Any, parts: list[States]) -> Any:
    """What ``compute()`` gives on ``parts`` merged (the replicas' last forwards: the whole batch).

    Args:
        scratch: the Metric of the replica that left ``parts[0]`` (so on its device), no longer needed
            (its states are merged already): it is overwritten, and computes.
        parts: what each replica's last forward left, in replica order.
    """
    _put(scratch, parts[0])
    merge_into(scratch, parts[1:])
    return scratch.compute()


def _empty(metric: Any) -> States:
    defaults = metric._defaults  # noqa: SLF001  (no public reader)
    return States({n: d.clone() if isinstance(d, Tensor) else [] for n, d in defaults.items()}, 0, metric.device)


def _put(metric: Any, states: States) -> None:
    """Make ``states`` ``metric``'s own (it must be on ``states.device``)."""
    # States are plain instance attributes: straight into the instance dict, as object.__setattr__ would put
    # them (nn.Module.__setattr__'s checks would cost more than the merge). The update count and the cached
    # compute() are set here because only update() and forward() set them, and neither can run here.
    vars(metric).update(states.values, _update_count=states.updates, _computed=None)


def _forward_apart(metric: Any, forwards: dict[int, States]) -> Callable[..., Any]:
    forward = type(metric).forward  # the class's (a subclass may override it)

    def forward_apart(*args: Any, **kwargs: Any) -> Any:
        earlier = states_of(metric)
        _put(metric, _empty(metric))
        value = forward(metric, *args, **kwargs)
        # Every merge makes new tensors and lists: later updates will not change what is kept here.
        forwards[id(metric)] = batch = states_of(metric)
        _put(metric, earlier)
        merge_into(metric, [batch])
        return value

    return forward_apart


def _check_mergeable(metric: Any) -> None:
    name = type(metric).__name__
    if metric.full_state_update is not False:
        raise RuntimeError(
            f"strategy='dp' cannot merge the replicas' states of {name}: its full_state_update is "
            f"{metric.full_state_update}, so its update may read the state gathered so far, which a replica "
            "does not have. If its update only adds to its states, set full_state_update = False in the class; "
            "otherwise use strategy='single' or 'ddp'."
        )
    for state, reduce_fx in metric._reductions.items():  # noqa: SLF001  (no public reader)
        if reduce_fx is None and isinstance(getattr(metric, state), Tensor):
            raise RuntimeError(
                f"strategy='dp' cannot merge the replicas' states of {name}: its tensor state {state!r} has "
                "dist_reduce_fx=None, which says nothing of how two values combine. Give it a reduction "
                "(add_state(..., dist_reduce_fx='sum', 'max', 'min', 'cat' or a function of the stacked "
                "values)), or use strategy='single' or 'ddp'."
            )


def _moved(value: Any, source: torch.device, device: torch.device) -> Any:
    """A replica's state value on ``device``: a tensor state, or the items of a list that sit on ``source``
    (the replica's device; items kept elsewhere, as with ``compute_on_cpu``, stay there)."""
    if source == device:
        return value
    if isinstance(value, Tensor):
        return value.to(device)
    return [v.to(device) if isinstance(v, Tensor) and v.device == source else v for v in value]


def _fold(current: Any, values: list[Any], reduce_fx: Any, count: int, batch_count: int) -> Any:
    """``current`` followed by ``values`` (one per replica, in order) as one state value; always a new
    object (a list or tensor that anything else holds is never changed)."""
    if isinstance(current, list):
        return [*current, *(item for v in values for item in v)]
    from torchmetrics.utilities.data import dim_zero_cat, dim_zero_mean  # a Metric exists: it is imported

    if reduce_fx is dim_zero_cat:
        return torch.cat([current, *values])
    if reduce_fx is dim_zero_mean:  # as forward folds a batch in: ((k - 1) * state + batch) / k
        batch = torch.stack(values).float().mean(0)
        return (count * current + batch_count * batch) / (count + batch_count)
    return reduce_fx(torch.stack([current, *values]))
