"""This process's random generators: seeding them all (:func:`seed_everything`), and their states as plain
data: capture, restore, and a flat tensor form.

A leaf module: checkpoints save these states (one per rank, gathered as flat tensors:
:func:`gather_rng`), and ``ddp_spawn`` hands the caller's states to its workers, so that both the trainer
and the strategies can use them without importing each other.
"""

from __future__ import annotations

import logging
import os
import random
import warnings
from typing import Any, Protocol, cast

import torch

from ember.user_frames import user_stacklevel

_log = logging.getLogger(__name__)  # a child of the "ember" logger, which prints on global rank zero


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's ``random``, NumPy (when installed) and torch (CPU and CUDA).

    Args:
        seed: the seed; read from ``EMBER_GLOBAL_SEED`` or 0 when omitted.
        workers: also make DataLoader workers seed themselves from it (sets ``EMBER_SEED_WORKERS``).
        verbose: log "Seed set to N" (INFO, ``ember.rng``; prefixed with ``[rank: R]`` when a launcher set
            the process's rank), and warn when no seed was given nor found in the environment, as Lightning.

    Returns:
        The seed used.
    """
    rank = _launcher_rank()
    if seed is None:
        found = os.environ.get("EMBER_GLOBAL_SEED")
        seed = int(found) if found is not None else 0
        if found is None and verbose and not rank:  # (on rank zero only, as Lightning's rank_zero_warn)
            warnings.warn(f"No seed found, seed set to {seed}", UserWarning, stacklevel=user_stacklevel())
    if not isinstance(seed, int) or not (0 <= seed < 2**32):
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}.")
    if verbose:
        _log.info(f"Seed set to {seed}" if rank is None else f"[rank: {rank}] Seed set to {seed}")
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


def _launcher_rank() -> int | None:
    """The process's rank as a launcher's environment gives it (Lightning's order of variables), else None."""
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(name)
        if value is not None:
            return int(value)
    return None


def capture_rng() -> dict[str, Any]:
    """This process's generator states as plain data."""
    version, mt, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss_next": gauss},
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
        "numpy": None,
    }
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = cast("tuple[str, Any, int, int, float]", np.random.get_state(legacy=True))
    state["numpy"] = {
        "name": str(name),
        "keys": torch.from_numpy(keys.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def apply_rng(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` returned."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    if state.get("cuda") and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    npst = state.get("numpy")
    if npst is not None:
        try:
            import numpy as np
        except ImportError:
            return
        np.random.set_state(
            (
                npst["name"],
                npst["keys"].numpy().astype("uint32"),
                npst["pos"],
                npst["has_gauss"],
                npst["cached_gaussian"],
            )
        )


def rng_to_tensor(state: dict[str, Any]) -> torch.Tensor:
    """Every generator state of :func:`capture_rng` as one int64 tensor (for an all_gather)."""
    py = state["python"]
    parts = [
        state["torch"].to(torch.int64),
        torch.tensor([py["version"]]),
        py["state"],
        torch.tensor([0 if py["gauss_next"] is None else 1]),
        torch.tensor([py["gauss_next"] or 0.0], dtype=torch.float64).view(torch.int64),
    ]
    npst = state["numpy"]
    if npst is not None:
        parts += [
            npst["keys"],
            torch.tensor([npst["pos"], npst["has_gauss"]]),
            torch.tensor([npst["cached_gaussian"]], dtype=torch.float64).view(torch.int64),
        ]
    # Every visible GPU's generator (a few bytes each), so a multi-rank resume on GPUs keeps its
    # dropout streams. The layout is this rank's: ranks of one job see the same number of GPUs.
    cuda = state.get("cuda") or []
    parts += [torch.tensor([len(cuda)])] + [c.to(torch.int64) for c in cuda]
    return torch.cat(parts)


def rng_from_tensor(flat: torch.Tensor, like: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`rng_to_tensor`, for a tensor laid out as ``like``'s is."""
    i = 0

    def take(n: int) -> torch.Tensor:
        nonlocal i
        out = flat[i : i + n]
        i += n
        return out

    nt = like["torch"].numel()
    out: dict[str, Any] = {"torch": take(nt).to(torch.uint8), "cuda": [], "numpy": None}
    version = int(take(1))
    mt = take(like["python"]["state"].numel()).clone()
    has_gauss = int(take(1))
    gauss = float(take(1).view(torch.float64))
    out["python"] = {"version": version, "state": mt, "gauss_next": gauss if has_gauss else None}
    if like["numpy"] is not None:
        keys = take(like["numpy"]["keys"].numel()).clone()
        pos, hg = take(2).tolist()
        cached = float(take(1).view(torch.float64))
        out["numpy"] = {
            "name": like["numpy"]["name"],
            "keys": keys,
            "pos": pos,
            "has_gauss": hg,
            "cached_gaussian": cached,
        }
    count = int(take(1))
    out["cuda"] = [take(c.numel()).to(torch.uint8) for c in (like.get("cuda") or [])[:count]]
    return out


class _Ranks(Protocol):
    """What :func:`gather_rng` needs of a strategy."""

    @property
    def world_size(self) -> int: ...

    def gather_per_rank(self, tensor: torch.Tensor) -> torch.Tensor: ...


def gather_rng(strategy: _Ranks) -> dict[str, Any]:
    """Every rank's generator states, ``{"world_size", "per_rank": [capture_rng() of each rank]}`` (a
    collective: every rank calls it)."""
    mine = capture_rng()
    world = strategy.world_size
    if world == 1:
        return {"world_size": 1, "per_rank": [mine]}
    # Every rank's state travels as one fixed-shape CPU tensor through one all-gather, which a strategy does
    # on the host (ddp: its CPU control group), so a save under NCCL waits for no GPU work here.
    gathered = strategy.gather_per_rank(rng_to_tensor(mine))
    return {"world_size": world, "per_rank": [rng_from_tensor(gathered[r], mine) for r in range(world)]}
