"""The half of the ``ddp`` strategy that talks to the other ranks: its collectives, and the hang watchdog that
watches every one of them.

:class:`ProcessGroupStrategy` is the base class of :class:`~ember.strategies.ddp.DDPStrategy` (and so of
``fsdp``), apart from it so that ``ddp.py`` reads as how a rank joins the job, shards its data and runs its
steps, and this file as what happens each time the ranks meet. Every collective runs through
:meth:`~ProcessGroupStrategy._waiting`, which tells this rank's
:class:`~ember.strategies.watchdog.watchdog.Beacon` which collective it waits in (an attribute store, no
communication), and turns a timeout into :class:`~ember.strategies.watchdog.watchdog.CollectiveTimeout`
naming the rank that did not arrive. The collectives that carry host values (a broadcast object, a barrier,
a decision, a number logged with ``sync_dist``) run on the CPU control group (``control.py``), so that
under NCCL the host never waits for the GPU to reach them.

The watchdog itself (the thread, the store records, the verdicts) is in ``watchdog/``; here is only what
the strategy does with it: start it on a store every rank reaches (the launcher's, or one of its own for a
process group the user made), and feed it the Trainer's progress. The state these methods share is made
by ``DDPStrategy.__init__`` and reset by its ``__getstate__``, beside the rest of the strategy's.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from ember.parallel.all_gather import all_gather
from ember.strategies.control import Decision, DecisionMode, check_decision_mode
from ember.strategies.launchers import launcher as launcher_module
from ember.strategies.launchers.launcher import Launcher
from ember.strategies.strategy import Strategy
from ember.strategies.watchdog.stacks import exit_with_stacks
from ember.strategies.watchdog.verdicts import AFTER_BACKWARD, BACKWARD
from ember.strategies.watchdog.watchdog import Beacon, CollectiveTimeout, Watchdog, is_timeout
from ember.types import ReduceOp

__all__ = ["ProcessGroupStrategy"]

T = TypeVar("T")
_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


class ProcessGroupStrategy(Strategy):
    """A strategy whose ranks are the processes of a ``torch.distributed`` group: the collective verbs, each
    watched for hangs, and the watchdog's plumbing (see the module doc). Not a strategy of its own: the
    subclass (:class:`~ember.strategies.ddp.DDPStrategy`) joins the group, and sets the state below."""

    timeout: datetime.timedelta  # a collective's timeout
    watchdog_timeout: float | None  # the watchdog's smallest deadline in seconds; None: no verdicts
    _launcher: Launcher | None  # its store is the job's, when ember launched or joined the job
    _beacon: Beacon  # where this rank is, for the watchdog: attribute stores only
    _watchdog: Watchdog | None
    _control_group: Any  # the group for control collectives (control.py): None is the default group
    _own_store: dist.Store | None  # the watchdog's store in a process group the user made; None: not made yet

    @property
    def watchdog(self) -> Watchdog | None:
        """This rank's hang watchdog: the running one, else the last one (its ``deadline`` and
        ``slowest_step`` stay readable); None with one process."""
        return self._watchdog

    # ------------------------------------------------------------------ hangs (watchdog.py)
    def _start_watchdog(self) -> None:
        if self._watching or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        store = self._job_store()
        if store is None:
            return  # a process group made without a store we can reach: no watchdog
        self._beacon = Beacon()
        self._watchdog = Watchdog(
            store,
            dist.get_rank(),
            dist.get_world_size(),
            self._beacon,
            floor=self.watchdog_timeout,
            timeout=self.timeout.total_seconds(),
            progress=self._progress,
        )
        self._watchdog.start()

    @property
    def _watching(self) -> bool:
        return self._watchdog is not None and self._watchdog.running

    def _job_store(self) -> dist.Store | None:
        if self._launcher is not None and self._launcher.store is not None:
            return self._launcher.store
        if launcher_module.job_store() is not None:
            return launcher_module.job_store()
        return self._store_of_our_own()

    def _store_of_our_own(self) -> dist.Store | None:
        """A store for the watchdog of a process group the user made (torch has no public way to that
        group's store): rank 0 hosts one on a free port and tells the other ranks where, over the group.
        None on every rank when any rank could not reach it: then there is no watchdog."""
        if self._own_store is not None:
            return self._own_store
        rank0 = dist.get_rank() == 0
        store: dist.Store | None = None
        where: list[Any] = [None]
        if rank0:
            with contextlib.suppress(Exception):
                server = dist.TCPStore("0.0.0.0", 0, None, True, timeout=self.timeout, wait_for_workers=False)
                host = os.environ.get("MASTER_ADDR") or socket.gethostname()
                store, where = server, [(host, server.port)]
        dist.broadcast_object_list(where, src=0)
        if not rank0 and where[0] is not None:
            with contextlib.suppress(Exception):
                host, port = where[0]
                store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=30))
                store.set_timeout(self.timeout)
        # Every rank or none: a watchdog missing on one rank would name it as hung.
        reached = torch.tensor([0.0 if store is None else 1.0], device=self.root_device)
        dist.all_reduce(reached, op=dist.ReduceOp.MIN)
        self._own_store = store if reached.item() == 1.0 else None
        return self._own_store

    def _progress(self) -> dict[str, Any]:
        # Read by the watchdog thread once a second: plain attribute reads.
        trainer = self.trainer
        progress = getattr(trainer, "progress", None)
        return {
            "stage": getattr(getattr(trainer, "state", None), "activity", None),
            "step": getattr(progress, "global_step", None),
            "epoch": getattr(progress, "current_epoch", None),
        }

    def abort_job(self, message: str, exit_code: int) -> NoReturn:
        """Ends every process of the job now with ``exit_code``, for a rank that cannot stop cleanly
        (``ember/trainer/preemption.py``: a stop signal, and no step boundary within the grace period).

        Every rank prints ``message`` and where the ranks are; this rank and the ranks that are not
        in a collective (the stuck ones) print their Python stacks.
        """
        if self._watchdog is not None and self._watching:
            self._watchdog.abort(message, exit_code)
        exit_with_stacks(f"[ember ddp] rank {self.global_rank} {message}", exit_code)

    def _waiting(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs the collective ``fn`` with the beacon saying so; a timeout names the missing rank."""
        beacon = self._beacon
        beacon.waits += 1
        beacon.waiting = what
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self._name_missing_rank(exc, what)
            raise
        finally:
            beacon.waiting = None

    def _run_backward(self, run: Callable[[torch.Tensor], None], loss: torch.Tensor, syncs: bool, what: str) -> None:
        """``run(loss)`` with the beacon saying where this rank is: waiting in the gradient collective ``what``
        when the backward ``syncs``, in a backward that sends nothing otherwise (an accumulation window)."""
        beacon = self._beacon
        if syncs:
            self._waiting(what, run, loss)
        else:
            beacon.where = BACKWARD
            run(loss)
        beacon.where = AFTER_BACKWARD

    def _name_missing_rank(self, exc: Exception, what: str) -> None:
        """Raises CollectiveTimeout naming the ranks that did not arrive, if ``exc`` is a timeout."""
        if self._watchdog is not None and self._watching and is_timeout(exc):
            raise CollectiveTimeout(self._watchdog.explain_timeout(what)) from exc

    # ------------------------------------------------------------------ collectives
    def reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        """Reduce ``tensor`` across all processes. A tensor on the root device is reduced there; a
        CPU tensor (a Python number given to ``self.log(..., sync_dist=True)``) on the CPU control
        group and returned on the CPU: no copy to the device, and no wait for it."""
        super().reduce(tensor, op)  # validates op
        if self.world_size == 1 or not dist.is_initialized():
            return tensor
        out = torch.as_tensor(tensor).detach()
        on_cpu = out.device.type == "cpu"
        out = out.clone() if on_cpu else out.to(self.root_device).clone()
        if not out.is_floating_point() and op == "mean":
            out = out.double()
        group = self._control_group if on_cpu else None
        self._waiting(f"an all-reduce (strategy.reduce, op={op!r})", dist.all_reduce, out, op=_OPS[op], group=group)
        return out / self.world_size if op == "mean" else out

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        mine = torch.as_tensor(tensor).to(self.root_device)
        if self.world_size == 1 or not dist.is_initialized():
            return mine.unsqueeze(0) if sync_grads else mine.detach().unsqueeze(0)  # still [world, ...], as Lightning
        return self._waiting("an all-gather (strategy.all_gather)", all_gather, mine, group, sync_grads)

    def gather_per_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        """As the base class; a CPU tensor (a count, the RNG states of a checkpoint) is gathered on the CPU
        control group and returned on the CPU: under NCCL it never goes through the device, and the
        caller's read of the result waits for no GPU work."""
        mine = torch.as_tensor(tensor).detach()
        if mine.device.type != "cpu" or self.world_size == 1 or not dist.is_initialized():
            return super().gather_per_rank(mine)
        return self._waiting("an all-gather (strategy.gather_per_rank)", all_gather, mine, self._control_group)

    def broadcast(self, obj: T, src: int = 0) -> T:
        # On the CPU control group: the object is pickled into a CPU tensor (under NCCL it would be copied to
        # the device and back, and the host would wait for every kernel queued before the copy).
        if self.world_size == 1 or not dist.is_initialized():
            return obj
        box = [obj]
        self._waiting(
            f"a broadcast from rank {src} (strategy.broadcast)",
            dist.broadcast_object_list,
            box,
            src=src,
            group=self._control_group,
        )
        return box[0]

    def barrier(self, name: str | None = None) -> None:
        # On the CPU control group: a barrier orders the hosts (files written, a directory made); under
        # NCCL it would also make each host wait until its GPU has run everything queued before it.
        if self.world_size > 1 and dist.is_initialized():
            group = self._control_group
            ids: dict[str, Any] = {}
            device = self.root_device
            if (
                group is None
                and device.type == "cuda"
                and device.index is not None
                and "nccl" in str(dist.get_backend())
            ):
                # The default group (outside a fit, no control group open) under NCCL: named, since the group was
                # made elsewhere with no device bound at its init.
                ids["device_ids"] = [device.index]
            self._waiting(f"a barrier ({name})" if name else "a barrier", dist.barrier, group=group, **ids)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # On the CPU control group: the answer is read on the host, so it never travels through the device.
        mode: DecisionMode = "all" if all else "any"
        return self._decide(decision, mode, "strategy.reduce_boolean_decision").result()

    def start_decision(self, decision: bool, mode: DecisionMode = "any") -> Decision:
        check_decision_mode(mode)
        return self._decide(decision, mode, "strategy.start_decision")

    def _decide(self, decision: bool, mode: DecisionMode, caller: str) -> Decision:
        if self.world_size == 1 or not dist.is_initialized():
            return Decision(bool(decision))
        flag = torch.tensor([int(bool(decision))], dtype=torch.int32)  # on the CPU, for the control group
        group = self._control_group
        if mode == "rank_zero":
            what = f"a decision broadcast from rank 0 ({caller})"
            work = dist.broadcast(flag, src=0, group=group, async_op=True)
        else:
            what = f"an all-reduce ({caller}, {mode!r})"
            op = dist.ReduceOp.MIN if mode == "all" else dist.ReduceOp.MAX
            work = dist.all_reduce(flag, op=op, group=group, async_op=True)
        return Decision(flag, lambda: self._waiting(what, work.wait))
