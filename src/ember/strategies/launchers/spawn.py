"""The ``ddp_spawn`` launcher: the caller starts every rank with multiprocessing spawn.

:class:`SpawnLauncher` (for notebooks, ``start_method="spawn"``) pickles the function to run,
starts ``N`` workers that join a job whose store lives in the caller, and returns rank 0's result.
A failing rank's exception is re-raised in the caller with the worker's traceback attached as a
:class:`RemoteTraceback`. How jobs rendezvous and report failures is ``launcher.py``'s.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ember.strategies.launchers.exits import describe_exit, exit_status
from ember.strategies.launchers.interrupt import GRACE_S, end_quietly, say_interrupted
from ember.strategies.launchers.launcher import (
    HOSTED_ENV,
    PARENT_ENV,
    PEERS_EXIT_S,
    FailureRecord,
    classify_failure,
    destroy_group,
    is_peer_failure,
    local_env,
    loopback_store,
)
from ember.strategies.launchers.processes import die_with_parent, stop_processes

__all__ = ["SpawnLauncher", "RemoteTraceback"]


class RemoteTraceback(Exception):
    """A worker's traceback, attached as the cause of the error re-raised in the caller."""

    def __str__(self) -> str:
        return self.args[0]


class SpawnLauncher:
    """The caller starts every rank with multiprocessing spawn and gets rank 0's return value.

    ``fn`` and its arguments are pickled (the standard streams travel as references to the
    worker's own). A failing rank's exception is re-raised here, with the rank noted and the
    worker's traceback as its cause; the other workers are stopped first. A rank that exits on
    purpose (``SystemExit``: a preempted run's 143) is not a failure: once the others have ended
    too, its ``SystemExit`` is re-raised here, so the caller exits with the same status.

    While the workers run, the stop signals this process receives are passed on to them, so that
    a SIGTERM sent to the caller alone (or to the whole process group: workers die with their
    parent) still lets them reach a step boundary and write ``last.ckpt``. If the job then ends
    with an error instead, the signal is raised again here, with the caller's own handler back.

    Args:
        num_processes: Number of ranks.
        timeout: Collective and rendezvous timeout.
        dumps: Serialises ``(fn, args, kwargs)`` for the workers.
        loads: Its inverse, run in each worker (a module-level function).
        forward_signals: Signals passed on to the workers; None: SIGTERM, plus SIGUSR1 under SLURM
            (the Trainer's default preemption signals).
    """

    def __init__(
        self,
        num_processes: int,
        timeout: datetime.timedelta,
        dumps: Callable[[Any], bytes] = pickle.dumps,
        loads: Callable[[bytes], Any] = pickle.loads,
        forward_signals: tuple[int, ...] | None = None,
    ) -> None:
        self.num_processes, self.timeout = num_processes, timeout
        self.dumps, self.loads = dumps, loads
        if forward_signals is None:
            slurm = "SLURM_JOB_ID" in os.environ and hasattr(signal, "SIGUSR1")
            forward_signals = (signal.SIGTERM, signal.SIGUSR1) if slurm else (signal.SIGTERM,)
        self.forward_signals = tuple(forward_signals)

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if main_file is not None and not os.path.exists(main_file):
            # The spawned workers re-run the main module from its file; each would die at start-up.
            raise RuntimeError(
                f"ddp_spawn starts each rank by re-importing the main module from its file, and "
                f"{main_file!r} is not a file (a script read from stdin?). Save the script to a "
                f"file and run that."
            )
        payload = self.dumps((fn, args, kwargs))
        store = loopback_store(self.timeout)
        env = {**local_env(self.num_processes, store.port), HOSTED_ENV: "1"}
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=_spawn_worker,
                name=f"ember-ddp-rank{rank}",
                args=(rank, env, self.timeout.total_seconds(), payload, self.loads, results),
            )
            for rank in range(self.num_processes)
        ]
        received: list[int] = []
        record = FailureRecord(store)

        def forward(signum: int, frame: Any) -> None:
            received.append(signum)
            for proc in procs:
                if proc.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signum)

        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, forward) for sig in self.forward_signals}
        try:
            for proc in procs:
                proc.start()
            if received:  # arrived while they were starting
                forward(received[0], None)
            return pickle.loads(self._collect(procs, results, record)[0])
        except KeyboardInterrupt as exc:  # Ctrl-C (``interrupt.py``): here, or on a worker (``_collect``)
            record.interrupt()
            say_interrupted()
            _let_workers_end(procs)
            end_quietly(exc)
            raise
        finally:
            stop_processes([p for p in procs if p.pid is not None])
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            results.close()
            results.join_thread()
            del store
            leaving = sys.exc_info()[1]
            if received and leaving is not None and not isinstance(leaving, SystemExit):
                signal.raise_signal(received[0])  # the workers could not stop on it: act on it here

    def _collect(self, procs: list, results: Any, record: FailureRecord) -> dict[int, bytes]:
        done: dict[int, bytes] = {}
        exits: dict[int, BaseException] = {}  # ranks that raised SystemExit (preemption)
        seen: set[int] = set()  # ranks known to have failed
        give_up = None  # once a failure is known, how long to wait for the original report
        exits_by = None  # once a rank exited, how long the others get to end too
        while len(done) + len(exits) < len(procs):
            if exits_by is not None and time.monotonic() > exits_by:
                break
            if give_up is not None and time.monotonic() > give_up:
                # The job's recorded cause (the watchdog's verdict, say) rather than only who ended.
                cause = (record.wait(0) or f"ranks {sorted(seen)} failed").rstrip(".")
                raise RuntimeError(f"[ember ddp] {cause}; the job was stopped.")
            try:
                kind, rank, *rest = results.get(timeout=0.1)
            except queue.Empty:
                kind = None
            if kind is None:
                for rank, proc in enumerate(procs):
                    if rank in done or rank in exits or rank in seen or proc.exitcode in (None, 0):
                        continue
                    if record.interrupted():  # Ctrl-C reached that worker: the job ends as on Ctrl-C here
                        raise KeyboardInterrupt
                    seen.add(rank)
                    give_up = give_up or time.monotonic() + 5.0
                    what = describe_exit(proc.exitcode)
                    if record.claim(f"rank {rank} {what}"):  # died without a word: it is the cause
                        raise RuntimeError(f"[ember ddp] rank {rank} {what}; the job was stopped.")
                continue
            if kind == "ok":
                done[rank] = rest[0]
                continue
            if kind == "interrupted":
                raise KeyboardInterrupt
            if kind == "exit":
                pickled, code = rest
                exits[rank] = _unpickle_error(pickled) or SystemExit(code)
                exits_by = exits_by or time.monotonic() + PEERS_EXIT_S
                continue
            pickled, text, remote_tb, original = rest
            if not original:  # stopped because a peer failed: wait for the peer's report
                seen.add(rank)
                give_up = give_up or time.monotonic() + 5.0
                continue
            error = _unpickle_error(pickled) or RuntimeError(f"rank {rank} raised {text}")
            if hasattr(error, "add_note"):
                error.add_note(f"[ember ddp] raised on rank {rank} of {len(procs)}.")
            raise error from RemoteTraceback(f"\n--- rank {rank} ---\n{remote_tb}")
        if exits:
            raise exits[min(exits)]  # rank 0's when it has one
        return done


def _spawn_worker(
    rank: int, env: dict[str, str], timeout: float, payload: bytes, loads: Callable[[bytes], Any], results: Any
) -> None:
    os.environ.update({**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
    die_with_parent(int(env[PARENT_ENV]))
    record = None
    try:
        store = dist.TCPStore(
            "127.0.0.1", int(env["MASTER_PORT"]), None, False, timeout=datetime.timedelta(seconds=timeout)
        )
        record = FailureRecord(store)
        fn, args, kwargs = loads(payload)
        value = pickle.dumps(fn(*args, **kwargs))
    except SystemExit as exc:  # on purpose (preemption: every rank stops at the same step)
        exit_code = exit_status(exc.code)
        try:
            pickled = pickle.dumps(exc)
        except Exception:
            pickled = None
        results.put(("exit", rank, pickled, exit_code))
    except BaseException as exc:
        if _ends_on_ctrl_c(exc, record):  # the caller says so, once for the job
            results.put(("interrupted", rank))
            exit_code = 130
        else:
            original = classify_failure(record, rank, exc)
            try:
                pickled = pickle.dumps(exc)
            except Exception:
                pickled = None
            # Frames only: the caller re-raises the exception itself, so its message shows once.
            frames = traceback.format_exc()
            message = "".join(traceback.format_exception_only(type(exc), exc))
            frames = frames[: -len(message)] if frames.endswith(message) else frames
            results.put(("error", rank, pickled, repr(exc), frames, original))
            exit_code = 1
    else:
        exit_code = 0
        results.put(("ok", rank, value))
    finally:
        destroy_group()
    if exit_code:
        sys.exit(exit_code)  # a failed rank ends with a non-zero status


def _ends_on_ctrl_c(exc: BaseException, record: FailureRecord | None) -> bool:
    """Whether ``exc`` ends this worker because of Ctrl-C, here or on a peer that has left (``interrupt.py``);
    recorded in the job's store if so."""
    if not isinstance(exc, KeyboardInterrupt) and not (
        is_peer_failure(exc) and record is not None and record.interrupted()
    ):
        return False
    if record is not None:
        record.interrupt()
    return True


def _let_workers_end(procs: list) -> None:
    """After Ctrl-C here: the workers got it too from a terminal, and end once their ``on_exception`` has run.
    Those still running after :data:`GRACE_S` (Ctrl-C reached this process alone) get it from here."""
    for forward in (True, False):
        deadline = time.monotonic() + GRACE_S
        while any(p.exitcode is None for p in procs if p.pid is not None) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not forward:
            return
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGINT)


def _unpickle_error(pickled: bytes | None) -> BaseException | None:
    try:
        error = pickle.loads(pickled) if pickled is not None else None
    except Exception:
        return None
    return error if isinstance(error, BaseException) else None
