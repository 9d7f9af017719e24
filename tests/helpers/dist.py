"""Run a function on N local ranks over gloo and collect what each rank returns.

``run_ranks(fn, world_size)`` spawns ``world_size`` processes, initialises a gloo process group in
each (rendezvous through a TCPStore the caller hosts on 127.0.0.1 only, on a port it already holds, so
there is no port race), calls ``fn(rank, world_size, *args, **kwargs)`` and returns the results in rank
order. If a rank raises, the same exception type is re-raised here with the rank and its remote
traceback attached; if a rank dies or the run exceeds ``timeout``, a ``RuntimeError`` /
``TimeoutError`` names the ranks. Whatever happens, every process is joined (killed if needed),
each rank destroys its process group, and the store is closed. If a rank cannot join the helper's own
group (before ``fn`` runs), the ranks are started again once, with a line on stderr.

Ranks are forked from a forkserver that has imported torch once (per test process), not spawned:
a spawned rank spends most of its start-up importing torch again, and the suite starts hundreds of
ranks. Each rank is still a fresh process (forked from a server that imported torch and ran
nothing), with the caller's current environment and working directory, as under spawn.

``count_collectives()`` counts calls to ``torch.distributed`` collectives in the current process.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_ranks", "count_collectives", "RemoteTraceback"]

_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
)


class RemoteTraceback(Exception):
    """The traceback of an exception raised in another process (shown as its cause)."""

    def __str__(self) -> str:
        return self.args[0]


# What the forkserver imports once; only installed packages, so that the server's working directory
# (wherever the first test that starts ranks runs) cannot change which ember or tests a rank imports.
# torch._dynamo: torch imports it on a process's first optimizer (Optimizer.add_param_group is wrapped
# by torch._disable_dynamo), about 0.8 s of CPU in every rank otherwise; torch.utils.tensorboard: the
# default logger's writer, about 0.3 s.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.utils.tensorboard"]


def _context() -> Any:
    """Forkserver on Linux (fork from a process that has imported torch); spawn elsewhere, or when
    ``EMBER_TEST_START_METHOD=spawn`` asks for it (to rule the forkserver out when chasing a failure)."""
    if sys.platform.startswith("linux") and os.environ.get("EMBER_TEST_START_METHOD", "forkserver") == "forkserver":
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


def _entry(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results: Any,
    environ: dict[str, str],
) -> None:
    # A forked rank inherits the forkserver's environment (from when it started); spawn would give
    # the caller's current one, which is what tests set up.
    os.environ.clear()
    os.environ.update(environ)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo's sockets on loopback
    torch.set_num_threads(1)
    delta = datetime.timedelta(seconds=timeout)
    try:
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=delta)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=delta)
    except Exception:  # this helper's own group, before fn: the caller may start the ranks again
        results.put((rank, None, traceback.format_exc()))
        return
    try:
        result = fn(rank, world_size, *args, **kwargs)
    except BaseException as exc:  # report anything, including KeyboardInterrupt / SystemExit
        # Report before tearing down: destroying a group with a peer still mid-collective can
        # block, and the caller kills every rank as soon as it sees this error anyway.
        try:
            payload = pickle.dumps(exc)
        except Exception:
            payload = None
        results.put((rank, False, (payload, repr(exc), traceback.format_exc())))
    else:
        # Plain pickle bytes: multiprocessing's tensor reduction would share memory through
        # file descriptors that vanish when this process exits.
        results.put((rank, True, pickle.dumps(result)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def join_as_rank(rank: int, world: int) -> None:
    """Inside a rank of :func:`run_ranks`: set the variables a launcher sets (as torchrun does), so that a
    ``strategy="ddp"`` Trainer there joins this job as ``rank`` of ``world``. The process group run_ranks made
    is the one the Trainer uses, so the address is a placeholder that nothing connects to."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
    )


def run_ranks(
    fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 60.0, **kwargs: Any
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned gloo ranks.

    Args:
        fn: A picklable (module-level) function; its return value must be picklable.
        world_size: Number of ranks.
        *args: Extra positional arguments for ``fn``.
        timeout: Seconds for the whole run (and each collective) before it counts as a hang.
        **kwargs: Extra keyword arguments for ``fn``.

    Returns:
        ``fn``'s return value per rank, in rank order.

    Raises:
        Exception: The first failing rank's exception (same type when picklable).
        TimeoutError: If some rank had not finished after ``timeout`` seconds.
    """
    for attempt in (1, 2):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout)
        except _GroupNotFormed as exc:
            if attempt == 2:
                raise RuntimeError(f"the ranks could not form their gloo group twice in a row:{exc}") from None
            # Seen under load on a busy loopback (about one run of the suite in five): a rank's
            # connectFullMesh "Connection closed by peer", before fn ran. The group is this helper's, not
            # ember's (ember's own joins are what the tests check), so it is formed again, and said so.
            print(f"run_ranks: the ranks' gloo group did not form; starting them again:{exc}", file=sys.stderr)
    raise AssertionError("unreachable")


class _GroupNotFormed(Exception):
    """A rank's ``init_process_group`` of :func:`run_ranks`' own group failed (its traceback is the message)."""


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
    ctx = _context()
    # A socket bound to 127.0.0.1 handed to the store: TCPStore's own port 0 would listen on
    # every interface.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        None,
        True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
        master_listen_fd=listener.detach(),
    )
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_entry,
            name=f"rank{rank}",
            daemon=True,
            args=(rank, world_size, port, timeout, fn, args, kwargs, results, dict(os.environ)),
        )
        for rank in range(world_size)
    ]
    finished = False
    try:
        for proc in procs:
            proc.start()
        outcome = _collect(procs, results, timeout)
        finished = True
        return [outcome[rank] for rank in range(world_size)]
    finally:
        grace = time.monotonic() + (10.0 if finished else 0.0)
        for proc in procs:
            if proc.pid is None:
                continue
            proc.join(timeout=max(0.0, grace - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
        results.join_thread()
        del store


def _collect(procs: list, results: Any, timeout: float) -> dict[int, Any]:
    outcome: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(outcome) < len(procs):
        if time.monotonic() > deadline:
            missing = [r for r in range(len(procs)) if r not in outcome]
            raise TimeoutError(
                f"ranks {missing} did not finish within {timeout:.0f} s (a hang: mismatched collectives or a deadlock)"
            )
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            # A rank that exited without reporting was killed or crashed in C++.
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in outcome and p.exitcode is not None]
            if dead:
                raise RuntimeError(
                    f"rank {dead[0][0]} exited with code {dead[0][1]} without returning a result"
                ) from None
            continue
        if ok is None:
            raise _GroupNotFormed(f"\n--- rank {rank} ---\n{payload}")
        if ok:
            outcome[rank] = pickle.loads(payload)
            continue
        pickled, text, remote_tb = payload
        try:
            error = pickle.loads(pickled) if pickled is not None else None
        except Exception:
            error = None
        if not isinstance(error, BaseException):
            error = RuntimeError(f"rank {rank} raised {text}")
        if hasattr(error, "add_note"):
            error.add_note(f"(raised on rank {rank})")
        raise error from RemoteTraceback(f"\n--- rank {rank} ---\n{remote_tb}")
    return outcome


@contextmanager
def count_collectives() -> Iterator[Counter]:
    """Counts calls to ``torch.distributed`` collectives made inside the block, by name.

    Code must call them as ``dist.<name>`` (attribute lookup at call time) to be seen.
    """
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return original(*args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


# ---------------------------------------------------------------------- processes a job leaves behind
def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie has exited; its parent just has not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_processes_gone(directory: Any, count: int | None = None, within: float = 2.0) -> None:
    """Every process that wrote a ``pid*`` file in ``directory`` ends within ``within`` seconds
    (and there were ``count`` of them, when given)."""
    pid_files = sorted(Path(directory).glob("pid*"))
    if count is not None:
        assert len(pid_files) == count, [f.name for f in pid_files]
    for pid_file in pid_files:
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + within
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(pid), f"process {pid} ({pid_file.name}) outlived the job"
