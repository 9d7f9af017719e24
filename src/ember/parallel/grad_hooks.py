"""The per-parameter gradient hooks of the :class:`~ember.parallel.reducer.Reducer`.

Each parameter gets one post-accumulate-grad hook that tells the reducer its gradient is in
(``Reducer._on_grad_ready``). The hooks hold the reducer weakly: a dropped wrapper's hooks go quiet
instead of keeping its buffers alive. A module spread over several devices gets the locked flavor,
since each device's gradients are accumulated on an autograd thread of its own.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from torch import Tensor

__all__ = ["ready_hook", "locked_ready_hook", "remove_handles"]


def ready_hook(reducer_ref: weakref.ref, index: int) -> Callable[[Tensor], None]:
    # Weak: a dropped wrapper's hooks go quiet instead of keeping its buffers alive.
    def hook(_param: Tensor) -> None:
        reducer = reducer_ref()
        if reducer is not None:
            reducer._on_grad_ready(index)

    return hook


def locked_ready_hook(reducer_ref: weakref.ref, index: int, lock: threading.Lock) -> Callable[[Tensor], None]:
    # A module spread over several devices has its gradients accumulated on one autograd thread
    # per device, concurrently: the per-iteration state (started, pending counts, the next bucket
    # to launch) must change under a lock, or ranks launch buckets in different orders (as
    # PyTorch's reducer holds a mutex in its autograd hook). One device needs none: one thread.
    def hook(_param: Tensor) -> None:
        reducer = reducer_ref()
        if reducer is not None:
            with lock:
                reducer._on_grad_ready(index)

    return hook


def remove_handles(handles: list) -> None:
    """Remove every hook of ``handles`` (what ``register_post_accumulate_grad_hook`` returned)."""
    for handle in handles:
        handle.remove()
