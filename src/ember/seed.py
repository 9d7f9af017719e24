"""Seeding every random number generator a run touches."""

from __future__ import annotations

import os
import random

import torch


def seed_everything(seed: int | None = None, workers: bool = False) -> int:
    """Seed Python's ``random``, NumPy (when installed) and torch (CPU and CUDA).

    Args:
        seed: the seed; read from ``EMBER_GLOBAL_SEED`` or 0 when omitted.
        workers: also make DataLoader workers seed themselves from it (sets ``EMBER_SEED_WORKERS``).

    Returns:
        The seed used.
    """
    if seed is None:
        seed = int(os.environ.get("EMBER_GLOBAL_SEED", 0))
    if not isinstance(seed, int) or not (0 <= seed < 2**32):
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}.")
    os.environ["EMBER_GLOBAL_SEED"] = str(seed)
    os.environ["EMBER_SEED_WORKERS"] = str(int(workers))
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)  # seeds CUDA too
    return seed
