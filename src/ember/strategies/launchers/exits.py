"""Exit statuses of a ddp job's processes: in words, and as the status of the whole job.

The process that started the job (what a scheduler reads) exits, from :func:`job_status`, with 1
when a rank failed; ``128 + N`` when the ranks stopped on signal N rather than failed (a preempted
run exits 143 on every rank after writing ``last.ckpt``, see ``ember/trainer/preemption.py``); 0
otherwise. A rank the launcher itself stopped does not count. Ctrl-C ends the launching process as
Python ends any script on an uncaught ``KeyboardInterrupt``: killed by SIGINT, which a shell
reports as 130.
"""

from __future__ import annotations

import signal
from typing import Any

__all__ = ["describe_exit", "signal_name", "stop_signal", "job_status", "exit_status"]


def describe_exit(code: int) -> str:
    """An exit status in words: "exited with status 3", "was killed by signal 9 (SIGKILL)"."""
    return f"exited with status {code}" if code >= 0 else f"was killed by {signal_name(-code)}"


def signal_name(signum: int) -> str:
    """A signal in words: "signal 9 (SIGKILL)"."""
    try:
        return f"signal {signum} ({signal.Signals(signum).name})"
    except ValueError:
        return f"signal {signum}"


def stop_signal(code: int) -> int | None:
    """The signal a rank stopped on rather than failed, from its exit status, else None.

    ``128 + N``: the rank caught signal N and exited with the shell's status for it (a preempted
    rank exits 143). Killed by SIGINT: Python's end after an uncaught ``KeyboardInterrupt``, whose
    traceback it printed. Killed by SIGTERM: a scheduler's stop reached it outside ``fit``.
    """
    if code in (-signal.SIGINT, -signal.SIGTERM):
        return -code
    return code - 128 if 128 < code < 128 + signal.NSIG else None


def job_status(codes: Any) -> int:
    """The exit status of a job from its ranks' (None: still running, or stopped by the launcher).

    1 if any rank failed; else ``128 + N`` for the first that stopped on signal N; else 0.
    """
    stops = []
    for code in codes:
        if not code:
            continue
        sig = stop_signal(code)
        if sig is None:
            return 1
        stops.append(128 + sig)
    return stops[0] if stops else 0


def exit_status(code: Any) -> int:
    """What Python exits with for ``SystemExit(code)``."""
    return 0 if code is None else code if isinstance(code, int) else 1
