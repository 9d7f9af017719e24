"""The ddp watchdog: a rank that keeps the others waiting is named, with its stack, and the job ends.

In a ddp job every rank waits inside each collective until all ranks have arrived. When one rank
hangs outside a collective (stuck in user code, a dead NFS read, a deadlocked loader), the others
wait in silence until the collective timeout (30 minutes by default), and the error then comes
from a healthy rank that waited, not from the one that never arrived. The watchdog turns that into
a message about the right rank, within about a minute, for nothing measurable per step:

- **Publishing is attribute stores.** The strategy keeps one :class:`Beacon` per process and, on
  the step path, only sets a few of its attributes: a counter of batches started, the phase the
  rank is in (``"training_step"``, ``"backward"``...), and around every collective which one it is
  waiting in. No lock, no clock, no communication per step.
- **A daemon thread per rank** (:class:`Watchdog`) samples the beacon five times a second (how
  long the current wait has lasted; the longest gap between two batches, "the slowest step") and
  once a second writes a small record to the job's store (the TCPStore every ddp job already has,
  through a connection of its own) and looks whether a verdict has been posted there.
- **The judge** is any rank that has waited in one collective past the deadline: it reads every
  rank's record, and the ranks that are not in a collective are the ones that did not arrive. It
  posts a verdict naming them (phase, step, pid, host) and claims the job's failure record, so
  that no rank reports the fallout of the stop as an error of its own. Backends whose collectives
  do not block the CPU (NCCL: the wait is on the GPU stream, and the CPU blocks later, at the next
  ``.item()``) leave no rank "in a collective"; there, a rank that has made no progress past the
  deadline names the training ranks that are behind it (earlier batch or phase) and stalled too.
- **Every watchdog acts on the verdict** within a second: each process prints it; the stuck
  ranks' watchdogs print their own Python stacks with :mod:`faulthandler` (a thread can do that
  while the main thread sleeps or blocks in I/O; faulthandler reads no source file, so it works even
  when the stuck thing is the file system); then every process exits with status 1.

The deadline is ``max(watchdog_timeout, 20 x the slowest step seen on any rank)``, so a job of
fast steps is stopped about a minute after a hang while one whose steps take minutes is not
stopped by mistake, and it is always kept below the collective timeout (at most
``max(timeout / 2, timeout - 5 s)``), so the watchdog, which can name the culprit, speaks before
gloo's or NCCL's timeout, which cannot. Two limits, by design: waits that begin before a rank's
first batch (process-group setup, ``prepare_data`` downloading on one rank) are left to the
collective timeout; and work only some ranks do between two collectives (rank 0 writing a large
checkpoint for the first time) must fit in the deadline, or ``watchdog_timeout`` must be raised.

When a collective does time out, :meth:`Watchdog.explain_timeout` reads the same records, asks the
ranks that did not arrive to print their stacks, and the strategy raises :class:`CollectiveTimeout`
naming them instead of gloo's "Timed out waiting 1800000ms for recv". :meth:`Watchdog.abort` ends
the whole job the same way on request (a stop signal whose grace period ran out, see
``ember/trainer/preemption.py``).

Cost outside the step: per rank, one store write and one store read a second; a rank reads every
rank's record only once it has waited in a collective, or made no progress, past the deadline.

What the records say (who is missing, who is behind), the words of the verdicts, and the phases
the strategy sets are in ``verdicts.py``; printing a process's stacks, and exiting with them, is
``stacks.py``; this module holds the beacon, the thread and the store.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch.distributed as dist

from ember.strategies.launchers.launcher import FailureRecord
from ember.strategies.launchers.processes import end_children
from ember.strategies.watchdog.stacks import exit_with_stacks, print_stacks
from ember.strategies.watchdog.verdicts import (
    abort_summary,
    behind,
    behind_summary,
    deadline_detail,
    mismatch_summary,
    missing,
    missing_summary,
    timeout_summary,
)

__all__ = [
    "Beacon",
    "Watchdog",
    "CollectiveTimeout",
    "deadline",
    "collective_cap",
    "is_timeout",
    # From stacks.py, where they live; still importable from here (ember/trainer/preemption.py does).
    "print_stacks",
    "exit_with_stacks",
    "HUNG_EXIT_CODE",
    "STEP_FACTOR",
]

HUNG_EXIT_CODE = 1  # the status every process of a job stopped by the watchdog exits with
STEP_FACTOR = 20  # the deadline is at least this many times the slowest step seen
SAMPLE_S = 0.2  # how often the thread looks at the beacon
PUBLISH_EVERY = 5  # samples between two store round trips (once a second)
ANSWER_S = 5.0  # how long to wait for the named ranks to print their stacks
_generations = itertools.count()  # every rank starts its watchdogs in the same order
_STORE_GONE = getattr(dist, "DistError", RuntimeError)  # what a store whose host exited raises


class Beacon:
    """Where this rank is, written by the step path with plain attribute stores.

    Attributes:
        batches: batches started so far (training and evaluation).
        batch: index of the current batch in its loop.
        loop: "training", "validation", "test" or "predict".
        where: the phase, e.g. ``"training_step"``; read for the messages.
        waiting: the collective this rank is waiting in, or None.
        waits: collectives entered so far (tells one long wait from two short ones).
    """

    __slots__ = ("batches", "batch", "loop", "where", "waiting", "waits")

    def __init__(self) -> None:
        self.batches = 0
        self.batch = -1
        self.loop = "training"
        self.where = "setup"
        self.waiting: str | None = None
        self.waits = 0


class CollectiveTimeout(RuntimeError):
    """A collective timed out; the message names the ranks that did not arrive."""


def collective_cap(timeout: float) -> float:
    """The longest deadline the watchdog uses under a collective ``timeout``: it must speak first."""
    return max(timeout / 2, timeout - 5.0)


def deadline(floor: float, slowest_step: float, timeout: float) -> float:
    """Seconds one rank may keep the others waiting: ``max(floor, 20 x slowest step)``, under the cap."""
    return min(max(floor, STEP_FACTOR * slowest_step), collective_cap(timeout))


def is_timeout(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is a communication timeout."""
    while exc is not None:
        text = str(exc).lower()
        if "timed out" in text or "timeout" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class Watchdog:
    """Watches this rank's :class:`Beacon` and the others' records; acts on hangs (see module doc).

    Args:
        store: The job's store. A TCPStore gets a connection of its own for the thread.
        rank: This process's rank in the default group.
        world_size: Number of ranks.
        beacon: What the step path writes.
        floor: ``watchdog_timeout``: the smallest deadline in seconds, or None for no verdicts
            (records are still published, so a collective timeout can name the missing rank).
        timeout: The collective timeout in seconds.
        progress: Returns ``{"stage", "step", "epoch"}`` of the Trainer; called by the thread.
        run: Names this run's keys in the store. By default the number of watchdogs this process
            started before: every rank starts them in the same order (one per fit, validate...).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        beacon: Beacon,
        *,
        floor: float | None,
        timeout: float,
        progress: Callable[[], dict[str, Any]] = dict,
        run: str | None = None,
    ) -> None:
        self.rank, self.world_size, self.beacon = rank, world_size, beacon
        self.floor, self.timeout = floor, timeout
        self.progress = progress
        self.store = _own_connection(store)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"ember/watchdog/{restart}/{next(_generations) if run is None else run}"
        #: The longest gap between two batches seen on this rank, in seconds.
        self.slowest_step = 0.0
        self._others_slowest = 0.0  # the other ranks', as of the last time their records were read
        self._host = socket.gethostname()
        self._lock = threading.Lock()  # the store connection: the thread, and callers of explain/abort
        self._acting = threading.Lock()  # one verdict handled per process
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples = 0
        self._batches: int = 0  # last batch count
        self._batch_seen: float | None = None  # and when it changed
        self._wait_id: int | None = None  # `waits` of the wait being timed
        self._wait_since = 0.0
        self._wait_judged = False  # the wait began after this rank's first batch
        self._news = 0  # the store's news counter when last read
        self._requests = 0  # stack requests handled

    @property
    def deadline(self) -> float | None:
        """Seconds a rank may now keep this one waiting (None: no verdicts)."""
        if self.floor is None:
            return None
        return self._deadline(max(self.slowest_step, self._others_slowest))

    @property
    def running(self) -> bool:
        return self._thread is not None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._publish(time.monotonic())
        self._thread = threading.Thread(target=self._run, name="ember-ddp-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops and joins the thread, and marks this rank as gone from this run."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._thread = None
        now = time.monotonic()
        self._sample(now)  # the last steps, for slowest_step
        try:
            self._publish(now, state="finished")
        except Exception:
            pass  # the store went away with its host: nobody is left to read the record

    def _run(self) -> None:
        while not self._stopping.wait(SAMPLE_S):
            try:
                self.poll(time.monotonic())
            except (_STORE_GONE, OSError):
                # The store's host exited: the job is ending, and the launcher reports why.
                return
            except Exception as exc:  # a bug here must not take training down; say so once
                print(f"[ember ddp] rank {self.rank}: the hang watchdog stopped: {exc!r}", file=sys.stderr, flush=True)
                return

    # ------------------------------------------------------------------ one look
    def poll(self, now: float) -> None:
        """One sample of the beacon; every PUBLISH_EVERY samples, one store round trip and a judgement."""
        waited = self._sample(now)
        self._samples += 1
        if self._samples % PUBLISH_EVERY:
            return
        self._publish(now, waited)
        self._check_news()
        if self.floor is None:
            return
        if waited is not None:
            if self._wait_judged:
                self._judge(now, waited, in_collective=True)
        elif self._batch_seen is not None:
            self._judge(now, now - self._batch_seen, in_collective=False)

    def _sample(self, now: float) -> float | None:
        """Updates the slowest step; returns how long the current wait has lasted (None: not waiting)."""
        b = self.beacon
        batches = b.batches
        if batches != self._batches:
            if self._batch_seen is not None:
                # An upper bound of the longest step in between (to one sample).
                self.slowest_step = max(self.slowest_step, now - self._batch_seen)
            self._batches, self._batch_seen = batches, now
        waits, waiting = b.waits, b.waiting
        if waiting is None:
            self._wait_id = None
            return None
        if waits != self._wait_id:
            self._wait_id, self._wait_since, self._wait_judged = waits, now, batches > 0
        return now - self._wait_since

    def _record(self, now: float, waited: float | None, state: str = "running") -> dict[str, Any]:
        b = self.beacon
        try:
            info = dict(self.progress())
        except Exception:
            info = {}
        seen = self._batch_seen
        return {
            **info,
            "state": state,
            "batches": b.batches,
            "batch": b.batch,
            "loop": b.loop,
            "where": b.where,
            "waiting": b.waiting,
            "waited": round(waited or 0.0, 1),
            "stalled": round(now - seen, 1) if seen is not None else 0.0,
            "slowest": round(self.slowest_step, 2),
            "pid": os.getpid(),
            "host": self._host,
        }

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/rank{rank}"

    def _publish(self, now: float, waited: float | None = None, state: str = "running") -> None:
        record = self._record(now, waited, state)
        with self._lock:
            self.store.set(self._key(self.rank), json.dumps(record))

    def _records(self, now: float | None = None) -> dict[int, dict[str, Any] | None]:
        keys = [self._key(r) for r in range(self.world_size)]
        with self._lock:
            if self.store.check(keys):
                values: list[Any] = list(self.store.multi_get(keys))
            else:
                values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        records = {r: json.loads(v) if v is not None else None for r, v in enumerate(values)}
        # (the sampling state belongs to the thread: read, not updated)
        records[self.rank] = self._record(time.monotonic() if now is None else now, None)
        return records

    # ------------------------------------------------------------------ judgement
    def _deadline(self, slowest: float) -> float:
        return deadline(self.floor if self.floor is not None else float("inf"), slowest, self.timeout)

    def _judge(self, now: float, waited: float, in_collective: bool) -> None:
        """``waited``: how long this rank has waited in a collective (``in_collective``), or has
        made no progress."""
        if waited < self._deadline(self.slowest_step):
            return
        records = self._records(now)
        self._others_slowest = max([0.0] + [r["slowest"] for r in records.values() if r])
        slowest = max(self.slowest_step, self._others_slowest)
        limit = self._deadline(slowest)
        mine = records[self.rank]
        assert mine is not None  # this rank published its record before reading them
        if waited < limit or bool(mine["waiting"]) != in_collective:
            return
        absent, elsewhere = missing(records, self.rank) if in_collective else ([], [])
        if not in_collective:
            dump = behind(records, self.rank, limit)
            if not dump:
                return  # nobody is behind this rank: if it is stuck, the ranks waiting for it say so
            summary = behind_summary(records, dump, self.rank, waited)
        elif absent:
            summary, dump = missing_summary(records, absent, self.rank, waited), absent
        elif elsewhere:
            summary, dump = mismatch_summary(records), list(range(self.world_size))
        else:  # every rank waits in the same collective: the communication itself is slow or broken,
            return  # which the collective timeout decides
        detail = deadline_detail(limit, self.floor, slowest, self.timeout, STEP_FACTOR)
        self._act(
            self._post(
                {
                    "summary": "stopping the job: " + summary,
                    "detail": detail,
                    "dump": dump,
                    "exit": HUNG_EXIT_CODE,
                    "by": self.rank,
                }
            )
        )

    # ------------------------------------------------------------------ the store's news
    # Posters write first and then bump "news"; each watchdog reads one counter a second and only
    # looks further when it moved. A verdict (first one wins) ends the job; a request only asks
    # the named ranks for their stacks (a collective timed out: the waiting rank raises).
    def _k(self, what: str) -> str:
        return f"{self.prefix}/{what}"

    def _count(self, what: str, add: int = 0) -> int:
        with self._lock:
            return self.store.add(self._k(what), add)

    def _check_news(self) -> None:
        news = self._count("news")
        if news == self._news:
            return
        self._news = news
        if self._count("verdict/count"):
            with self._lock:
                verdict = json.loads(self.store.get(self._k("verdict")))
            self._act(verdict)
        requests = self._count("request/count")
        while self._requests < requests:
            self._requests += 1
            with self._lock:
                request = json.loads(self.store.get(self._k(f"request/{self._requests}")))
            if self.rank in request["dump"]:
                print_stacks(
                    f"[ember ddp] rank {self.rank}: {request['summary']}\n[ember ddp] rank "
                    f"{self.rank}: Python stack (pid {os.getpid()} on {self._host}):"
                )
                self._count(f"request/{self._requests}/answered", 1)

    def _post(self, verdict: dict[str, Any]) -> dict[str, Any]:
        """Posts ``verdict`` unless one is already posted; returns the one that stands."""
        with self._lock:
            if self.store.add(self._k("verdict/count"), 1) != 1:
                return json.loads(self.store.get(self._k("verdict")))  # its poster sets it right after counting
            self.store.set(self._k("verdict"), json.dumps(verdict))
            FailureRecord(self.store).claim(f"rank {self.rank} (watchdog): {verdict['summary']}")
            self.store.add(self._k("news"), 1)
        return verdict

    def _request_stacks(self, summary: str, ranks: list[int]) -> None:
        """Asks ``ranks`` to print their stacks under ``summary``; waits up to ANSWER_S for them."""
        with self._lock:
            n = self.store.add(self._k("request/count"), 1)
            self.store.set(self._k(f"request/{n}"), json.dumps({"summary": summary, "dump": ranks}))
            self.store.add(self._k("news"), 1)
        self._await(f"request/{n}/answered", len(ranks))

    def _await(self, counter: str, expected: int) -> None:
        until = time.monotonic() + ANSWER_S
        while self._count(counter) < expected and time.monotonic() < until:
            time.sleep(0.05)
        if self._count(counter) < expected:
            print(
                f"[ember ddp] rank {self.rank}: not every named rank printed its stack within "
                f"{ANSWER_S:.0f} s. A process whose threads cannot run (C code holding the GIL), or "
                "that is gone, cannot; `py-spy dump --pid <pid>` on its host shows where it is.",
                file=sys.stderr,
                flush=True,
            )

    def _act(self, verdict: dict[str, Any]) -> NoReturn:
        """Prints the verdict (and this rank's stack if it is named), then ends the process."""
        self._acting.acquire()  # a second thread with the same verdict waits here until the exit
        me = self.rank
        text = f"[ember ddp] rank {me}: {verdict['summary']}"
        if me == verdict["by"] and verdict.get("detail"):
            text += f"\n[ember ddp] {verdict['detail']}"
        try:
            if me in verdict["dump"]:
                print_stacks(f"{text}\n[ember ddp] rank {me}: Python stack (pid {os.getpid()} on {self._host}):")
                self._count("verdict/answered", 1)
            else:
                print(text, file=sys.stderr, flush=True)
            if me == verdict["by"]:
                self._await("verdict/answered", len(verdict["dump"]))
            else:
                until = time.monotonic() + ANSWER_S
                while self._count("verdict/answered") < len(verdict["dump"]) and time.monotonic() < until:
                    time.sleep(0.05)
            # Leave together: the host of the store, or a rank that left early, would otherwise turn
            # into a "connection closed" error on the ranks still printing.
            self._count("verdict/left", 1)
            until = time.monotonic() + 2.0
            while self._count("verdict/left") < self.world_size and time.monotonic() < until:
                time.sleep(0.05)
        except Exception:
            pass  # the store went away with a rank that already left: leave too
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        end_children()  # this rank's loader workers (and the ranks this process started)
        os._exit(verdict["exit"])

    # ------------------------------------------------------------------ for the strategy
    def explain_timeout(self, what: str) -> str:
        """After ``what`` timed out here: who did not arrive (they print their stacks); never raises."""
        try:
            records = self._records()
            absent, _ = missing(records, self.rank)
            summary = timeout_summary(records, absent, self.rank, what, self.timeout)
            if absent:
                self._request_stacks(summary, absent)
            return summary
        except Exception as exc:
            return (
                f"{what} timed out on rank {self.rank} after {self.timeout:g} s, waiting for another "
                f"rank (which one could not be read from the job's store: {exc})."
            )

    def abort(self, message: str, code: int) -> NoReturn:
        """Ends the whole job now with status ``code``. Every rank prints ``message`` with where the
        ranks are; this rank and the ranks not in a collective print their stacks."""
        try:
            records = self._records()
            named = sorted({self.rank, *missing(records, self.rank)[0]})
            summary = abort_summary(records, named, self.rank, message, self.world_size)
            verdict = self._post({"summary": summary, "dump": named, "exit": code, "by": self.rank})
        except Exception:
            exit_with_stacks(f"[ember ddp] rank {self.rank} {message}", code)
        self._act(verdict)


def _own_connection(store: dist.Store) -> dist.Store:
    """A connection of the thread's own to a TCPStore (none of its calls then waits behind the main
    thread's, e.g. a rendezvous); other stores are shared as they are."""
    if isinstance(store, dist.TCPStore):
        try:
            return dist.TCPStore(
                store.host, store.port, None, False, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
            )
        except Exception:
            pass
    return store
