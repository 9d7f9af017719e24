"""Rank-zero helpers under Lightning's names: ``rank_zero_only``, ``rank_zero_info``, ``rank_zero_warn`` and
``rank_zero_deprecation``.

``rank_zero_only``, ``rank_zero_warn`` and ``rank_zero_deprecation`` are lightning-utilities' own objects, so a
process that runs Lightning code and ember code side by side has one rank for both. The rank is read from the launcher's
environment when this module is first imported (``RANK``, then ``LOCAL_RANK``, then ``SLURM_PROCID``;
0 when none is set), unless something (Lightning, or a strategy) has set ``rank_zero_only.rank`` already.
A process that learns its rank later sets ``rank_zero_only.rank = global_rank`` itself.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_deprecation, rank_zero_only, rank_zero_warn

__all__ = ["rank_zero_deprecation", "rank_zero_only", "rank_zero_info", "rank_zero_warn"]

# Checked in this order: a SLURM job may set SLURM_PROCID around processes it does not start itself.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID")

_log = logging.getLogger(__name__)  # a child of the "ember" logger, which prints on global rank zero


def rank_from_environment() -> int | None:
    """The process's rank as its launcher's environment gives it, or ``None`` when no launcher set one.

    Returns:
        The value of the first of ``RANK``, ``LOCAL_RANK`` and ``SLURM_PROCID`` that is set.
    """
    for name in _RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None:
            return int(value)
    return None


if getattr(rank_zero_only, "rank", None) is None:
    setattr(rank_zero_only, "rank", rank_from_environment() or 0)  # noqa: B010 (mypy: no such attribute)


@rank_zero_only
def rank_zero_info(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """Log an INFO message to ember's logger, on global rank zero only.

    Args:
        *args: the message and its ``%`` arguments, as for :meth:`logging.Logger.info`.
        stacklevel: the frame the record names as its origin; the default, 4, is the caller's.
        **kwargs: further keyword arguments of :meth:`logging.Logger.info`.
    """
    _info(*args, stacklevel=stacklevel, **kwargs)


def _info(*args: Any, stacklevel: int, **kwargs: Any) -> None:
    # One frame between the caller's and logging's, as in lightning-utilities, so the same stacklevel
    # (4: _info, rank_zero_info, the rank_zero_only wrapper, the caller) points at the caller.
    _log.info(*args, stacklevel=stacklevel, **kwargs)
