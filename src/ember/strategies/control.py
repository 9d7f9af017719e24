"""Control decisions across ranks (stop now? save now?) on a CPU group, off the device's stream.

A control decision is one small integer per rank: has this rank received a stop signal, does rank
zero's clock say a checkpoint is due, does every rank still have a batch. Reduced as a CUDA tensor
it costs a host-to-device copy, an NCCL collective queued behind the step's kernels, and a
``.item()`` that makes the host wait until the GPU has run everything queued before it: the
stream drains and the next step starts with an idle GPU. So these values never touch the device:
they are CPU tensors reduced over gloo. With NCCL as the job's backend, ember creates one gloo
group for them when the strategy joins the job (:func:`open_control_group`), with the same ranks; with gloo
(or a default group that already handles CPU tensors, ``"cpu:gloo,cuda:nccl"``) the default group
is used.

A blocking CPU collective still waits for the other ranks' hosts (not for any GPU). Decisions that
come at every step boundary go further and do not wait at all when they are taken:
:meth:`~ember.strategies.strategy.Strategy.start_decision` starts the collective with
``async_op=True`` and returns a :class:`Decision`; the caller reads it (``result()``) a fixed number
of step boundaries later, by which time every rank has long since sent its part. Every rank starts
and reads the same decisions at the same boundaries, so every rank acts at the same step.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = ["Decision", "DecisionMode", "check_decision_mode", "open_control_group", "close_control_group"]

#: How the ranks' booleans combine: every rank must say yes, any rank may, or rank zero's answer counts.
DecisionMode = Literal["all", "any", "rank_zero"]
DECISION_MODES: tuple[str, ...] = ("all", "any", "rank_zero")


def check_decision_mode(mode: str) -> None:
    if mode not in DECISION_MODES:
        raise ValueError(
            f"start_decision(mode={mode!r}) is not a way to combine the ranks' answers: use 'all' (every "
            "rank must say yes), 'any' (one rank is enough) or 'rank_zero' (rank zero decides)."
        )


class Decision:
    """A boolean the ranks agree on, possibly still on its way: :meth:`result` returns it.

    Args:
        value: the one-element CPU tensor the collective writes the agreed value into (or a
            single process's own decision).
        wait: waits for the collective to complete (None when it already has).
    """

    __slots__ = ("_value", "_wait", "_result")

    def __init__(self, value: torch.Tensor | bool, wait: Callable[[], Any] | None = None) -> None:
        self._value = value
        self._wait = wait
        self._result: bool | None = None

    def result(self) -> bool:
        """The agreed value; waits for the collective the first time if it is still running (a wait
        on the other ranks' hosts only: the value is a CPU tensor, no device is involved)."""
        if self._result is None:
            if self._wait is not None:
                self._wait()
                self._wait = None
            value = self._value
            self._result = bool(value.item()) if isinstance(value, torch.Tensor) else bool(value)
        return self._result


def open_control_group(timeout: datetime.timedelta | None = None) -> Any:
    """The group for control collectives: None (the default group) when it reduces CPU tensors
    itself (gloo, or a ``"cpu:gloo,..."`` device mapping), else a new gloo group of all ranks.

    Collective: every rank calls it, at the same point, after the default group exists.

    Args:
        timeout: how long a collective of the new group may wait (the strategy's ``timeout``, as for the
            default group); None keeps torch's default for gloo groups.
    """
    if "gloo" in str(dist.get_backend()).lower():
        return None
    return dist.new_group(backend="gloo", timeout=timeout)


def close_control_group(group: Any) -> None:
    """Release a group made by :func:`open_control_group` (nothing for the default group)."""
    if group is not None and dist.is_initialized():
        dist.destroy_process_group(group)
