"""What the machine and the job's processes share: CPU cores for loader workers, a filesystem."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["is_shared_filesystem", "suggested_max_num_workers"]


def _cpus_available() -> int:
    if hasattr(os, "sched_getaffinity"):  # the cores this process may run on (a job's share, under SLURM)
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def suggested_max_num_workers(local_world_size: int) -> int:
    """An upper bound for a DataLoader's ``num_workers``: this machine's cores shared among its
    ``local_world_size`` processes, one core of each share left to the process itself (at least 1).

    Args:
        local_world_size: the number of the job's processes on this machine (the devices it trains on).
    """
    if not isinstance(local_world_size, int) or isinstance(local_world_size, bool) or local_world_size < 1:
        raise ValueError(f"local_world_size must be an int >= 1, got {local_world_size!r}.")
    return max(1, _cpus_available() // local_world_size - 1)


def is_shared_filesystem(strategy: Any, path: str | os.PathLike | None = None, timeout: float = 3) -> bool:
    """Whether every process of the job sees the same files at ``path`` (default: the working directory).

    Call it on every rank (it is a collective). One process alone: True. Otherwise rank zero writes a file
    in the folder and each rank looks for it (for up to ``timeout`` seconds); True only if all find it.
    A path that is not a local one (``s3://...``) counts as shared.

    Args:
        strategy: the run's strategy (``trainer.strategy``): its ``world_size``, ``broadcast`` and
            ``reduce_boolean_decision``.
        path: the folder to check; it must exist and be writable on rank zero.
        timeout: how long a rank waits for the file to appear.
    """
    if path is not None and "://" in str(path) and not str(path).startswith("file://"):
        return True
    folder = Path(Path.cwd() if path is None else str(path).removeprefix("file://")).resolve()
    if getattr(strategy, "world_size", 1) == 1:
        return True
    # Different paths on different ranks: not one filesystem seen the same way.
    same_path = strategy.broadcast(folder) == folder
    if not strategy.reduce_boolean_decision(same_path, all=True):
        return False
    probe = None
    if strategy.global_rank == 0:
        fd, probe = tempfile.mkstemp(prefix=".ember_shared_fs_", dir=folder)
        os.close(fd)
    probe = strategy.broadcast(probe)
    try:
        deadline = time.monotonic() + timeout
        found = os.path.exists(probe)
        while not found and time.monotonic() < deadline:
            time.sleep(0.05)
            found = os.path.exists(probe)
        return bool(strategy.reduce_boolean_decision(found, all=True))
    finally:
        if strategy.global_rank == 0:
            os.unlink(probe)
