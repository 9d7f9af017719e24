"""The Strategy base class: the verbs the Trainer uses to place, run and synchronise a module.

A strategy owns *where* work happens (devices, processes) and *how* gradients and values are
combined across replicas. The loop in ``ember/trainer/loops.py`` only ever talks to these verbs,
so a new way of parallelising training is a new subclass registered by name (see ``registry.py``).
Single-process versions of the collective verbs are identities.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ember.checkpoint import sharded
from ember.checkpoint.background import BackgroundWriter
from ember.checkpoint.writer import BackgroundSave, CheckpointWriter
from ember.data.resumable import make_resumable
from ember.module import takes_batch_idx, takes_dataloader_iter
from ember.strategies.control import Decision, DecisionMode, check_decision_mode
from ember.strategies.launchers.interrupt import run_in_this_process
from ember.types import REDUCE_OPS, ReduceOp, Stage
from ember.utils import metric_batch_value, move_to_device

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer

T = TypeVar("T")
_STEPS = ("training_step", "validation_step", "test_step", "predict_step")


class Strategy:
    """Base class of every strategy.

    Subclasses override what differs from a single process on a single device; every method
    here is a correct single-process implementation.

    Args:
        accelerator: ``"cpu"`` or ``"cuda"``; filled in by the Trainer when not given.
        devices: the device list this strategy runs on; filled in by the Trainer when not given.
    """

    #: The registry name; set by ``register_strategy``.
    strategy_name: str = "base"
    #: Writes checkpoints on global rank zero, at once (``ember.checkpoint.writer``). Stateless, so one
    #: instance may serve every strategy; a strategy writing elsewhere sets its own.
    checkpoint_writer: CheckpointWriter = CheckpointWriter()
    _background_writer: BackgroundWriter | None = None
    #: Whether a resume loads the module's weights after ``setup`` (a strategy that changes the module's
    #: parameters, as fsdp shards them) rather than before it (Lightning's ``restore_checkpoint_after_setup``).
    restore_after_setup: bool = False
    #: Whether the strategy applies mixed precision to the module too (fsdp's ``MixedPrecisionPolicy``).
    precision_in_module: bool = False

    def __init__(self, accelerator: str | None = None, devices: list[torch.device] | None = None) -> None:
        self.accelerator = accelerator
        self.parallel_devices: list[torch.device] = list(devices) if devices else []
        self.trainer: Trainer | None = None
        self.module: TrainModule | None = None
        self._without_batch_idx: frozenset[str] = frozenset()

    # ------------------------------------------------------------------ placement and identity
    def connect(self, trainer: Trainer, accelerator: str, devices: list[torch.device]) -> None:
        """Called by the Trainer once it has resolved the accelerator and the device list."""
        self.trainer = trainer
        if self.accelerator is None:
            self.accelerator = accelerator
        if not self.parallel_devices:
            self.parallel_devices = devices

    @property
    def root_device(self) -> torch.device:
        """The device that holds the module's master copy and where batches are sent."""
        return self.parallel_devices[0] if self.parallel_devices else torch.device("cpu")

    @property
    def world_size(self) -> int:
        return 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """``num_replicas`` / ``rank`` of a ``DistributedSampler`` for this process; None when one process
        reads all the data."""
        return None

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def num_nodes(self) -> int:
        """The machines of the job (1 but for multi-process strategies started on several)."""
        return 1

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    # ------------------------------------------------------------------ lifecycle
    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` in every process of the job and return rank zero's result.

        Single-process strategies just call it (Ctrl-C then ends the script in one line, as under ddp);
        multi-process strategies start or join workers.
        """
        return run_in_this_process(fn, *args, **kwargs)

    def setup_environment(self) -> None:
        """Prepare the process (e.g. join a process group). Called before ``setup``.

        On CUDA this makes the root device the current one, so that work which names no device
        (``torch.cuda.*`` calls, a ``"cuda"`` tensor in a hook, NCCL) lands on it, not on GPU 0.
        """
        self.set_current_device()

    def set_current_device(self) -> None:
        """Make the root device CUDA's current device (nothing on other devices, or for a bare
        ``"cuda"``, which means the current device already)."""
        device = self.root_device
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)

    def setup(self, trainer: Trainer, module: TrainModule) -> None:
        """Move ``module`` to the root device and prepare it for this strategy."""
        self.module = module
        self.place(module)
        # As Lightning: a step defined without batch_idx (``def training_step(self, batch)``) gets none, and
        # one that takes ``dataloader_iter`` gets the iterator alone.
        self._without_batch_idx = frozenset(
            name
            for name in _STEPS
            if callable(step := getattr(module, name, None))
            and (not takes_batch_idx(step) or takes_dataloader_iter(step))
        )

    def place(self, module: torch.nn.Module) -> None:
        """Move ``module`` to where it runs (the root device)."""
        module.to(self.root_device)

    def tensor_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Where ``trainer.init_module()`` creates tensors: on the root device (``empty_init`` matters only to
        strategies that shard, which create them on the meta device and materialise their own shards)."""
        return self.root_device

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Called with the optimizers ``configure_optimizers`` returned, once per fit, before any resume loads
        their states (a strategy that shards registers how a whole state is cut to shards)."""

    def passes_batch_idx(self, step: str) -> bool:
        """Whether the module's ``step`` takes ``(batch, batch_idx, ...)`` (not a step defined without
        ``batch_idx``, nor one that fetches its own batches from ``dataloader_iter``)."""
        return step not in self._without_batch_idx

    def step_args(self, step: str, batch: Any, batch_idx: int, extra: tuple[Any, ...]) -> tuple[Any, ...]:
        """The positional arguments the module's ``step`` takes: ``(batch, batch_idx, *extra)``, or
        ``(batch, *extra)`` for a step defined without ``batch_idx``."""
        if step in self._without_batch_idx:
            return (batch, *extra)
        return (batch, batch_idx, *extra)

    def teardown(self) -> None:
        """Release what ``setup`` and ``setup_environment`` acquired. Must be safe to call twice."""

    def sync_trainable_parameters(self) -> None:
        """Called on every process when each training epoch starts, after ``on_train_epoch_start`` (where
        finetuning callbacks freeze and unfreeze): a strategy that synchronises gradients takes in the
        parameters that require grad now. Nothing to do in one process."""

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: Any, stage: Stage) -> Any:
        """Return the loader to iterate for ``stage`` ("fit", "validate", "test", "predict").

        For "fit", a plain DataLoader gets a resumable sampler (same order, batch size, workers,
        collate and drop_last) so a checkpoint can continue an epoch where it stopped.
        """
        if stage == "fit":
            return make_resumable(dataloader)
        return dataloader

    def batch_to_device(self, batch: Any) -> Any:
        """Move every tensor in ``batch`` to the root device."""
        return move_to_device(batch, self.root_device)

    def moves_batches(self) -> bool:
        """Whether :meth:`batch_to_device` may have anything to do; False when no batch can hold a tensor off
        this strategy's devices (the loops then skip the transfer). Asked once per loop."""
        return True

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: Any, batch_idx: int, *extra: Any) -> Any:
        if "training_step" in self._without_batch_idx:  # (inline: this runs every training batch)
            return self.module.training_step(batch, *extra)  # type: ignore[union-attr]
        return self.module.training_step(batch, batch_idx, *extra)  # type: ignore[union-attr]

    def validation_step(self, batch: Any, batch_idx: int, *extra: Any) -> Any:
        return self.module.validation_step(*self.step_args("validation_step", batch, batch_idx, extra))  # type: ignore[union-attr]

    def test_step(self, batch: Any, batch_idx: int, *extra: Any) -> Any:
        return self.module.test_step(*self.step_args("test_step", batch, batch_idx, extra))  # type: ignore[union-attr]

    def predict_step(self, batch: Any, batch_idx: int, *extra: Any) -> Any:
        return self.module.predict_step(*self.step_args("predict_step", batch, batch_idx, extra))  # type: ignore[union-attr]

    def prepare_for_evaluation(self) -> None:
        """Called on every process before an evaluation or predict loop, however many batches it runs.

        It may therefore communicate (a per-step hook would not be reached on a process without batches).
        """

    def backward(self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None) -> None:
        """Run ``backward(loss)`` (default ``loss.backward()``) with this strategy's framing.

        ``backward`` is how the gradients are computed, e.g. the module's
        :meth:`~ember.module.TrainModule.backward` override: a subclass does what it must before
        and after it (arming and waiting for a gradient all-reduce) and calls it exactly once.
        Runs every training step.
        """
        (backward or torch.Tensor.backward)(loss)

    @contextlib.contextmanager
    def no_backward_sync(self) -> Iterator[None]:
        """Within this context, backward does not synchronise gradients across replicas."""
        yield

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None, **kwargs: Any
    ) -> Any:
        """Step ``optimizer`` (with ``closure`` when given); ``kwargs`` go on to its ``step``, as Lightning's.

        The closure goes by keyword, as Lightning passes it: an optimizer (or a mock of one) sees
        ``step(closure=...)``."""
        return optimizer.step(closure=closure, **kwargs) if closure is not None else optimizer.step(**kwargs)

    def metric_batch_value(self, metric: Any) -> Any:
        """The value ``self.log(name, metric)`` publishes for the step: what the torchmetrics Metric's last
        ``forward`` returned for its batch, None after ``update`` alone."""
        return metric_batch_value(metric)

    # ------------------------------------------------------------------ collectives
    def reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        """Reduce ``tensor`` across all processes with ``op`` ("mean", "sum", "min", "max")."""
        if op not in REDUCE_OPS:
            raise ValueError(f"reduce op must be one of {REDUCE_OPS}, got {op!r}")
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        """Every process's ``tensor``, stacked along a new first dimension (Lightning's ``strategy.all_gather``).

        In one process it is ``tensor`` itself, without the new dimension, as in Lightning.

        Args:
            tensor: the same shape and dtype on every process.
            group: the process group (None: all processes).
            sync_grads: let gradients flow back through the gather to every process's ``tensor``.
        """
        return tensor

    def gather_per_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[world_size, *tensor.shape]``: every process's ``tensor`` by rank, in one process too (detached)."""
        if self.world_size == 1:
            return torch.as_tensor(tensor).detach().unsqueeze(0)
        return self.all_gather(tensor)

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Return rank ``src``'s ``obj`` on every process."""
        return obj

    def barrier(self, name: str | None = None) -> None:
        """Wait until every process reaches this point."""

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree on a boolean across processes: ``all`` ranks must say yes, or ``any`` rank."""
        return decision

    def start_decision(self, decision: bool, mode: DecisionMode = "any") -> Decision:
        """Start agreeing on a boolean across processes without waiting for the others.

        For decisions taken at step boundaries (stop on a signal, save on rank zero's clock): the
        collective runs on the CPU control group in the background (``ember/strategies/control.py``),
        and ``result()`` on the returned :class:`~ember.strategies.control.Decision`, called by every
        process at the same later point, returns the agreed value. Every process must start the same
        decisions in the same order. In one process the result is ``decision`` itself.

        Args:
            decision: this process's answer.
            mode: ``"all"`` (every process must say yes), ``"any"`` (one is enough) or
                ``"rank_zero"`` (global rank zero's answer counts).
        """
        check_decision_mode(mode)
        return Decision(bool(decision))

    # ------------------------------------------------------------------ checkpoints
    @property
    def background_writer(self) -> BackgroundWriter:
        """The writer of the saves that ask to be written on a thread (``BackgroundSave``; made on first
        use, kept for the copy buffers it reuses). Every save waits for its write in flight first."""
        if self._background_writer is None:
            self._background_writer = BackgroundWriter()
        return self._background_writer

    @property
    def background_saves(self) -> bool:
        """Whether this strategy can write a checkpoint in the background (``ModelCheckpoint(async_save=True)``
        writes at once where it cannot)."""
        return True

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str,
        storage_options: BackgroundSave | None = None,
        before_rename: Callable[[str], None] | None = None,
    ) -> None:
        """Write ``checkpoint`` to ``path`` on global rank zero only: with :attr:`checkpoint_writer`, or
        with :attr:`background_writer` when ``storage_options`` is a ``BackgroundSave`` (then with its
        ``after`` and ``on_done``, and marked ``submitted``)."""
        if not self.is_global_zero:
            return
        if storage_options is None:
            self.checkpoint_writer.write(checkpoint, path, before_rename)
            return
        storage_options.submitted = True
        self.background_writer.write(
            checkpoint, path, before_rename, after=storage_options.after, on_done=storage_options.on_done
        )

    def read_sharded(self, path: str) -> dict[str, Any]:
        """A sharded checkpoint directory (``ember/checkpoint/sharded.py``) as one dict: here whole tensors on
        the CPU, read by this process alone; a sharded strategy reads only its own shards."""
        return sharded.read(path)

    def whole_state_dict(self) -> dict[str, Any]:
        """The module's weights as whole tensors, for a process without this strategy's processes (what
        ``ddp_spawn``'s workers hand back). A sharding strategy gathers them: call it on every process."""
        return self.model_state_dict()

    def model_state_dict(self) -> dict[str, Any]:
        """The state dict of the user's module (unwrapped)."""
        return self.module.state_dict()  # type: ignore[union-attr]
