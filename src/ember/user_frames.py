"""Where a warning about the user's code should point: the user's line, not ember's.

A warning raised deep in a fit (``Trainer.fit`` -> the strategy's launch -> the stages -> the loaders...) at a
fixed ``stacklevel`` points at whichever ember frame sits that many levels up, and that depth differs by
strategy (a ddp launcher adds frames). :func:`user_stacklevel` counts instead: the ``stacklevel`` of the first
frame, going out from its caller, whose code is not ember's, so ``warnings.warn(..., stacklevel=user_stacklevel())``
names the user's ``trainer.fit(...)`` line (or their hook that called into ember).
"""

from __future__ import annotations

import os
import sys

_EMBER = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called by this function's caller that points at the first frame
    outside ember (2, the caller's caller, when every frame is ember's)."""
    frame = sys._getframe(1)  # the caller: the function about to warn (stacklevel 1)  # noqa: SLF001
    level = 1
    while frame is not None:
        if not os.path.abspath(frame.f_code.co_filename).startswith(_EMBER):
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return 2
