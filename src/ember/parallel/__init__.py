"""ember's own data-parallel engine, usable without the Trainer.

``DataParallel`` and ``DistributedDataParallel`` are drop-in replacements for PyTorch's classes
of the same names, built on ember's scatter / replicate / parallel_apply / gather primitives and
on ember's bucketed gradient reducer.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DataParallel", "DistributedDataParallel"]


def __getattr__(name: str) -> Any:
    if name == "DataParallel":
        from ember.parallel.data_parallel import DataParallel

        return DataParallel
    if name == "DistributedDataParallel":
        from ember.parallel.distributed import DistributedDataParallel

        return DistributedDataParallel
    raise AttributeError(f"module 'ember.parallel' has no attribute {name!r}")
