"""Automatic resume: a restarted job continues from its own most recent checkpoint.

Two ways in:

- **A restart.** Under ``torchrun --max-restarts N`` (``TORCHELASTIC_RESTART_COUNT > 0``) or a
  requeued SLURM job (``SLURM_RESTART_COUNT > 0``), ``fit`` resumes from the most recent complete
  checkpoint *this job* wrote, whatever ``ckpt_path`` says (that path was where the first attempt
  started; the job's own checkpoint is later). "This job" is recorded in every checkpoint
  (``"job"``, see :func:`job_key`), so a restart never picks up a checkpoint another job left in the
  same directory; when the job has none yet, ``fit`` starts as the first attempt did.
- **``fit(ckpt_path="auto")``**, for restarts that no launcher reports (a shell loop around
  ``python train.py``): resume from the most recent complete checkpoint in this Trainer's
  checkpoint directories (with the default logger, in any of its runs, and the run continues in
  that run's directory), or start fresh, without a warning, when there is none.

Either way global rank zero prints one line saying which file and step it resumes from. Complete
means a file ModelCheckpoint or preemption wrote (writes are atomic: a file under a ``.ckpt`` name
is whole) with the training state (not ``save_weights_only``), readable, its checksums right (bit
rot or a bad disk damages a whole file after the fact); ``on_exception.ckpt`` is never chosen,
since it records the moment of a failure rather than a step boundary. The most recent is the
newest by modification time, ``last*.ckpt`` first among equals; a damaged one is skipped with a
warning, so a restart is never stuck on it.
"""

from __future__ import annotations

import glob
import os
import socket
import sys
import warnings
from typing import Any

import torch

from ember.checkpoint import sharded
from ember.checkpoint.format import FORMAT, CheckpointError
from ember.checkpoint.reading import verify
from ember.user_frames import user_stacklevel

#: ``fit(ckpt_path=AUTO)``: resume when a checkpoint exists, else start fresh.
AUTO = "auto"


def restart(env: Any = None) -> str | None:
    """``"torchrun restart N"`` / ``"SLURM requeue N"`` when this process is a restart of a job."""
    env = os.environ if env is None else env
    for var, what in (("TORCHELASTIC_RESTART_COUNT", "torchrun restart"), ("SLURM_RESTART_COUNT", "SLURM requeue")):
        count = (env.get(var) or "0").strip()
        if count.isdigit() and int(count) > 0:
            return f"{what} {int(count)} ({var}={count})"
    return None


def _agent_identity(pid: int) -> str:
    """``pid:start time`` of a process (Linux), so a pid reused by a later process differs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f"{pid}:{f.read().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return str(pid)


def job_key(env: Any = None) -> str | None:
    """Who wrote a checkpoint: the same for every attempt of one job, different between jobs.

    SLURM: the job id (array job and task for arrays), kept across requeues. torchrun: the run id and
    the agent process (its host, pid and start time): the agent outlives the workers it restarts, and
    ``--rdzv-id`` defaults to the same "none" for every job. None outside those launchers.
    """
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID"):
        array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
        return f"slurm:{array}_{task}" if array and task else f"slurm:{env['SLURM_JOB_ID']}"
    if "TORCHELASTIC_RESTART_COUNT" in env:
        return f"torchrun:{env.get('TORCHELASTIC_RUN_ID', '')}:{socket.gethostname()}:{_agent_identity(os.getppid())}"
    return None


def _peek(path: str) -> dict[str, Any]:
    """The small entries of a checkpoint (tensors stay on disk: mmap); raises a CheckpointError when
    it cannot be read."""
    if sharded.is_sharded(path):  # a directory: its plain entries (placeholders for the shards) say it all
        ckpt = sharded.read_meta(path)
        return {k: ckpt.get(k) for k in ("job", "weights_only", "epoch", "global_step", "format")}
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        reason = (str(err).strip().splitlines() or [""])[0]
        raise CheckpointError(f"it cannot be read ({type(err).__name__}: {reason})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError("it cannot be read as an ember checkpoint")
    return {k: ckpt.get(k) for k in ("job", "weights_only", "epoch", "global_step", "format")}


def find_resumable(patterns: list[str], job: str | None) -> tuple[str, dict[str, Any]] | None:
    """The most recent complete checkpoint among the files ``patterns`` match (of job ``job`` when
    given) and its entries.

    The one chosen is read whole first, its checksums included: a damaged file is skipped, with a
    warning saying which and why, and the next newest is tried, so a restart is never stuck on a
    file it cannot load.
    """
    files = {
        os.path.abspath(p)
        for pattern in patterns
        for p in glob.glob(pattern)
        if not os.path.basename(p).startswith("on_exception")
    }

    def recency(p: str) -> tuple[float, bool]:
        try:
            return os.path.getmtime(p), os.path.basename(p).startswith("last")
        except OSError:  # removed meanwhile, or a link to a removed file
            return -1.0, False

    for path in sorted(files, key=recency, reverse=True):
        try:
            meta = _peek(path) if os.path.exists(path) else None
            if meta is not None and (meta["weights_only"] is not False or (job is not None and meta["job"] != job)):
                continue
            verify(path)  # reads the file whole: only for the one that would be chosen
        except CheckpointError as err:
            warnings.warn(
                f"Skipping {path} while looking for a checkpoint to resume from: {_why(err, path)}",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
            continue
        if meta is None:
            continue
        return path, meta
    return None


def _why(err: CheckpointError, path: str) -> str:
    """The error without the path the warning names already."""
    text = str(err).replace(f"Checkpoint {path!r} ", "it ").replace(f"{path!r} ", "it ")
    return text.replace(" Use an earlier checkpoint.", "") + " Trying the next most recent one."


def applies(ckpt_path: Any) -> bool:
    """Whether ``fit`` looks for a checkpoint itself: a restart, or ``ckpt_path="auto"``. The same on
    every rank (the launcher's variables are the job's)."""
    return ckpt_path == AUTO or restart() is not None


def choose(ckpt_path: Any, patterns: list[str]) -> tuple[str | None, bool]:
    """What ``fit`` resumes from when :func:`applies`: ``(path or None, whether it was found here)``;
    ``ckpt_path`` comes back, not found here, when a restarted job has no checkpoint of its own yet.
    Runs on global rank zero."""
    again = restart()
    found = find_resumable(patterns, job_key() if again is not None else None)
    if found is None:
        if again is not None:
            start = f"from {ckpt_path}" if ckpt_path not in (None, AUTO) else "from scratch"
            _say(f"{again}: no checkpoint of this job yet; starting {start}.")
            return (None if ckpt_path == AUTO else ckpt_path), False
        return None, True
    path, meta = found
    why = again if again is not None else "ckpt_path='auto'"
    _say(f"{why}: resuming from {path} (epoch {meta['epoch']}, global step {meta['global_step']}).")
    return path, True


def _say(line: str) -> None:
    print(f"[ember] {line}", file=sys.stderr, flush=True)
