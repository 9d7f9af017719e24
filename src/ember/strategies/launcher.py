"""How the processes of a ddp job come to exist, find each other, and stop together.

Three ways in:

- **Joining a world** somebody else started: ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``; any number of nodes), SLURM (``SLURM_PROCID``,
  ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``, the first host of ``SLURM_NODELIST``), or a
  process ember itself started.
- **Re-running the script** (``start_method="popen"``): ``python train.py`` with ``devices=N``
  becomes rank 0 and starts ``N - 1`` copies of the same command line with the rank in the
  environment.
- **Spawning** (``start_method="spawn"``, for notebooks): the caller starts ``N`` workers with
  multiprocessing spawn and gets rank 0's result back.

Single-machine launches rendezvous on 127.0.0.1 only, through a socket bound before anything
starts (no port race). Failures: the first rank to fail records itself in the job's store;
ranks that then fail only because a peer vanished see that record and exit quietly, so the
original error is printed once, with its rank. A rank that ends without a Python traceback
(``os._exit(3)``, the OOM killer, a segfault) is recorded and named by whoever started it ("rank 1
exited with status 3", "rank 1 was killed by signal 9 (SIGKILL)"). Children die with their parent
(``PR_SET_PDEATHSIG``) and are stopped (SIGTERM, then SIGKILL) when the job fails, so nothing
outlives the job by more than a few seconds.

Exit status of the process that started the job (what a scheduler reads), from
:func:`job_status`: 1 when a rank failed; ``128 + N`` when the ranks stopped on signal N rather
than failed (a preempted run exits 143 on every rank after writing ``last.ckpt``, see
``ember/trainer/preemption.py``); 0 otherwise. A rank the launcher itself stopped does not count.
Ctrl-C ends the launching process as Python ends any script on an uncaught
``KeyboardInterrupt``: killed by SIGINT, which a shell reports as 130.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import gc
import multiprocessing
import os
import pickle
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["World", "detect_world", "Launcher", "PopenLauncher", "SpawnLauncher", "loopback_store",
           "FailureRecord", "die_with_parent", "stop_processes", "is_peer_failure", "describe_exit",
           "job_status"]

_job_store: dist.Store | None = None  # this process's job store, once it has joined a job
PARENT_ENV = "EMBER_DDP_PARENT_PID"  # set in processes ember starts: they die with that parent
HOSTED_ENV = "EMBER_DDP_STORE_HOSTED"  # the store lives in the spawning process, not in rank 0
_STOP_GRACE_S = 2.0
_PEERS_EXIT_S = 10.0  # how long a rank that exits on purpose (preemption) waits for the others to
                      # exit too, before stopping them: they stop at the same step, so normally ms


@dataclass(frozen=True)
class World:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "ember"


def detect_world(env: dict[str, str] | None = None) -> World | None:
    """The world this process was started into, or None for a plain ``python script.py``."""
    env = dict(os.environ if env is None else env)
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
        return World(rank, world, local, int(env.get("LOCAL_WORLD_SIZE", world)),
                     int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))), env["MASTER_ADDR"],
                     int(env["MASTER_PORT"]), "ember" if PARENT_ENV in env else "torchrun")
    ntasks = int(env.get("SLURM_NTASKS", "1") or 1)
    if "SLURM_PROCID" in env and ntasks > 1 and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        per_node = re.match(r"\d+", env.get("SLURM_NTASKS_PER_NODE", "") or "")
        job = int(re.sub(r"\D", "", env.get("SLURM_JOB_ID", "0")) or 0)
        return World(int(env["SLURM_PROCID"]), ntasks, int(env.get("SLURM_LOCALID", 0)),
                     int(per_node.group()) if per_node else ntasks, int(env.get("SLURM_NODEID", 0)),
                     env.get("MASTER_ADDR") or first_host(env.get("SLURM_NODELIST", "127.0.0.1")),
                     int(env.get("MASTER_PORT") or 15000 + job % 20000), "slurm")
    return None


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``"gpu[03-05,9],cpu1"`` (-> ``"gpu03"``)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return "127.0.0.1"
    prefix, ranges = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def loopback_store(timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore listening on 127.0.0.1 only, on a port it already holds (``store.port``)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, None, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def local_env(world_size: int, port: int) -> dict[str, str]:
    """Environment of a single-machine job ember starts (rank variables added per process)."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "NODE_RANK": "0",
           PARENT_ENV: str(os.getpid())}
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own sockets on loopback too
    return env


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when ``parent_pid`` exits (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def stop_processes(procs: list[Any], grace: float = _STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL what still runs after ``grace`` seconds; reap all (Popen or Process)."""
    def poll(p: Any) -> int | None:
        return p.poll() if isinstance(p, subprocess.Popen) else p.exitcode

    alive = [p for p in procs if poll(p) is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
        deadline = time.monotonic() + grace
        while any(poll(p) is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.02)
        alive = [p for p in alive if poll(p) is None]
    for p in procs:
        p.wait() if isinstance(p, subprocess.Popen) else p.join()


def describe_exit(code: int) -> str:
    """An exit status in words: "exited with status 3", "was killed by signal 9 (SIGKILL)"."""
    return f"exited with status {code}" if code >= 0 else f"was killed by {_signal_name(-code)}"


def _signal_name(signum: int) -> str:
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


def _exit_status(code: Any) -> int:
    # What Python exits with for SystemExit(code).
    return 0 if code is None else code if isinstance(code, int) else 1


_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
               "Socket Timeout", "NCCL communicator was aborted", "failed to recv", "ECONNRESET")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like the consequence of another rank failing."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, getattr(dist, "DistError", ())) or \
                any(s in str(cause) for s in _PEER_SIGNS):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


class FailureRecord:
    """The job's first failure, kept in its store so every rank agrees who failed first."""

    def __init__(self, store: dist.Store) -> None:
        # Under torchrun the store outlives a restart: keep each attempt's record apart.
        self.store = store
        self.prefix = f"ember/failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def claim(self, summary: str) -> bool:
        """Records ``summary`` if no failure is recorded yet; returns whether it was first."""
        if self.store.add(self.prefix + "/count", 1) != 1:
            return False
        self.store.set(self.prefix + "/summary", summary)
        return True

    def wait(self, timeout: float) -> str | None:
        """The recorded failure, waiting up to ``timeout`` seconds for one to appear."""
        deadline = time.monotonic() + timeout
        while True:
            if self.store.check([self.prefix + "/summary"]):
                return self.store.get(self.prefix + "/summary").decode()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def classify_failure(record: FailureRecord | None, rank: int, exc: BaseException) -> bool:
    """Whether ``exc`` on ``rank`` is the job's original failure (else a consequence of one)."""
    if record is None:
        return True
    try:
        if is_peer_failure(exc) and record.wait(timeout=3.0) is not None:
            return False  # a peer failed first; this rank only noticed
        return record.claim(f"rank {rank}: {type(exc).__name__}: {exc}")
    except Exception:  # the store is gone with its host: nobody else can say, so speak up
        return True


class Launcher:
    """Runs this process's part of a job whose processes already exist (torchrun, SLURM, ember).

    Args:
        world: Where this process sits.
        timeout: Collective and rendezvous timeout.
        store: A store already created for the job (rank 0 of a job ember started).
    """

    def __init__(self, world: World, timeout: datetime.timedelta,
                 store: dist.Store | None = None) -> None:
        self.world, self.timeout = world, timeout
        self.store = store or _job_store  # a later Trainer in the same job reuses the first's
        self.record = FailureRecord(self.store) if self.store is not None else None
        if world.source == "ember" and PARENT_ENV in os.environ and world.rank != 0:
            die_with_parent(int(os.environ[PARENT_ENV]))

    def init_process_group(self, backend: str) -> None:
        """Joins the job's process group (once per process)."""
        if dist.is_initialized():
            return
        if self.store is None:
            w = self.world
            # Under torchrun the agent hosts the store at MASTER_PORT; otherwise rank 0 does.
            hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" or \
                HOSTED_ENV in os.environ
            self.store = dist.TCPStore(w.master_addr, w.master_port, None, w.rank == 0 and not hosted,
                                       timeout=self.timeout, wait_for_workers=False)
        dist.init_process_group(backend, store=self.store, rank=self.world.rank,
                                world_size=self.world.world_size, timeout=self.timeout)
        # Left to interpreter shutdown, the group's threads can abort the process ("terminate
        # called without an active exception") after a perfectly good run.
        atexit.register(_destroy_group)
        global _job_store
        _job_store = self.store
        self.record = FailureRecord(self.store)

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn`` here; a failure is reported once for the whole job (see module doc)."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            original = classify_failure(self.record, self.world.rank, exc)
            self.on_failure()
            if not original:
                status = self.job_status(None)
                why = "failed" if status == 1 else f"stopped on {_signal_name(status - 128)}"
                print(f"[ember ddp] rank {self.world.rank}: stopping because another rank {why}.",
                      file=sys.stderr, flush=True)
                raise SystemExit(status) from None
            note = f"[ember ddp] raised on rank {self.world.rank} of {self.world.world_size}."
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            else:
                print(note, file=sys.stderr, flush=True)
            raise
        except SystemExit as exc:  # e.g. preemption (143): every rank stops at the same step
            self.on_failure(grace=_PEERS_EXIT_S)
            own = _exit_status(exc.code)
            if self.job_status(own) != own:  # another rank failed meanwhile: that wins
                raise SystemExit(self.job_status(own)) from None
            raise
        except BaseException:  # Ctrl-C: not a failure to report
            self.on_failure()
            raise

    def on_failure(self, grace: float = 0.0) -> None:
        """Hook for launchers that own other processes: stop them, after ``grace`` seconds in
        which they may end on their own."""

    def job_status(self, own: int | None) -> int:
        """The job's exit status given this rank's (None: it only noticed another rank fail)."""
        return 1 if own is None else own


def _destroy_group() -> None:
    # Cycles (module <-> trainer, ...) can hold the group; freed by the interpreter's last
    # collection, gloo's threads would need the GIL after it is gone and abort the process.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


class PopenLauncher(Launcher):
    """Rank 0 of ``python script.py``: re-runs the same command line for ranks 1..N-1.

    Args:
        num_processes: Number of ranks on this machine.
        timeout: Collective and rendezvous timeout.

    Raises:
        RuntimeError: When there is no script to re-run (an interactive session).
    """

    def __init__(self, num_processes: int, timeout: datetime.timedelta) -> None:
        command = rerun_command()
        store = loopback_store(timeout)
        env = local_env(num_processes, store.port)
        self.children: list[subprocess.Popen] = []
        for rank in range(1, num_processes):
            child_env = {**os.environ, **env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            self.children.append(subprocess.Popen(command, env=child_env))
        os.environ.update({**env, "RANK": "0", "LOCAL_RANK": "0"})  # later Trainers join this job
        super().__init__(World(0, num_processes, 0, num_processes, 0, "127.0.0.1", store.port,
                               "ember"), timeout, store)
        self._stopping = False
        # Statuses the children ended with on their own, taken when this process stops the rest
        # (None: still running then, so whatever they end with is the launcher's doing).
        self._ended: list[int | None] | None = None
        self._monitor = threading.Thread(target=self._watch, name="ember-ddp-monitor", daemon=True)
        self._monitor.start()
        atexit.register(self.finish)

    def _watch(self) -> None:
        # A child that ends without a traceback prints nothing: say which one and how, once, and
        # stop the job if this process does not notice by itself.
        while not self._stopping:
            for rank, child in enumerate(self.children, start=1):
                code = child.poll()
                if code is None or code == 0 or self._stopping:
                    continue
                self._report(rank, code)
                deadline = time.monotonic() + 3.0  # let the main thread notice and stop cleanly
                while not self._stopping and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not self._stopping:
                    self.on_failure()
                    _exit(self.job_status(None))
                return
            time.sleep(0.05)

    def _report(self, rank: int, code: int) -> None:
        if code > 0 and stop_signal(code) is not None:
            return  # it stopped on a signal (preemption): this process stops at the same step
        what = describe_exit(code)
        # Claimed even when Python already printed why (an uncaught exception before the rank
        # joined the job, Ctrl-C), so that ranks which merely lose their peer stay quiet.
        claimed = self.record.claim(f"rank {rank} {what}") if self.record is not None else True
        if claimed and code != -signal.SIGINT:
            print(f"[ember ddp] rank {rank} {what}; stopping the job.", file=sys.stderr, flush=True)

    def on_failure(self, grace: float = 0.0) -> None:
        self._stopping = True
        deadline = time.monotonic() + grace
        while any(c.poll() is None for c in self.children) and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._ended is None:
            self._ended = [c.poll() for c in self.children]
        stop_processes(self.children)

    def job_status(self, own: int | None) -> int:
        ended = self._ended if self._ended is not None else [c.poll() for c in self.children]
        status = job_status([own, *ended])
        return status or (1 if own is None else 0)  # None: some rank failed, even if unseen here

    def finish(self) -> None:
        """At exit: wait for the other ranks to finish their copy of the script, then end with
        the job's status unless :meth:`launch` already chose it."""
        for child in self.children:
            child.wait()
        self._stopping = True
        _destroy_group()
        if self._ended is None:
            status = job_status(c.returncode for c in self.children)
            if status:
                _exit(status)


def _exit(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def rerun_command() -> list[str]:
    """The command line that started this process, to start it again for another rank."""
    main = sys.modules.get("__main__")
    interactive = hasattr(sys, "ps1") or main is None or (
        not getattr(main, "__file__", None) and getattr(main, "__spec__", None) is None
        and "-c" not in getattr(sys, "orig_argv", []))
    if interactive:
        raise RuntimeError(
            "strategy='ddp' starts the other ranks by running your script again, but this is an "
            "interactive session (REPL or notebook) with no script to run. Use "
            "strategy='ddp_spawn' here, or put the training code in a script and run it.")
    if hasattr(sys, "orig_argv"):
        return [sys.executable, *sys.orig_argv[1:]]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name != "__main__":
        return [sys.executable, "-m", spec.name, *sys.argv[1:]]
    return [sys.executable, *sys.argv]


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

    def __init__(self, num_processes: int, timeout: datetime.timedelta,
                 dumps: Callable[[Any], bytes] = pickle.dumps,
                 loads: Callable[[bytes], Any] = pickle.loads,
                 forward_signals: tuple[int, ...] | None = None) -> None:
        self.num_processes, self.timeout = num_processes, timeout
        self.dumps, self.loads = dumps, loads
        if forward_signals is None:
            slurm = "SLURM_JOB_ID" in os.environ and hasattr(signal, "SIGUSR1")
            forward_signals = (signal.SIGTERM, signal.SIGUSR1) if slurm else (signal.SIGTERM,)
        self.forward_signals = tuple(forward_signals)

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        payload = self.dumps((fn, args, kwargs))
        store = loopback_store(self.timeout)
        env = {**local_env(self.num_processes, store.port), HOSTED_ENV: "1"}
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_spawn_worker, name=f"ember-ddp-rank{rank}",
                             args=(rank, env, self.timeout.total_seconds(), payload, self.loads,
                                   results))
                 for rank in range(self.num_processes)]
        received: list[int] = []

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
            return pickle.loads(self._collect(procs, results, FailureRecord(store))[0])
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
                    seen.add(rank)
                    give_up = give_up or time.monotonic() + 5.0
                    what = describe_exit(proc.exitcode)
                    if record.claim(f"rank {rank} {what}"):  # died without a word: it is the cause
                        raise RuntimeError(f"[ember ddp] rank {rank} {what}; the job was stopped.")
                continue
            if kind == "ok":
                done[rank] = rest[0]
                continue
            if kind == "exit":
                pickled, code = rest
                exits[rank] = _unpickle_error(pickled) or SystemExit(code)
                exits_by = exits_by or time.monotonic() + _PEERS_EXIT_S
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


def _spawn_worker(rank: int, env: dict[str, str], timeout: float, payload: bytes,
                  loads: Callable[[bytes], Any], results: Any) -> None:
    os.environ.update({**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
    die_with_parent(int(env[PARENT_ENV]))
    record = None
    try:
        store = dist.TCPStore("127.0.0.1", int(env["MASTER_PORT"]), None, False,
                              timeout=datetime.timedelta(seconds=timeout))
        record = FailureRecord(store)
        fn, args, kwargs = loads(payload)
        value = pickle.dumps(fn(*args, **kwargs))
    except SystemExit as exc:  # on purpose (preemption: every rank stops at the same step)
        exit_code = _exit_status(exc.code)
        try:
            pickled = pickle.dumps(exc)
        except Exception:
            pickled = None
        results.put(("exit", rank, pickled, exit_code))
    except BaseException as exc:
        original = classify_failure(record, rank, exc)
        try:
            pickled = pickle.dumps(exc)
        except Exception:
            pickled = None
        # Frames only: the caller re-raises the exception itself, so its message shows once.
        frames = traceback.format_exc()
        message = "".join(traceback.format_exception_only(type(exc), exc))
        frames = frames[:-len(message)] if frames.endswith(message) else frames
        results.put(("error", rank, pickled, repr(exc), frames, original))
        exit_code = 1
    else:
        exit_code = 0
        results.put(("ok", rank, value))
    finally:
        _destroy_group()
    if exit_code:
        sys.exit(exit_code)  # a failed rank ends with a non-zero status


def _unpickle_error(pickled: bytes | None) -> BaseException | None:
    try:
        error = pickle.loads(pickled) if pickled is not None else None
    except Exception:
        return None
    return error if isinstance(error, BaseException) else None
