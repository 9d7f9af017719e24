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
  multiprocessing spawn and gets rank 0's result back (``spawn.py``, built on the pieces here).

Single-machine launches rendezvous on 127.0.0.1 only, through a socket bound before anything
starts (no port race). Failures: the first rank to fail records itself in the job's store;
ranks that then fail only because a peer vanished see that record and exit quietly, so the
original error is printed once, with its rank. A rank that ends without a Python traceback
(``os._exit(3)``, the OOM killer, a segfault) is recorded and named by whoever started it ("rank 1
exited with status 3", "rank 1 was killed by signal 9 (SIGKILL)"). Children die with their parent
(``PR_SET_PDEATHSIG``) and are stopped (SIGTERM, then SIGKILL) when the job fails, so nothing
outlives the job by more than the grace between the two signals; how, and what a forked child does
with the group's connections, is ``processes.py``.
Ctrl-C is not a failure: one line for the job, and no traceback from any rank (``interrupt.py``).

The exit status of the process that started the job (what a scheduler reads) is the job's, as
``exits.py`` computes it: 1 when a rank failed, ``128 + N`` when the ranks stopped on signal N.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ember.strategies.launchers.exits import describe_exit, exit_status, job_status, signal_name, stop_signal
from ember.strategies.launchers.interrupt import GRACE_S, end_quietly, say_interrupted
from ember.strategies.launchers.processes import (
    die_with_parent,
    exit_now,
    forget_group_sockets,
    record_group_sockets,
    socket_fds,
    stop_processes,
)
from ember.strategies.launchers.world import PARENT_ENV, World, detect_world, first_host

__all__ = [
    "World",
    "detect_world",
    "first_host",
    "PARENT_ENV",
    "Launcher",
    "PopenLauncher",
    "loopback_store",
    "local_env",
    "FailureRecord",
    "classify_failure",
    "is_peer_failure",
    "destroy_group",
    "import_before_the_group",
]

_job_store: dist.Store | None = None  # this process's job store, once it has joined a job


def job_store() -> dist.Store | None:
    """This process's job store, once it has joined a job ember launched (None before)."""
    return _job_store


HOSTED_ENV = "EMBER_DDP_STORE_HOSTED"  # the store lives in the spawning process, not in rank 0
PEERS_EXIT_S = 10.0  # how long a rank that exits on purpose (preemption) waits for the others to
# exit too, before stopping them (they stop at the same step, so most are exiting already)


def loopback_store(timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore listening on 127.0.0.1 only, on a port it already holds (``store.port``)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    return dist.TCPStore(
        "127.0.0.1", port, None, True, timeout=timeout, wait_for_workers=False, master_listen_fd=listener.detach()
    )


def local_env(world_size: int, port: int) -> dict[str, str]:
    """Environment of a single-machine job ember starts (rank variables added per process)."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "NODE_RANK": "0",
        PARENT_ENV: str(os.getpid()),
    }
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own sockets on loopback too
    return env


_PEER_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
    "NCCL communicator was aborted",
    "failed to recv",
    "ECONNRESET",
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like the consequence of another rank failing."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, getattr(dist, "DistError", ())) or any(s in str(cause) for s in _PEER_SIGNS):
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

    def interrupt(self) -> None:
        """Records that Ctrl-C reached a rank: a peer whose collective then fails ends quietly too."""
        try:
            self.store.set(self.prefix + "/interrupted", "1")
        except Exception:  # noqa: BLE001 - the store's host is gone: nobody is left to tell
            return

    def interrupted(self) -> bool:
        """Whether Ctrl-C reached some rank of the job (see :meth:`interrupt`)."""
        try:
            return self.store.check([self.prefix + "/interrupted"])
        except Exception:  # noqa: BLE001 - the store's host is gone: cannot say
            return False

    def wait(self, timeout: float) -> str | None:
        """The recorded failure, waiting up to ``timeout`` seconds for one to appear (not at all once a
        stop signal has arrived: see :func:`note_stop_signal`)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.store.check([self.prefix + "/summary"]):
                return self.store.get(self.prefix + "/summary").decode()
            if time.monotonic() > deadline or _stop_signal is not None:
                return None
            time.sleep(0.05)


_stop_signal: int | None = None


def note_stop_signal(signum: int) -> None:
    """Called when a stop signal reaches this process. Under torchrun it is the agent stopping the job
    because a process ended; a rank that raised has recorded its failure before it ended, so a record
    that is not there yet never comes (a rank killed by SIGKILL writes none): waiting for one only
    delays the restart."""
    global _stop_signal
    _stop_signal = signum


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

    def __init__(self, world: World, timeout: datetime.timedelta, store: dist.Store | None = None) -> None:
        self.world, self.timeout = world, timeout
        self.store = store or _job_store  # a later Trainer in the same job reuses the first's
        self.record = FailureRecord(self.store) if self.store is not None else None
        if world.source == "ember" and PARENT_ENV in os.environ and world.rank != 0:
            die_with_parent(int(os.environ[PARENT_ENV]))

    def init_process_group(self, backend: str, device: torch.device | None = None) -> None:
        """Joins the job's process group (once per process).

        Args:
            backend: "gloo" or "nccl".
            device: This rank's CUDA device, bound to the group at creation so that NCCL never
                guesses one from the rank; None on CPU.
        """
        if dist.is_initialized():
            return
        if self.store is None:
            w = self.world
            # Under torchrun the agent hosts the store at MASTER_PORT; otherwise rank 0 does.
            hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" or HOSTED_ENV in os.environ
            self.store = dist.TCPStore(
                w.master_addr,
                w.master_port,
                None,
                w.rank == 0 and not hosted,
                timeout=self.timeout,
                wait_for_workers=False,
            )
        # Under torchrun the agent's store outlives a restart, and so do the previous attempt's
        # process-group keys (peer addresses among them): a restarted attempt that reads them
        # connects to dead peers ("Gloo connectFullMesh failed", pytorch#135712) or hangs. Each
        # attempt gets keys of its own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        extra: dict[str, Any] = {"device_id": device} if device is not None and device.type == "cuda" else {}
        before = socket_fds()
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"ember/attempt{attempt}", self.store),
            rank=self.world.rank,
            world_size=self.world.world_size,
            timeout=self.timeout,
            **extra,
        )
        record_group_sockets(before)  # a forked child drops them (processes.py)
        # Left to interpreter shutdown, the group's threads can abort the process ("terminate
        # called without an active exception") after a perfectly good run.
        atexit.register(destroy_group)
        global _job_store
        _job_store = self.store
        self.record = FailureRecord(self.store)

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn`` here; a failure is reported once for the whole job, Ctrl-C in one line (see module doc)."""
        try:
            return self._run(fn, *args, **kwargs)
        except KeyboardInterrupt as exc:  # Ctrl-C: in fn, or arriving while a failure was being handled
            self.on_interrupt(exc)
            raise

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            if is_peer_failure(exc) and self.record is not None and self.record.interrupted():
                raise KeyboardInterrupt from None  # an interrupted peer left: end as it did
            original = classify_failure(self.record, self.world.rank, exc)
            self.on_failure()
            if not original:
                status = self.job_status(None)
                why = "failed" if status == 1 else f"stopped on {signal_name(status - 128)}"
                print(
                    f"[ember ddp] rank {self.world.rank}: stopping because another rank {why}.",
                    file=sys.stderr,
                    flush=True,
                )
                raise SystemExit(status) from None
            note = f"[ember ddp] raised on rank {self.world.rank} of {self.world.world_size}."
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            else:
                print(note, file=sys.stderr, flush=True)
            raise
        except SystemExit as exc:  # e.g. preemption (143): every rank stops at the same step
            self.on_failure(grace=PEERS_EXIT_S)
            own = exit_status(exc.code)
            status = self.job_status(own)
            if status != own:  # another rank failed meanwhile: that wins, and is named (once for the job)
                for what in self.failed_peers():
                    if self.record is None or self.record.claim(what):
                        print(
                            f"[ember ddp] {what} while the job was stopping; exiting with status {status}.",
                            file=sys.stderr,
                            flush=True,
                        )
                raise SystemExit(status) from None
            raise
        except BaseException:
            self.on_failure()
            raise

    def on_interrupt(self, exc: KeyboardInterrupt) -> None:
        """Ctrl-C (``interrupt.py``): the job learns of it, rank 0 says so in one line, the ranks this process
        started get a moment to end on their own, and ``exc`` ends this process without its traceback."""
        if self.record is not None:
            self.record.interrupt()
        if self.world.rank == 0:
            say_interrupted()
        self.on_failure(grace=GRACE_S)
        end_quietly(exc)

    def on_failure(self, grace: float = 0.0) -> None:
        """Hook for launchers that own other processes: stop them, after ``grace`` seconds in
        which they may end on their own."""

    def job_status(self, own: int | None) -> int:
        """The job's exit status given this rank's (None: it only noticed another rank fail)."""
        return 1 if own is None else own

    def failed_peers(self) -> list[str]:
        """The ranks this process started that failed rather than stopped, in words ("rank 1 was
        killed by signal 6 (SIGABRT)"); none for a process that started no other rank."""
        return []


def import_before_the_group() -> None:
    """Imports ``torch.distributed.fsdp`` before the default group exists.

    Some of its functions take ``process_group=dist.group.WORLD`` as a default argument, evaluated
    when the module is first imported; torch._dynamo imports it, and torch imports torch._dynamo at a
    process's first optimizer. Imported after the group exists, those defaults hold the group, so
    :func:`destroy_group` cannot free it: its gloo threads outlive the interpreter, and a collective's
    work released on one of them during shutdown aborts the process ("terminate called without an
    active exception": a preempted rank then ends with status 1 instead of 143). Imported first, the
    defaults hold None and the group is freed, its threads joined, while Python still runs. Costs
    nothing where the optimizer would import it anyway, and one import where none does.
    """
    import torch.distributed.fsdp  # noqa: F401


def destroy_group() -> None:
    # Cycles (module <-> trainer, ...) can hold the group; freed by the interpreter's last
    # collection, gloo's threads would need the GIL after it is gone and abort the process.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_group_sockets()
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
        super().__init__(World(0, num_processes, 0, num_processes, 0, "127.0.0.1", store.port, "ember"), timeout, store)
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
                # Let the main thread notice and stop cleanly; after Ctrl-C it runs on_exception first.
                deadline = time.monotonic() + (PEERS_EXIT_S if code == -signal.SIGINT else 3.0)
                while not self._stopping and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not self._stopping:
                    self.on_failure()
                    exit_now(self.job_status(None))
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

    def _statuses(self) -> list[int | None]:
        """The other ranks' statuses: as they ended on their own once this process stopped them, else now."""
        return self._ended if self._ended is not None else [c.poll() for c in self.children]

    def failed_peers(self) -> list[str]:
        return [
            f"rank {rank} {describe_exit(code)}"
            for rank, code in enumerate(self._statuses(), start=1)
            if code and stop_signal(code) is None
        ]

    def job_status(self, own: int | None) -> int:
        status = job_status([own, *self._statuses()])
        return status or (1 if own is None else 0)  # None: some rank failed, even if unseen here

    def finish(self) -> None:
        """At exit: wait for the other ranks to finish their copy of the script, then end with
        the job's status unless :meth:`launch` already chose it."""
        for child in self.children:
            child.wait()
        self._stopping = True
        destroy_group()
        if self._ended is None:
            status = job_status(c.returncode for c in self.children)
            if status:
                exit_now(status)


def rerun_command() -> list[str]:
    """The command line that started this process, to start it again for another rank."""
    main = sys.modules.get("__main__")
    interactive = (
        hasattr(sys, "ps1")
        or main is None
        or (
            not getattr(main, "__file__", None)
            and getattr(main, "__spec__", None) is None
            and "-c" not in getattr(sys, "orig_argv", [])
        )
    )
    if interactive:
        raise RuntimeError(
            "strategy='ddp' starts the other ranks by running your script again, but this is an "
            "interactive session (REPL or notebook) with no script to run. Use "
            "strategy='ddp_spawn' here, or put the training code in a script and run it."
        )
    if hasattr(sys, "orig_argv"):
        return [sys.executable, *sys.orig_argv[1:]]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name != "__main__":
        return [sys.executable, "-m", spec.name, *sys.argv[1:]]
    return [sys.executable, *sys.argv]
