"""The one line a successful ``fit`` prints at its end, on global rank zero: where the logs and the
checkpoints went.

    ember: logs in ember_logs/version_0; checkpoint ember_logs/version_0/checkpoints/epoch=9-step=230.ckpt

It names the log directory (``trainer.log_dir``) when the trainer has a logger, and for each
``ModelCheckpoint`` that saved: its best checkpoint (``best <monitor> checkpoint``; a plain
``checkpoint`` when it monitors nothing, as its ``best_model_path`` is then the latest one) and its
``last.ckpt`` when it differs. Paths under the working directory are shown relative to it. Without a
logger and without a saved checkpoint nothing is printed; a fit that fails never gets here.
"""

from __future__ import annotations

import os
from typing import Any


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies under it, else absolute."""
    full = os.path.abspath(path)
    try:
        rel = os.path.relpath(full)
    except ValueError:  # another drive (Windows)
        return full
    return full if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


def fit_summary(trainer: Any) -> str | None:
    """The end-of-fit line for ``trainer``, or None when there is nothing to say."""
    parts = []
    if trainer.loggers and trainer.log_dir is not None:
        parts.append(f"logs in {_shown(trainer.log_dir)}")
    seen: set[str] = set()
    for cb in trainer.checkpoint_callbacks:
        best, last = getattr(cb, "best_model_path", ""), getattr(cb, "last_model_path", "")
        monitor = getattr(cb, "monitor", None)
        if best and best not in seen:
            seen.add(best)
            parts.append(f"best {monitor} checkpoint {_shown(best)}" if monitor else f"checkpoint {_shown(best)}")
        if last and last not in seen:
            seen.add(last)
            parts.append(f"last checkpoint {_shown(last)}")
    return "ember: " + "; ".join(parts) if parts else None


def print_fit_summary(trainer: Any) -> None:
    """Print :func:`fit_summary`'s line on global rank zero (nothing on the other ranks)."""
    if not trainer.is_global_zero:
        return
    line = fit_summary(trainer)
    if line is not None:
        print(line, flush=True)
