"""What the ddp watchdog reads in the ranks' records, and the words of its verdicts.

Every rank's :class:`~ember.strategies.watchdog.watchdog.Watchdog` publishes a record to the job's store
once a second: a dict with its ``state``, ``batches``, ``batch``, ``loop``, ``where`` (the phase),
``waiting`` (the collective it waits in, or None), ``stalled``, ``slowest``, ``pid``, ``host``, and
the Trainer's ``stage``, ``step`` and ``epoch``. The functions here take those records (by rank,
None for a rank that has published nothing): which ranks did not arrive at the collective this
one waits in (:func:`missing`), which training ranks are behind this one (:func:`behind`), and the
text that names them in a verdict, a timed-out collective's explanation, or an abort. The phases
of a training batch, which the strategy sets and the judge compares ranks by, are defined here.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "TRAINING_STEP",
    "AFTER_STEP",
    "BACKWARD",
    "AFTER_BACKWARD",
    "Records",
    "missing",
    "behind",
    "describe",
    "position",
    "behind_summary",
    "missing_summary",
    "mismatch_summary",
    "deadline_detail",
    "timeout_summary",
    "abort_summary",
]

# The phases of a training batch, in order: the strategy sets them, the judge compares ranks by them.
TRAINING_STEP = "training_step"
AFTER_STEP = "the training loop after training_step"
BACKWARD = "backward"
AFTER_BACKWARD = "the training loop after backward (optimizer step, callbacks, checkpointing, next batch)"
_PHASE_ORDER = {TRAINING_STEP: 1, AFTER_STEP: 2, BACKWARD: 3, AFTER_BACKWARD: 4}

Records = dict[int, dict[str, Any] | None]  # a record by rank; None: it has published none


# ---------------------------------------------------------------------- reading the records
def missing(records: Records, rank: int) -> tuple[list[int], list[int]]:
    """Ranks not in any collective (they did not arrive), and ranks waiting in another one than ``rank``."""
    mine = records[rank]
    assert mine is not None  # this rank published its record before reading them
    absent, elsewhere = [], []
    for r, rec in records.items():
        if r == rank:
            continue
        if rec is None or rec["state"] != "running" or not rec["waiting"]:
            absent.append(r)
        elif rec["waiting"] != mine["waiting"]:
            elsewhere.append(r)
    return absent, elsewhere


def behind(records: Records, rank: int, limit: float) -> list[int]:
    """Training ranks at an earlier batch or phase than ``rank``, stalled as long, not in a collective."""
    mine = _training_position(records[rank])
    if mine is None:
        return []
    margin = 2.0  # records are up to a second old
    return [
        r
        for r, rec in records.items()
        if r != rank
        and rec
        and not rec["waiting"]
        and rec.get("stalled", 0) >= limit - margin
        and (_training_position(rec) or mine) < mine
    ]


def _training_position(rec: dict[str, Any] | None) -> tuple[int, int, int] | None:
    """(epoch, batch, phase) of a rank in the training loop, comparable across ranks; else None
    (evaluation shards differ in length between ranks, so their positions are not comparable)."""
    if (
        not rec
        or rec["state"] != "running"
        or rec.get("stage") != "fitting"
        or rec.get("loop") != "training"
        or not rec.get("batches")
        or rec.get("epoch") is None
    ):
        return None
    return rec["epoch"], rec["batch"], _PHASE_ORDER.get(rec["where"], 0)


# ---------------------------------------------------------------------- the words
def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def position(rec: dict[str, Any]) -> str:
    """Where a rank is in its loop: "at step 12 (epoch 0, batch 12)", "before its first batch"..."""
    if not rec.get("batches"):
        return "before its first batch"
    step, epoch, batch, loop = rec.get("step"), rec.get("epoch"), rec.get("batch"), rec.get("loop")
    where = f"{loop} batch {batch}" if loop != "training" else f"batch {batch}"
    if rec.get("stage") == "fitting" and step is not None:
        return f"at step {step} (epoch {epoch}, {where})"
    return f"at {where}"


def describe(rank: int, rec: dict[str, Any] | None) -> str:
    """One rank from its record: what it is stuck or waiting in, where, its pid and host."""
    if rec is None:
        return (
            f"rank {rank} has reported nothing since this run began (it is stuck before its watchdog started, or gone)"
        )
    if rec["state"] != "running":
        return f"rank {rank} has already left this run"
    place = f"waiting in {rec['waiting']}" if rec["waiting"] else f"stuck in {rec['where']}"
    return f"rank {rank} is {place} {position(rec)} (pid {rec['pid']} on {rec['host']})"


def behind_summary(records: Records, late: list[int], rank: int, waited: float) -> str:
    """The verdict when ``rank`` made no progress and the ``late`` ranks are behind it."""
    mine = records[rank]
    assert mine is not None  # this rank published its record before reading them
    return (
        f"{'; '.join(describe(r, records[r]) for r in late)}. Rank {rank} is "
        f"ahead, {position(mine)}, and has made no progress for {waited:.0f} s: it waits "
        f"for {'it' if len(late) == 1 else 'them'} (in a collective whose wait does not "
        "block the CPU, as with NCCL, or one ember does not see)."
    )


def missing_summary(records: Records, absent: list[int], rank: int, waited: float) -> str:
    """The verdict when the ``absent`` ranks kept ``rank`` (and whoever waits with it) waiting."""
    mine = records[rank]
    assert mine is not None  # this rank published its record before reading them
    waiters = [
        r for r, rec in records.items() if rec and rec["state"] == "running" and rec["waiting"] == mine["waiting"]
    ]
    return (
        f"{'; '.join(describe(r, records[r]) for r in absent)}. "
        f"{_ranks(waiters).capitalize()} waited {waited:.0f} s for "
        f"{'it' if len(absent) == 1 else 'them'} in {mine['waiting']}."
    )


def mismatch_summary(records: Records) -> str:
    """The verdict when every rank waits, but not all in the same collective."""
    return (
        "the ranks wait in different collectives, which never match up: "
        + "; ".join(describe(r, rec) for r, rec in records.items())
        + ". Every rank must call the same collectives in the same order."
    )


def deadline_detail(limit: float, floor: float | None, slowest: float, timeout: float, factor: int) -> str:
    """How the deadline ``limit`` came about, and how to change it (printed by the judging rank)."""
    return (
        f"The watchdog deadline was {limit:.0f} s: the larger of watchdog_timeout="
        f"{floor:g} s and {factor} x the slowest step so far ({slowest:.1f} s), kept "
        f"under the collective timeout ({timeout:g} s). Set DDPStrategy(watchdog_timeout=...) "
        "to change it, or None to turn the watchdog off."
    )


def timeout_summary(records: Records, absent: list[int], rank: int, what: str, timeout: float) -> str:
    """Why ``what`` timed out on ``rank``: the ``absent`` ranks did not arrive (or nobody is absent)."""
    if absent:
        it = "it" if len(absent) == 1 else "them"
        return (
            f"{'; '.join(describe(r, records[r]) for r in absent)}. "
            f"{'It' if len(absent) == 1 else 'They'} did not arrive at {what}, where rank "
            f"{rank} waited for {it} until the collective timeout ({timeout:g} s)."
        )
    return (
        f"every rank is in a collective, yet {what} timed out on rank {rank} after "
        f"{timeout:g} s: "
        + "; ".join(describe(r, rec) for r, rec in records.items())
        + ". Mismatched collectives, or a network or device fault."
    )


def abort_summary(records: Records, named: list[int], rank: int, message: str, world_size: int) -> str:
    """An abort by ``rank``: ``message``, then where the ``named`` ranks and a few waiting ones are."""
    waiting = [r for r in range(world_size) if r not in named]
    places = [describe(r, records[r]) for r in named + waiting[:4]]
    if len(waiting) > 4:
        places.append(f"{len(waiting) - 4} more ranks are waiting")
    return f"rank {rank} {message} Where the ranks are: {'; '.join(places)}."
