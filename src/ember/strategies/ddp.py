"""The ``ddp`` strategy: one process per device, gradients averaged by ember's DistributedDataParallel.

How processes start is the launcher's business (``launchers/launcher.py``): under ``torchrun`` or SLURM
this process joins the existing job; a plain ``python train.py`` re-runs the script for the other
ranks (``start_method="popen"``, the ``"ddp"`` default); ``"ddp_spawn"`` starts workers with
multiprocessing spawn (``launchers/spawn.py``) and copies rank 0's trained weights, metrics and progress
back into the caller's module and Trainer (``launchers/worker_state.py``).

Data: every loader is rebuilt around :class:`~ember.data.sampler.ShardedSampler`. Training
shards are padded to equal length (every rank takes the same number of steps, so the gradient
all-reduce never waits on a rank that ran out); evaluation shards repeat no sample inside a real
batch, and epoch metrics are reduced once at the end, weighted by sample counts. A validation or
test shard that would yield a batch fewer than the longest ends with a padding batch instead, so a
collective in the step (a synced step value, an all-gather) meets its partner on every rank; the
evaluation loop counts that batch toward no epoch value. ``validation_step`` runs on the module
itself, not through the wrapper; rank 0's buffers are broadcast before the loop
(``prepare_for_evaluation``). Loaders without a length (an ``IterableDataset`` each rank feeds
itself) are not sharded; in training the ranks agree before each step that all of them still have
a batch (``ember/trainer/lockstep.py``). ``training_step`` runs through the wrapper
(``ddp.call``), so gradients are averaged during ``backward``; inside ``no_backward_sync`` (all
but the last micro-batch of an accumulation window) nothing is communicated.

Hangs (``watchdog/``): the verbs here tell the rank's :class:`~ember.strategies.watchdog.watchdog.Beacon`
which batch and phase it is in and which collective it waits in (attribute stores only), and a
watchdog thread per rank stops the job when one rank keeps the others waiting, naming it, with its
stack. A collective that times out raises :class:`~ember.strategies.watchdog.watchdog.CollectiveTimeout`,
which names the rank that did not arrive. The collectives (``reduce``, ``broadcast``, ``barrier``, the
decisions...) and the watchdog's plumbing are in the base class,
:class:`~ember.strategies.process_group.ProcessGroupStrategy` (``process_group.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_only
from torch.utils.data import RandomSampler

from ember.data.resumable import make_resumable, rebuild_with_sampler, resumable_sampler_of, why_not_swappable
from ember.data.sampler import ShardedSampler
from ember.module import TrainModule
from ember.parallel.distributed import DistributedDataParallel
from ember.rng import capture_rng
from ember.strategies.control import close_control_group, open_control_group
from ember.strategies.ddp_messages import oversubscription_message, unused_parameter_advice
from ember.strategies.launchers.interrupt import run_in_this_process
from ember.strategies.launchers.launcher import Launcher, PopenLauncher, World, detect_world, import_before_the_group
from ember.strategies.launchers.spawn import SpawnLauncher
from ember.strategies.launchers.worker_state import adopt_worker_state, dumps, loads, run_in_worker
from ember.strategies.process_group import ProcessGroupStrategy
from ember.strategies.watchdog.verdicts import AFTER_STEP, TRAINING_STEP
from ember.strategies.watchdog.watchdog import Beacon, Watchdog
from ember.types import Stage
from ember.user_frames import user_stacklevel

__all__ = ["DDPStrategy"]

T = TypeVar("T")
# Collectives a rank may wait in at every step, as the watchdog's messages name them.
_GRADIENTS = "the gradient all-reduce (backward)"
_BUFFERS = "the buffer broadcast before training_step"


class DDPStrategy(ProcessGroupStrategy):
    """Data parallelism with one process per device.

    Args:
        accelerator: "cpu" or "cuda"; filled in by the Trainer when not given.
        devices: the devices of this machine; filled in by the Trainer (``devices=N``). Under
            torchrun or SLURM the job's size comes from the launcher instead.
        bucket_cap_mb: gradient bucket size cap in MiB.
        find_unused_parameters: handle parameters that get no gradient in some steps.
        comm_hook: ``None``, ``"bf16"``, ``"fp16"`` or a callable hook (see
            :mod:`ember.parallel.comm_hooks`).
        timeout: seconds (or a timedelta) a collective may wait before failing.
        watchdog_timeout: seconds one rank may keep the others waiting in a collective before the
            watchdog stops the job, printing which rank is stuck, where, and its Python stack (see
            :mod:`ember.strategies.watchdog.watchdog`). The deadline grows to 20 times the slowest step
            seen and stays below ``timeout``; waits before a rank's first batch are left to
            ``timeout``. ``None`` turns the verdicts off (a collective that times out still names
            the rank that did not arrive).
        start_method: ``"popen"`` re-runs the script for the other ranks; ``"spawn"`` starts
            workers with multiprocessing spawn (works in notebooks; everything is pickled).
        gradient_as_bucket_view, static_graph, broadcast_buffers: passed to
            :class:`~ember.parallel.DistributedDataParallel`.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default by accelerator.
    """

    strategy_name = "ddp"

    def __init__(
        self,
        accelerator: str | None = None,
        devices: list[torch.device] | None = None,
        *,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        comm_hook: Any = None,
        timeout: float | datetime.timedelta = 1800.0,
        watchdog_timeout: float | None = 60.0,
        start_method: str = "popen",
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        broadcast_buffers: bool = True,
        process_group_backend: str | None = None,
    ) -> None:
        if start_method not in ("popen", "spawn"):
            raise ValueError(
                f"start_method={start_method!r} is not supported; use 'popen' (re-run "
                "the script, the 'ddp' default) or 'spawn' (what 'ddp_spawn' uses)."
            )
        if watchdog_timeout is False:
            watchdog_timeout = None
        if watchdog_timeout is not None and (
            isinstance(watchdog_timeout, bool)
            or not isinstance(watchdog_timeout, (int, float))
            or not watchdog_timeout > 0
        ):
            raise ValueError(
                f"watchdog_timeout={watchdog_timeout!r} is not valid: give the seconds one rank may "
                "keep the others waiting (a number > 0; the deadline grows with the slowest "
                "step), or None to turn the watchdog off."
            )
        super().__init__(accelerator=accelerator, devices=devices)
        self.start_method = start_method
        self.timeout = (
            timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=float(timeout))
        )
        self.watchdog_timeout = None if watchdog_timeout is None else float(watchdog_timeout)
        self.process_group_backend = process_group_backend
        self.ddp_kwargs = dict(
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            comm_hook=comm_hook,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            broadcast_buffers=broadcast_buffers,
        )
        self.ddp: DistributedDataParallel | None = None
        self._world: World | None = detect_world()
        self._launcher: Launcher | None = None
        self._owns_group = False
        self._buffers_stale = False
        self._trainable: list[int] = []  # ids of the parameters the reducer synchronises
        self._threads_before: int | None = None
        self._beacon = Beacon()
        self._watchdog: Watchdog | None = None
        # The group for control decisions (control.py): None is the default group. Opened once per setup.
        self._control_group: Any = None
        self._control_open = False
        # The watchdog's store in a process group the user made (``_store_of_our_own``); None: not made yet.
        self._own_store: dist.Store | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Sent to spawned workers: they find their own place in the job and their own group.
        state = dict(self.__dict__)
        state.update(
            ddp=None,
            _world=None,
            _launcher=None,
            _owns_group=False,
            _threads_before=None,
            _beacon=Beacon(),
            _watchdog=None,
            _control_group=None,
            _control_open=False,
            _own_store=None,
        )
        return state

    # ------------------------------------------------------------------ identity
    @property
    def world_size(self) -> int:
        return self._world.world_size if self._world else max(1, len(self.parallel_devices))

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def global_rank(self) -> int:
        return self._world.rank if self._world else 0

    @property
    def local_rank(self) -> int:
        return self._world.local_rank if self._world else 0

    @property
    def node_rank(self) -> int:
        return self._world.node_rank if self._world else 0

    @property
    def num_nodes(self) -> int:
        world = self._world
        if world is None or world.local_world_size <= 0:
            return 1
        return max(1, world.world_size // world.local_world_size)

    @property
    def root_device(self) -> torch.device:
        if self.accelerator != "cuda":
            return torch.device("cpu")
        devices = self.parallel_devices
        if self.local_rank < len(devices):
            return devices[self.local_rank]
        if not devices:  # not connected to a Trainer yet: nothing to choose from
            return torch.device("cuda", self.local_rank)
        # Falling back to cuda:<local_rank> would put this rank on a GPU outside ``devices``, or
        # on one that another rank already uses.
        per_machine = self._world.local_world_size if self._world else len(devices)
        raise ValueError(
            f"This process is local rank {self.local_rank} of a ddp job with {per_machine} "
            f"process(es) per machine, but devices={[d.index for d in devices]} lists only "
            f"{len(devices)} CUDA device(s), so it has no device of its own. Give one device per "
            f"process on each machine: devices={per_machine} (or a list of {per_machine} indices), "
            "or start as many processes per machine as devices (torchrun --nproc-per-node)."
        )

    @property
    def backend(self) -> str:
        return self.process_group_backend or ("nccl" if self.accelerator == "cuda" else "gloo")

    # ------------------------------------------------------------------ lifecycle
    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._world is not None:  # torchrun, SLURM, or a process ember started
            if self._launcher is None:
                self._launcher = Launcher(self._world, self.timeout)
            return self._launcher.launch(fn, *args, **kwargs)
        if self.world_size == 1:
            return run_in_this_process(fn, *args, **kwargs)
        if self.start_method == "popen":
            self._launcher = PopenLauncher(self.world_size, self.timeout)
            self._world = self._launcher.world
            return self._launcher.launch(fn, *args, **kwargs)
        # Workers start from the caller's random state, as the re-run script starts from its own:
        # a seeded caller gets the same shuffle (and dropout) streams as with "ddp" or "single".
        launcher = SpawnLauncher(self.world_size, self.timeout, dumps=dumps, loads=loads)
        value, state = launcher.launch(run_in_worker, fn, args, kwargs, capture_rng())
        adopt_worker_state(self.trainer, args, state)
        return value

    def setup_environment(self) -> None:
        if self._world is None:
            self._world = detect_world()  # a spawned worker: its rank is in the environment
        # First, and also into a group that already exists: NCCL and every CUDA call that names
        # no device use the current one, which would otherwise be cuda:0 on every rank.
        self.set_current_device()
        if not dist.is_initialized():
            self._init_group()
        # The rank-zero helpers (ember.utilities, Lightning's) read their rank from the environment when first
        # imported, which a spawned worker sets only afterwards: this process knows its rank now.
        setattr(rank_zero_only, "rank", dist.get_rank())  # noqa: B010 (an attribute of the function, untyped)
        if not self._control_open and dist.get_world_size() > 1:
            self._control_group = open_control_group(self.timeout)  # collective: every rank is here
            self._control_open = True
        self._start_watchdog()

    @property
    def _nccl_device(self) -> torch.device | None:
        """The CUDA device to bind NCCL to (None without NCCL): bound at init, NCCL never guesses
        one from the rank, which with ``devices=[1, 3]`` would touch GPU 0 and share GPU 1."""
        device = self.root_device
        return device if device.type == "cuda" and "nccl" in self.backend else None

    def _init_group(self) -> None:
        device = self._nccl_device
        import_before_the_group()  # so that the group can be freed, its threads joined (see there)
        if self._world is None:  # one process: a private 1-rank group, released at teardown
            # A store of its own: no MASTER_ADDR/MASTER_PORT needed, NCCL included.
            bind: dict[str, Any] = {"device_id": device} if device is not None else {}
            dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1, **bind)
            self._owns_group = True
        else:
            if self._launcher is None:
                self._launcher = Launcher(self._world, self.timeout)
            self._launcher.init_process_group(self.backend, device)
            self._share_cpu_threads(self._world.local_world_size)

    def _share_cpu_threads(self, local_world_size: int) -> None:
        # N processes on one machine each defaulting to every core oversubscribe it, and OpenMP's
        # spinning threads then slow a small CPU model down by 10-40x. Split the cores between the
        # local ranks, as torchrun does with OMP_NUM_THREADS, unless the user chose a number.
        if local_world_size <= 1 or self.root_device.type != "cpu":
            return
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        message = oversubscription_message(local_world_size, cores)
        if message is not None and self.local_rank == 0:
            warnings.warn(message, UserWarning, stacklevel=user_stacklevel())
        if "OMP_NUM_THREADS" in os.environ:
            return
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(max(1, cores // local_world_size))

    def setup(self, trainer: Any, module: Any) -> None:
        super().setup(trainer, module)
        if trainer.state == "fitting":
            self._wrap(module)

    def _wrap(self, module: Any) -> None:
        device_ids = [self.root_device] if self.root_device.type == "cuda" else None
        self.ddp = self._waiting(
            "the broadcast of rank 0's weights (DistributedDataParallel setup)",
            DistributedDataParallel,
            module,
            device_ids=device_ids,
            advice=unused_parameter_advice(self.start_method, warn=self.is_global_zero),
            **self.ddp_kwargs,
        )
        self._buffers_stale = False
        self._trainable = [id(p) for p in module.parameters() if p.requires_grad]

    def sync_trainable_parameters(self) -> None:
        # The reducer all-reduces the gradients of the parameters that required grad when it was
        # built; a parameter unfrozen later (BackboneFinetuning) would train on each rank's own
        # gradient and the ranks' weights would drift apart (PyTorch's DDP, and so Lightning, does
        # that silently). Once per epoch: any rank that sees a change makes every rank re-wrap.
        ddp = self.ddp
        if ddp is None:
            return
        changed = [id(p) for p in ddp.module.parameters() if p.requires_grad] != self._trainable
        if self.reduce_boolean_decision(changed, all=False):
            ddp.reducer.remove_hooks()
            self._wrap(ddp.module)

    def teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()  # kept: its deadline and slowest step stay readable
        if self.ddp is not None:
            self.ddp.reducer.remove_hooks()  # the module trains without us afterwards
            self.ddp = None
        close_control_group(self._control_group)
        self._control_group, self._control_open = None, False
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: Any, stage: Stage) -> Any:
        if self.world_size == 1:
            return super().process_dataloader(dataloader, stage)
        if stage == "fit":
            loader = make_resumable(dataloader, self._sampler_factory(even=True))
            if resumable_sampler_of(loader) is None:
                self._warn_unsharded(dataloader, stage)
            return loader
        reason = why_not_swappable(dataloader)
        if reason is not None:
            self._warn_unsharded(dataloader, stage, reason)
            return dataloader
        n = len(dataloader.dataset)
        if n < self.world_size:
            raise ValueError(
                f"The {stage} dataset has {n} samples but the job has {self.world_size} "
                "ranks; each rank needs at least one. Use fewer processes or more data."
            )
        shuffle = isinstance(dataloader.sampler, RandomSampler)
        # Validation and test shards that would yield a batch fewer than the longest get a padding
        # batch (sampler.py), so every rank runs the same steps. Predict keeps its shards as they are,
        # as Lightning does: its outputs are the dataset's, each sample once.
        batch_size = dataloader.batch_size if stage != "predict" else None
        sampler = self._sampler_factory(even=False, batch_size=batch_size, drop_last=dataloader.drop_last)(
            n, shuffle, dataloader.sampler
        )
        return rebuild_with_sampler(dataloader, sampler)

    def _sampler_factory(
        self, even: bool, batch_size: int | None = None, drop_last: bool = False
    ) -> Callable[[int, bool, Any], ShardedSampler]:
        def factory(n: int, shuffle: bool, user_sampler: Any) -> ShardedSampler:
            return ShardedSampler(
                n,
                self.world_size,
                self.global_rank,
                shuffle=shuffle,
                generator=getattr(user_sampler, "generator", None),
                even=even,
                agree=lambda seed: self.broadcast(seed, 0),
                batch_size=batch_size,
                drop_last=drop_last,
            )

        return factory

    def _warn_unsharded(self, loader: Any, stage: Stage, reason: str | None = None) -> None:
        if self.is_global_zero:
            warnings.warn(
                f"The {stage} loader cannot be sharded by ember ({reason or why_not_swappable(loader)}),"
                " so every rank iterates all of it. Shard it yourself (e.g. by "
                "trainer.global_rank / trainer.world_size), or use a plain DataLoader.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: Any, batch_idx: int, *extra: Any) -> Any:
        ddp = self.ddp
        if ddp is None:
            return super().training_step(batch, batch_idx, *extra)
        self._buffers_stale = True
        beacon = self._beacon  # what the watchdog reads: attribute stores, no communication
        beacon.batches += 1
        beacon.batch = batch_idx
        beacon.loop = "training"
        # ddp.call, in its two halves: only the first may communicate.
        step_args = self.step_args("training_step", batch, batch_idx, extra)
        args, kwargs = self._waiting(_BUFFERS, ddp.pre_forward, *step_args)
        beacon.where = TRAINING_STEP
        outputs = cast(TrainModule, ddp.module).training_step(*args, **kwargs)
        beacon.where = AFTER_STEP
        return ddp.post_forward(outputs)

    def prepare_for_evaluation(self) -> None:
        # Training forwards update buffers (BatchNorm statistics) on each rank: evaluate with
        # rank 0's, as a forward through PyTorch's wrapper would. Here rather than in the first
        # evaluation step: a rank whose loader has no batch must still join the broadcast.
        if self._buffers_stale and self.ddp is not None:
            self._buffers_stale = False
            self._waiting("the buffer broadcast before evaluation", self.ddp.sync_buffers)

    def _eval_step(self, loop: str, batch_idx: int) -> None:
        beacon = self._beacon
        beacon.batches += 1
        beacon.batch = batch_idx
        beacon.loop = loop
        beacon.where = f"{loop}_step"

    def validation_step(self, batch: Any, batch_idx: int, *extra: Any) -> Any:
        self._eval_step("validation", batch_idx)
        out = super().validation_step(batch, batch_idx, *extra)
        self._beacon.where = "the evaluation loop after validation_step"
        return out

    def test_step(self, batch: Any, batch_idx: int, *extra: Any) -> Any:
        self._eval_step("test", batch_idx)
        out = super().test_step(batch, batch_idx, *extra)
        self._beacon.where = "the evaluation loop after test_step"
        return out

    def predict_step(self, batch: Any, batch_idx: int, *extra: Any) -> Any:
        self._eval_step("predict", batch_idx)
        out = super().predict_step(batch, batch_idx, *extra)
        self._beacon.where = "the predict loop after predict_step"
        return out

    def backward(self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None) -> None:
        """Run ``backward(loss)`` (default ``loss.backward()``) with the gradient all-reduce armed
        before it and, outside ``no_backward_sync``, the beacon saying this rank waits in it."""
        run = backward or torch.Tensor.backward
        ddp = self.ddp
        if ddp is None:
            run(loss)
            return
        ddp.prepare_for_backward(loss)  # a second backward of one step syncs too
        self._run_backward(run, loss, ddp.require_backward_grad_sync, _GRADIENTS)  # (not inside no_backward_sync)

    @contextlib.contextmanager
    def no_backward_sync(self) -> Iterator[None]:
        if self.ddp is None:
            yield
            return
        with self.ddp.no_sync():
            yield
