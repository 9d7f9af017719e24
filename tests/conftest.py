"""Suite-wide guards: a test that leaks a thread, a child process or a process group fails, what a
test sets in ``os.environ`` is undone after it, and a test that starts a process without the
``processes`` mark fails.

The tests that start processes (ranks, scripts, torchrun, loader workers) are marked ``processes``:
README's test command (``.ci/test``) runs them first, longest first, and the in-process tests after
them, spread over the cores by pytest-xdist; ``-m processes`` / ``-m "not processes"`` select either
tier. A test is ordered right only if it is marked, so starting a process unmarked is an error that
names the mark to add.

The suite's own helper programs (``tests/strategies/*_script.py``, ``tests/trainer/elastic_script.py``,
the program in ``test_checkpoint_ddp.py``) register ``gc.freeze`` with ``atexit``: CPython's shutdown
runs full garbage collections over every object, about 1 s of CPU per process once torch has imported
torch._dynamo (it does at a process's first optimizer), and the suite starts over a hundred of those
programs. Frozen, the objects are still freed by reference count at shutdown, and the atexit handlers
(ember's included) still run; what these programs check does not depend on the collector at exit. The
programs users run (``examples/``, the docs' and README's code blocks) end as users' programs do.
"""

from __future__ import annotations

import compileall
import multiprocessing
import multiprocessing.process
import os
import subprocess
import threading
import time

import pytest

from tests.helpers.session_jobs import SessionJobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SESSION_JOBS = pytest.StashKey["SessionJobs"]()


def pytest_configure(config):
    """Compile ember's and the tests' sources to bytecode once, before any test starts a process, and
    give the test processes one intra-op thread each.

    The process tier starts a few hundred Python processes (ranks, scripts, torchrun agents), each
    importing ember and test helpers. Where ``PYTHONDONTWRITEBYTECODE`` is set (as on the CI machines)
    no import writes a ``.pyc``, so every one of them would compile those sources again (about 0.3 s of
    CPU each). ``compileall`` writes the ``__pycache__`` files (ignored by git) that imports then read;
    it skips files whose bytecode is up to date. Run once, by the xdist controller (or a plain pytest),
    which also sets up the jobs that start as soon as their test is collected (tests/helpers/session_jobs.py).
    """
    if not _runs_the_session(config):
        return
    # One intra-op thread per test process unless the person running the suite chose a number:
    # pytest-xdist runs a test module per worker, one worker more than there are cores (.ci/test), and
    # every Python process a test starts would otherwise take a thread per core; OpenMP's threads then
    # spin waiting for each other on the oversubscribed cores (a 10 s documentation block took over
    # 40 s). torchrun does the same for several processes per machine. Set before xdist starts its
    # workers, so they and every process a test starts inherit it; the tests of ember's own thread
    # choices unset it, and README's example command runs without it, as a user's shell starts it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not config.option.collectonly:  # before xdist starts its workers: they inherit $EMBER_TEST_SESSION_JOBS
        config.stash[_SESSION_JOBS] = SessionJobs()
    for folder in ("src", "tests", "examples", "benchmarks"):
        path = os.path.join(ROOT, folder)
        if os.path.isdir(path):
            compileall.compile_dir(path, quiet=2)


def _runs_the_session(config) -> bool:
    """pytest itself, or pytest-xdist's controller; not one of xdist's workers."""
    return not hasattr(config, "workerinput")


def pytest_collection_finish(session):
    jobs = session.config.stash.get(_SESSION_JOBS, None)
    if jobs is not None:  # a plain pytest collects in the session's process
        jobs.start_for([item.nodeid for item in session.items])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    jobs = node.config.stash.get(_SESSION_JOBS, None)
    if jobs is not None:  # the controller: a worker has collected (each collects the same tests)
        jobs.start_for(ids)


def pytest_unconfigure(config):
    jobs = config.stash.get(_SESSION_JOBS, None)
    if jobs is not None:
        jobs.stop()


def _live_children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


@pytest.fixture(autouse=True)
def _no_leaks():
    import torch  # here, not at the top: xdist's controller loads this file and needs no torch (2 s of CPU)

    torch.manual_seed(0)
    threads_before = _threads()
    children_before = _live_children()
    environ = dict(os.environ)
    yield
    # What a test sets in os.environ (seed_everything's EMBER_GLOBAL_SEED, as Lightning's PL_GLOBAL_SEED,
    # among others) stays with it: later tests, and the processes they start, see the same environment
    # whatever ran before them on this worker.
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    # Give threads that are finishing up a moment to exit before calling them leaked.
    deadline = time.monotonic() + 2.0
    while True:
        leaked_threads = [
            t
            for t in _threads() - threads_before
            if not t.daemon or not t.name.startswith(("pydevd", "QueueFeederThread"))
        ]
        leaked_children = _live_children() - children_before
        if not leaked_threads and not leaked_children or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    problems = []
    if leaked_threads:
        problems.append(f"threads left running: {[t.name for t in leaked_threads]}")
    if leaked_children:
        problems.append(f"child processes left running: {sorted(leaked_children)}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        problems.append("a torch.distributed process group was left initialised")
    if problems:
        pytest.fail("; ".join(problems))


@pytest.fixture(autouse=True)
def _processes_are_marked(request, monkeypatch):
    if request.node.get_closest_marker("processes") is not None:
        yield
        return
    started: list[str] = []
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    process_start = multiprocessing.process.BaseProcess.start

    def recording_execute_child(self, args, *rest, **kwargs):
        started.append(f"subprocess {args if isinstance(args, str) else ' '.join(map(str, args))[:120]}")
        return execute_child(self, args, *rest, **kwargs)

    def recording_start(self):
        started.append(f"multiprocessing {self.name}")
        return process_start(self)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", recording_execute_child)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
    yield
    if started:
        pytest.fail(
            f"this test started processes ({started[:3]}) but is not marked: add "
            "`@pytest.mark.processes` (with a `pytest.mark.timeout` of its own if 120 s is too "
            "short), so it runs with the tests that start processes"
        )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Modules with tests that start processes go first, and among either kind those whose tests may
    run longest (by their largest ``timeout`` mark), each module's tests kept together and in their order.

    Under pytest-xdist (README's test command: ``--dist loadfile --no-loadscope-reorder``, a module per
    worker, handed out in this order) a module of minute-long jobs that starts last would leave the other
    worker idle while it runs; started first, it overlaps the others, and the many short in-process
    modules even out the end. A module on one worker sets up its module-scoped fixtures (a multi-rank
    run shared by several tests) once.
    """
    budget: dict[object, float] = {}
    starts_processes: set[object] = set()
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = float(marker.args[0]) if marker is not None and marker.args else 0.0
        budget[item.parent] = max(budget.get(item.parent, 0.0), seconds)
        if item.get_closest_marker("processes") is not None:
            starts_processes.add(item.parent)
    items.sort(key=lambda item: (item.parent not in starts_processes, -budget[item.parent]))
