"""Preemption: a stop signal becomes a checkpoint at the next step boundary and a documented exit.

During ``fit``, SIGTERM (what schedulers send before killing a job) is caught. The handler only
records the signal; at the next step boundary (after a batch's optimizer step, scheduler step and
any validation; with ``accumulate_grad_batches``, once the accumulation window closes) a single
process stops; with several, every 8th such boundary (``PreemptionHandler.sync_every``, so the
agreement costs one small collective per 8 steps rather than one per step) every rank asks
``strategy.reduce_boolean_decision(received, all=False)``, so all ranks stop at the same step
even if only one got the signal. Then ``last.ckpt`` is written in
the first ModelCheckpoint's directory (``<default_root_dir>/checkpoints`` without one) and
:class:`Preempted` is raised, a ``SystemExit`` whose exit status is ``128 + signal number`` (143
for SIGTERM, 138 for SIGUSR1 on Linux): what a shell reports for a process killed by that signal,
so schedulers treat the job as preempted rather than finished. ``fit(..., ckpt_path="last")``
continues it exactly.

Which signals: SIGTERM, plus SIGUSR1 under SLURM (``SLURM_JOB_ID`` set), SLURM's usual
``--signal`` for requeueing. Set ``trainer.preemption_signals`` to a tuple of signals before
``fit`` to choose others, or to ``()`` to leave every handler alone. Handlers can only be
installed from the main thread; elsewhere preemption is not handled. The previous handlers are
put back when ``fit`` returns.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import warnings
from types import FrameType
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


def exit_code(signum: int) -> int:
    """The exit status of a run preempted by ``signum``."""
    return 128 + int(signum)


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is written. ``code`` is the exit status."""

    def __init__(self, signum: int, path: str) -> None:
        super().__init__(exit_code(signum))
        self.signum = signum
        self.checkpoint_path = path

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its own arguments, so that a ddp_spawn worker's reaches the caller as itself.
        return type(self), (self.signum, self.checkpoint_path)

    def __str__(self) -> str:
        return (f"Preempted by {signal.Signals(self.signum).name}: saved {self.checkpoint_path}; "
                f"exiting with status {self.code}. Resume with trainer.fit(..., ckpt_path='last').")


def default_signals() -> tuple[int, ...]:
    sigs = [signal.SIGTERM]
    if "SLURM_JOB_ID" in os.environ and hasattr(signal, "SIGUSR1"):
        sigs.append(signal.SIGUSR1)
    return tuple(sigs)


class PreemptionHandler:
    """Records stop signals and turns them into a checkpoint + :class:`Preempted` at a step boundary."""

    def __init__(self, trainer: Trainer, signals: tuple[int, ...]) -> None:
        self.trainer = trainer
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        #: With several processes, how many step boundaries pass between two agreements on stopping.
        self.sync_every = 8
        self._boundaries = 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def install(self) -> bool:
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def check(self) -> None:
        """At a step boundary: stop (save, raise) if any rank got a signal."""
        t = self.trainer
        k, done = t.accumulate_grad_batches, t.progress.batch_in_epoch
        if k > 1 and done % k and done != t.num_training_batches:
            return  # inside a gradient-accumulation window (same counters on every rank): stop once it closes
        strategy = t.strategy
        received = self.received is not None
        if strategy.world_size > 1:
            # Agreeing costs a collective: ask at every `sync_every`-th boundary only. Every rank
            # counts the same boundaries, so they all ask (and stop) at the same step.
            self._boundaries += 1
            if self._boundaries % self.sync_every:
                return
            received = strategy.reduce_boolean_decision(received, all=False)
        if received:
            self.stop()

    def stop(self) -> None:
        from ember.trainer import checkpoint

        t = self.trainer
        callbacks = [cb for cb in t.callbacks if hasattr(cb, "best_model_path") and hasattr(cb, "dirpath")]
        directory = (callbacks[0].dirpath if callbacks and callbacks[0].dirpath else checkpoint.default_dir(t))
        path = checkpoint.save(t, os.path.join(directory, "last.ckpt"))
        for cb in callbacks:
            if hasattr(cb, "last_model_path") and os.path.dirname(path) == os.path.abspath(cb.dirpath or ""):
                cb.last_model_path = path
        signum = self.received if self.received is not None else signal.SIGTERM
        exc = Preempted(signum, path)
        if t.is_global_zero:
            warnings.warn(str(exc), UserWarning, stacklevel=2)
        raise exc


@contextlib.contextmanager
def preemption(trainer: Trainer) -> Iterator[PreemptionHandler | None]:
    """Install the handler for the duration of a fit loop and expose it as ``trainer._preemption``."""
    sigs = getattr(trainer, "preemption_signals", None)
    handler = PreemptionHandler(trainer, default_signals() if sigs is None else tuple(sigs))
    if not handler.install():
        yield None
        return
    trainer._preemption = handler
    try:
        yield handler
    finally:
        trainer._preemption = None
        handler.uninstall()
