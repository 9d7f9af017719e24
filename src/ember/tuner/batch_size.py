"""Batch-size scaling (``Tuner.scale_batch_size``), with Lightning's search.

Each trial runs ``steps_per_trial`` batches (a short fit, or a short validate / test / predict)
with the batch size set on the module or datamodule, which builds its loaders from it; a trial
that runs out of memory is caught and the size lowered. "power" doubles from ``init_val`` until a
trial fails, ``max_trials`` is reached, the size reaches ``max_val`` or covers the whole dataset,
and keeps the last size that worked; "binsearch" then bisects between the last success and the
failure, and takes ``margin`` off the result for headroom.

On CPU there is no allocator limit to hit, so besides ``max_val`` a test (or a user) can make a
trial fail the way CUDA does, by raising ``torch.OutOfMemoryError`` (or ``MemoryError``) from the
step. Under ddp the search runs on every rank alike and stops at ``max_val`` or the dataset's size;
an out-of-memory error there ends the job as any failure of one rank does (the other ranks are
inside a collective that rank will never join), so keep ``max_val`` below what fits.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
)


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the device (or the host) ran out of memory."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def search(
    trial: Callable[[int], int | None], mode: str, init_val: int, max_trials: int, margin: float, max_val: int
) -> int:
    """The batch size to use. ``trial(size)`` runs one trial and returns the dataset's length (None when
    unknown); it raises an out-of-memory error when the size does not fit."""
    size, low, high = min(init_val, max_val), 1, None
    last_ok: int | None = None
    for count in range(1, max_trials + 1):
        try:
            length = trial(size)
        except Exception as exc:  # an out-of-memory error lowers the size; anything else is the user's to see
            if not is_oom_error(exc):
                raise
            free_memory()
            high = size
            log.info("Batch size %d ran out of memory.", size)
            if mode == "power":
                if last_ok is not None:
                    break
                size = max(1, size // 2)
            else:
                size = (high + (last_ok or 0)) // 2 if last_ok is not None else max(1, size // 2)
            if size < 1 or size == high or (last_ok is not None and size <= last_ok):
                break
            continue
        last_ok = low = size
        if length is not None and size >= length:
            log.info("Batch size %d covers the whole dataset (%d samples); stopping.", size, length)
            break
        if size >= max_val:
            log.info("Reached max_val=%d; stopping.", max_val)
            break
        if count == max_trials:
            break
        if mode == "binsearch" and high is not None:
            if high - low <= 1:
                break
            size = (low + high) // 2
        else:
            size = min(size * 2, max_val)
    if last_ok is None:
        raise RuntimeError(
            f"scale_batch_size found no batch size that fits: even {size} ran out of memory. Free "
            "memory, make the model smaller, or start from a smaller init_val."
        )
    if mode == "binsearch" and margin > 0:
        last_ok = max(1, int(last_ok * (1 - margin)))
    return last_ok


def dataset_length(loader: Any) -> int | None:
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return None
