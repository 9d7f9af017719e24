"""Preemption: a stop signal becomes a checkpoint at the next step boundary and a documented exit.

During ``fit``, SIGTERM (what schedulers send before killing a job) is caught. The handler only
records the signal; at the next step boundary (after a batch's optimizer step, scheduler step and
any validation; with ``accumulate_grad_batches``, once the accumulation window closes) a single
process stops. With several, the ranks agree on stopping without ever waiting for it: every 8th such
boundary (``PreemptionHandler.sync_every``) each rank starts ``strategy.start_decision(received,
"any")``, a one-element all-reduce on the CPU control group that runs in the background
(``ember/strategies/control.py``), and reads its result one boundary later
(``PreemptionHandler.decision_lag``): every rank sent its part a whole step earlier, so the read
finds it done. No device is involved and the step's stream never drains for it; every rank reads the
same decision at the same boundary, so all ranks stop at the same step even if only one got the
signal (1 to 9 boundaries after it). Then ``last.ckpt`` is written in the first ModelCheckpoint's
directory (``<default_root_dir>/checkpoints`` without one) and :class:`Preempted` is raised, a
``SystemExit`` whose exit status is ``128 + signal number`` (143 for SIGTERM, 138 for SIGUSR1 on
Linux): what a shell reports for a process killed by that signal, so schedulers treat the job as
preempted rather than finished. ``fit(..., ckpt_path="last")`` continues it exactly.

Which signals: SIGTERM, plus SIGUSR1 under SLURM (``SLURM_JOB_ID`` set), SLURM's usual
``--signal`` for requeueing. On SIGUSR1 under SLURM, once the checkpoint is written, global rank zero
asks SLURM to requeue the job (``scontrol requeue $SLURM_JOB_ID``) and every rank exits with status
0; the requeued job (``SLURM_RESTART_COUNT`` > 0) resumes from its checkpoint on its own
(``ember/checkpoint/auto_resume.py``). When the requeue cannot be done, a warning says why and the exit status is
138 as for any other stop signal. Set ``trainer.preemption_signals`` to a tuple of signals before
``fit`` to choose others, or to ``()`` to leave every handler alone. Handlers can only be
installed from the main thread; elsewhere preemption is not handled. The previous handlers are
put back when ``fit`` returns.

A stop signal always ends the run. A rank stuck in ``training_step``, in I/O or waiting for a hung
peer reaches no step boundary, so the flag alone would let it outlive every SIGTERM. After a
signal, the run has a grace period (``trainer.preemption_grace``, default 60 s; ``None`` waits
forever) to reach a step boundary; each boundary reached, and the start of the checkpoint write,
starts it again. When it runs out, the Python stacks are printed and the process exits with
``128 + signal number`` without a checkpoint; under ``ddp`` the whole job does, the stuck ranks
printing their stacks too (``DDPStrategy.abort_job``). The clock is a thread, because Python runs
signal handlers only in the main thread and only between bytecodes, which a main thread blocked in
C code (a collective waiting for a hung peer) never reaches: the handler's C half also writes the
signal's number to a socket (:func:`signal.set_wakeup_fd`), which the thread watches.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from ember.checkpoint import contents
from ember.exceptions import Preempted, exit_code
from ember.strategies.launchers.launcher import note_stop_signal
from ember.strategies.watchdog.watchdog import exit_with_stacks
from ember.trainer import locate
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer

#: Seconds a run has, after a stop signal, to reach a step boundary (``trainer.preemption_grace``).
DEFAULT_GRACE_S = 60.0


def default_signals() -> tuple[int, ...]:
    sigs = [signal.SIGTERM]
    if "SLURM_JOB_ID" in os.environ and hasattr(signal, "SIGUSR1"):
        sigs.append(signal.SIGUSR1)
    return tuple(sigs)


class PreemptionHandler:
    """Records stop signals and turns them into a checkpoint + :class:`Preempted` at a step boundary.

    Args:
        trainer: The Trainer whose fit loop checks for signals.
        signals: The signals that stop the run.
        grace: Seconds to reach a step boundary after a signal before the process is ended without
            a checkpoint (stacks printed, status ``128 + signal``); None to wait forever.
    """

    def __init__(self, trainer: Trainer, signals: tuple[int, ...], grace: float | None = DEFAULT_GRACE_S) -> None:
        if grace is not None and not grace > 0:
            raise ValueError(
                f"preemption_grace={grace!r}: give the seconds a run has after a stop signal to reach "
                "a step boundary (a number > 0), or None to wait for one forever."
            )
        self.trainer = trainer
        self.signals = signals
        self.grace = grace
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._clock: _GraceClock | None = None
        #: With several processes, how many step boundaries pass between two agreements on stopping.
        self.sync_every = 8
        #: ... and how many boundaries after an agreement starts its result is read (and acted on).
        self.decision_lag = 1
        self._boundaries = 0
        self._decision: Any = None  # the agreement in flight (a strategy Decision), read at `_read_at`
        self._read_at = 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        note_stop_signal(signum)

    def install(self) -> bool:
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        if self.grace is not None:
            self._clock = _GraceClock(self.signals, self.grace, self._expired)
            self._clock.start()
        return True

    def uninstall(self) -> None:
        if self._clock is not None:
            self._clock.stop()
            self._clock = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _expired(self, signum: int) -> None:
        """The grace period ran out: print the stacks and end the process (under ddp, the job)."""
        code = exit_code(signum)
        message = (
            f"received {signal.Signals(signum).name} {self.grace:g} s ago and has reached no step "
            f"boundary since, so it cannot stop with a checkpoint: it is stuck. Exiting with status "
            f"{code} without saving one."
        )
        strategy = self.trainer.strategy
        abort = getattr(strategy, "abort_job", None)
        if abort is not None and strategy.world_size > 1:
            abort(message, code)  # every rank exits; the stuck ones print their stacks
        exit_with_stacks(f"[ember] The run {message} Python stack (pid {os.getpid()}):", code)

    def check(self) -> None:
        """At a step boundary: stop (save, raise) if any rank got a signal."""
        t = self.trainer
        clock = self._clock
        if clock is not None and clock.signum is not None:
            clock.restart()  # a boundary: the run is alive; the grace period starts again
        # Windows count steps: a training_step(self, dataloader_iter) counts them apart from its batches.
        k, done = t.accumulate_grad_batches, t.progress.steps_in_epoch or t.progress.batch_in_epoch
        if k > 1 and done % k and done != t.num_training_batches:
            return  # inside a gradient-accumulation window (same counters on every rank): stop once it closes
        strategy = t.strategy
        if strategy.world_size == 1:
            if self.received is not None:
                self.stop()
            return
        # Every rank counts the same boundaries, so all start (and read) each agreement at the same one.
        self._boundaries += 1
        if self._decision is not None and self._boundaries >= self._read_at:
            decision, self._decision = self._decision, None
            if decision.result():  # sent `decision_lag` boundaries ago: normally complete, no wait
                self.stop()
        if self._decision is None and self._boundaries % self.sync_every == 0:
            self._decision = strategy.start_decision(self.received is not None, "any")
            self._read_at = self._boundaries + max(1, self.decision_lag)

    def finish(self) -> None:
        """When the fit loop ends normally: wait for the agreement in flight (sent by every rank, so it
        completes), leaving no collective running."""
        decision, self._decision = self._decision, None
        if decision is not None:
            decision.result()

    def stop(self) -> None:
        t = self.trainer
        if self._clock is not None:
            self._clock.restart()  # the checkpoint write gets a whole grace period
        callbacks = [cb for cb in t.callbacks if hasattr(cb, "best_model_path") and hasattr(cb, "dirpath")]
        first = callbacks[0] if callbacks and callbacks[0].dirpath else None
        if first is not None and hasattr(first, "next_last_path"):
            # The callback's own name for its next last checkpoint: an earlier run's last.ckpt in the same
            # directory is never overwritten (this one gets last-v1.ckpt), this run's own is.
            target = first.next_last_path(t)
        else:
            target = os.path.join(first.dirpath if first is not None else locate.default_dir(t), "last.ckpt")
        # Named before the write, so the checkpoint's own callback state says it is this run's last: a
        # resume from it keeps writing last.ckpt, not a second last-v1.ckpt beside it.
        for cb in callbacks:
            if hasattr(cb, "last_model_path") and os.path.dirname(os.path.abspath(target)) == os.path.abspath(
                cb.dirpath or ""
            ):
                cb.last_model_path = os.path.abspath(target)
        path = contents.save(t.fit_state, t.strategy, target)
        signum = self.received if self.received is not None else signal.SIGTERM
        requeued = None
        if signum == getattr(signal, "SIGUSR1", None) and os.environ.get("SLURM_JOB_ID"):
            requeued = t.strategy.broadcast(requeue_slurm_job(os.environ["SLURM_JOB_ID"]) if t.is_global_zero else None)
        exc = Preempted(signum, path, requeued)
        if t.is_global_zero:
            warnings.warn(str(exc), UserWarning, stacklevel=user_stacklevel())
        raise exc


def requeue_slurm_job(job_id: str) -> str | None:
    """Ask SLURM to requeue ``job_id`` (``scontrol requeue``); returns what was done, or None (with a
    warning saying why) when it could not be done."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        warnings.warn(
            "SIGUSR1 under SLURM: the checkpoint is written, but `scontrol` is not on PATH, so the job "
            "was not requeued. Resubmit it; fit resumes from the checkpoint with ckpt_path='last'.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return None
    try:
        done = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        failure = str(err)
    else:
        if done.returncode == 0:
            return f"requeued SLURM job {job_id} (scontrol requeue {job_id})"
        failure = (done.stderr or done.stdout).strip() or f"status {done.returncode}"
    warnings.warn(
        f"SIGUSR1 under SLURM: the checkpoint is written, but `scontrol requeue {job_id}` failed "
        f"({failure}). Resubmit the job; fit resumes from the checkpoint with ckpt_path='last'.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
    return None


@contextlib.contextmanager
def preemption(trainer: Trainer) -> Iterator[PreemptionHandler | None]:
    """Install the handler for the duration of a fit loop; yields it (None when it cannot be installed)."""
    sigs = getattr(trainer, "preemption_signals", None)
    handler = PreemptionHandler(
        trainer,
        default_signals() if sigs is None else tuple(sigs),
        getattr(trainer, "preemption_grace", DEFAULT_GRACE_S),
    )
    if not handler.install():
        yield None
        return
    try:
        yield handler
        handler.finish()  # (not after an error: a rank that failed may never have sent its part)
    finally:
        handler.uninstall()


class _GraceClock:
    """A daemon thread that calls ``expire(signum)`` when, after one of ``signals``, ``grace`` seconds
    pass without :meth:`restart`. It learns of signals through :func:`signal.set_wakeup_fd`, so
    it works while the main thread is blocked in C code; bytes of other signals are passed on to
    a wakeup descriptor installed before it."""

    def __init__(self, signals: tuple[int, ...], grace: float, expire: Any) -> None:
        self.signals = {int(s) for s in signals}
        self.grace = grace
        self.expire = expire
        #: The first of ``signals`` received, once one is.
        self.signum: int | None = None
        self._deadline: float | None = None
        self._stopped = threading.Event()
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)  # set_wakeup_fd needs it: a signal handler must never block
        self._previous_fd = -1
        self._thread = threading.Thread(target=self._run, name="ember-preemption-grace", daemon=True)

    def start(self) -> None:
        global _active_clock
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        _active_clock = self
        _reset_in_forked_children()
        self._thread.start()

    def restart(self) -> None:
        if self.signum is not None:
            self._deadline = time.monotonic() + self.grace

    def stop(self) -> None:
        global _active_clock
        signal.set_wakeup_fd(self._previous_fd)
        _active_clock = None
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._writer.send(b"\0")  # wakes the thread
        self._thread.join()
        self._reader.close()
        self._writer.close()

    def _run(self) -> None:
        while not self._stopped.is_set():
            timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
            ready, _, _ = select.select([self._reader], [], [], timeout)
            if self._stopped.is_set():
                return
            if ready:
                data = self._reader.recv(256)
                for signum in data:
                    self._pass_on(signum)
                    if signum in self.signals and self.signum is None:
                        self.signum = signum
                        self.restart()
                continue
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self.expire(self.signum)
                return

    def _pass_on(self, signum: int) -> None:
        if self._previous_fd >= 0 and signum:
            with contextlib.suppress(OSError):
                os.write(self._previous_fd, bytes([signum]))


_active_clock: _GraceClock | None = None
_fork_hook_registered = False


def _reset_in_forked_children() -> None:
    # A child forked while the clock runs (a DataLoader worker) inherits the wakeup descriptor:
    # a signal sent to the child would reach this process's clock. Give the child none.
    global _fork_hook_registered
    if _fork_hook_registered or not hasattr(os, "register_at_fork"):
        return
    _fork_hook_registered = True

    def in_child() -> None:
        global _active_clock
        if _active_clock is not None:
            _active_clock = None
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(-1)

    os.register_at_fork(after_in_child=in_child)
