"""The ``fsdp`` strategy: a model larger than one device, sharded across ranks by PyTorch's FSDP2.

Where ``ddp`` keeps a whole copy of the weights, gradients and optimizer states on every rank, ``fsdp``
keeps 1/N of each: every parameter is a ``DTensor`` sharded along its first dimension over the ranks (a
``DeviceMesh``), a layer's whole weights exist only while it computes (all-gathered before its forward and
backward, freed after), and its gradients are reduce-scattered so that each rank steps its own shard. The
engine is PyTorch's (``torch.distributed.fsdp.fully_shard`` and ``torch.distributed.checkpoint``, DCP), not
ember's: what this file adds is the strategy around it, and everything else of a fit (processes, data
sharding, ``self.log`` reductions, the watchdog, preemption) is ``ddp``'s, which this class extends.

Sharding (``setup``, in every stage): the modules the ``auto_wrap_policy`` picks (default: each child of the
module that holds parameters), deepest first, then the module itself, each become an FSDP unit. A module
whose layers ``configure_model`` built under ``trainer.init_module(empty_init=True)`` is on the meta device:
it is sharded first, then each rank materialises only its shards on its device and ``reset_parameters()``
initialises them, so no rank ever holds the whole model. The module's steps (``training_step``, ...) run as
FSDP forward methods (``register_fsdp_forward_method``), so the root's parameters are gathered around them
and the backward's reduce-scatter is finished at its end.

Mixed precision is FSDP's as well as autocast's: ``precision="bf16-mixed"`` computes with bf16 copies of the
(fp32, sharded) parameters and reduces gradients in fp32 (``MixedPrecisionPolicy``), under the same autocast
as other strategies (so losses and softmaxes still run in fp32, as in Lightning's fsdp); ``"16-mixed"`` does
the same in fp16 with a gradient scaler whose inf checks agree across the ranks.

Checkpoints (``state_dict_type``): ``"sharded"`` (default) writes a directory at the checkpoint's path, each
rank its shards (``ember/checkpoint/sharded.py``), which resumes on any number of ranks and which
``load_from_checkpoint`` reads whole in a plain process; ``"full"`` gathers every tensor to rank zero and
writes one ordinary ember checkpoint file.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist

from ember.checkpoint import sharded
from ember.checkpoint.temporaries import temporary_prefix
from ember.checkpoint.writer import BackgroundSave
from ember.strategies.ddp import DDPStrategy
from ember.strategies.watchdog.verdicts import AFTER_STEP, TRAINING_STEP

__all__ = ["FSDPStrategy"]

_STEPS = ("training_step", "validation_step", "test_step", "predict_step")
_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_GRADIENTS = "the gradient reduce-scatter (backward)"


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


class FSDPStrategy(DDPStrategy):
    """Fully sharded data parallelism on PyTorch's FSDP2 (``fully_shard``), one process per device.

    Launched as ``ddp`` is (a plain ``python script.py``, torchrun, SLURM, several nodes).

    Args:
        accelerator, devices: as :class:`~ember.strategies.DDPStrategy`.
        auto_wrap_policy: which submodules become FSDP units (sharded, and gathered one at a time): a set (or
            list) of module classes (every submodule of those classes), or a callable ``module -> bool``; None
            (default): each child of the module that holds parameters. The module itself always is one, last.
        sharding_strategy: ``"FULL_SHARD"`` (default: parameters freed after each layer's forward, gathered
            again for its backward), ``"SHARD_GRAD_OP"`` (kept gathered from forward to backward: less
            communication, more memory), ``"HYBRID_SHARD"`` (sharded inside a group of ranks, replicated across
            the groups: ``device_mesh``), ``"_HYBRID_SHARD_ZERO2"`` (both).
        device_mesh: for the hybrid strategies, ``(replicas, shards)`` with ``replicas * shards`` the world
            size; default ``(number of machines, processes per machine)``.
        cpu_offload: keep the sharded parameters, gradients and optimizer states in CPU memory (the optimizer
            steps on the CPU).
        mixed_precision: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` to use instead of the one the
            Trainer's ``precision`` implies.
        activation_checkpointing_policy: a set (or list) of module classes, or a callable ``module -> bool``:
            those submodules recompute their activations in backward instead of keeping them.
        state_dict_type: ``"sharded"`` (each rank writes its shards into a checkpoint directory) or ``"full"``
            (one file, gathered to rank zero; every rank gathers each tensor in turn).
        timeout, watchdog_timeout, start_method, process_group_backend: as
            :class:`~ember.strategies.DDPStrategy`.
    """

    strategy_name = "fsdp"
    #: Checkpoints are restored into the sharded module (Lightning's ``restore_checkpoint_after_setup``).
    restore_after_setup = True
    #: Mixed precision is applied to the module too (``MixedPrecisionPolicy``), beside autocast.
    precision_in_module = True

    def __init__(
        self,
        accelerator: str | None = None,
        devices: list[torch.device] | None = None,
        *,
        auto_wrap_policy: Iterable[type[torch.nn.Module]] | Callable[[torch.nn.Module], bool] | None = None,
        sharding_strategy: str = "FULL_SHARD",
        device_mesh: tuple[int, int] | None = None,
        cpu_offload: bool = False,
        mixed_precision: Any = None,
        activation_checkpointing_policy: Iterable[type[torch.nn.Module]]
        | Callable[[torch.nn.Module], bool]
        | None = None,
        state_dict_type: str = "sharded",
        timeout: float | datetime.timedelta = 1800.0,
        watchdog_timeout: float | None = 60.0,
        start_method: str = "popen",
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(
            accelerator,
            devices,
            timeout=timeout,
            watchdog_timeout=watchdog_timeout,
            start_method=start_method,
            process_group_backend=process_group_backend,
        )
        name = str(getattr(sharding_strategy, "name", sharding_strategy)).upper()  # a string, or torch's enum
        if name not in _SHARDING:
            raise ValueError(
                f"sharding_strategy={sharding_strategy!r} is not one fsdp offers; use one of {list(_SHARDING)}. "
                "(For no sharding at all, use strategy='ddp'.)"
            )
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(
                f"state_dict_type={state_dict_type!r} is not valid: use 'sharded' (a directory, each rank writes its "
                "shards) or 'full' (one file, gathered to rank zero)."
            )
        if device_mesh is not None and (
            not isinstance(device_mesh, tuple)
            or len(device_mesh) != 2
            or not all(isinstance(n, int) and n > 0 for n in device_mesh)
        ):
            raise ValueError(f"device_mesh must be (replicas, shards), two positive ints; got {device_mesh!r}.")
        if device_mesh is not None and not name.startswith(("HYBRID", "_HYBRID")):
            raise ValueError(
                f"device_mesh={device_mesh!r} shapes the hybrid strategies only; with sharding_strategy={name!r} "
                "every rank shards over the whole job. Pass sharding_strategy='HYBRID_SHARD', or no device_mesh."
            )
        if mixed_precision is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            if not isinstance(mixed_precision, MixedPrecisionPolicy):
                raise TypeError(
                    "mixed_precision takes a torch.distributed.fsdp.MixedPrecisionPolicy (FSDP2's), got a "
                    f"{type(mixed_precision).__name__}. Or leave it out: Trainer(precision=...) chooses one."
                )
        self.sharding_strategy = name
        self.device_mesh_shape = device_mesh
        self.auto_wrap_policy = _policy("auto_wrap_policy", auto_wrap_policy)
        self.activation_checkpointing_policy = _policy(
            "activation_checkpointing_policy", activation_checkpointing_policy
        )
        self.cpu_offload = bool(cpu_offload)
        self.mixed_precision = mixed_precision
        self.state_dict_type = state_dict_type
        self.mesh: Any = None
        self._sync = True

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["mesh"] = None
        return state

    # ------------------------------------------------------------------ sharding
    @property
    def sharded_module(self) -> Any:
        """The module, once sharded (an ``FSDPModule``: ``setup`` shards the module it takes); None before."""
        return self.module

    def place(self, module: torch.nn.Module) -> None:
        # fully_shard moves each unit's shards to the mesh's device: the whole module never goes there at once.
        pass

    def tensor_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Layers made under ``trainer.init_module(empty_init=True)`` go on the meta device (no memory), to be
        sharded and materialised by ``setup``; otherwise on the CPU, sharded as they are moved."""
        return torch.device("meta") if empty_init else contextlib.nullcontext()

    def setup(self, trainer: Any, module: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(module, FSDPModule):
            self._shard(module)
        elif self.mesh is None:  # sharded by an earlier run (a fit, then predict with another Trainer)
            self.mesh = next(
                cast(Any, p).device_mesh for p in cast(torch.nn.Module, module).parameters() if _is_dtensor(p)
            )
        super().setup(trainer, module)  # (ddp's: steps without batch_idx; nothing to wrap, see _wrap)

    def _wrap(self, module: Any) -> None:
        """No ddp wrapper: the module is sharded instead."""

    def _shard(self, module: torch.nn.Module) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method

        self.mesh = self._make_mesh()
        if self.activation_checkpointing_policy is not None:
            for sub in module.modules():
                if sub is not module and self.activation_checkpointing_policy(sub):
                    _checkpoint_activations(sub)
        options: dict[str, Any] = {
            "mesh": self.mesh,
            "reshard_after_forward": self.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD"),
            "offload_policy": CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
            if self.cpu_offload
            else OffloadPolicy(),
        }
        policy = self._mp_policy()
        if policy is not None:
            options["mp_policy"] = policy
        if self.auto_wrap_policy is None:  # default: each child that holds parameters
            units = [sub for sub in module.children() if any(True for _ in sub.parameters())]
        else:
            units = [sub for sub in _post_order(module) if sub is not module and self.auto_wrap_policy(sub)]
        for unit in units:
            fully_shard(unit, **options)
        root_options = dict(options)
        root_options.pop("reshard_after_forward")  # FSDP's default for the root: kept gathered for the backward
        fully_shard(module, **root_options)
        self._materialise(module)
        module.register_load_state_dict_pre_hook(shard_whole_weights)
        for step in _STEPS:
            if callable(getattr(module, step, None)):
                register_fsdp_forward_method(module, step)

    def _make_mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = self.root_device.type
        world = dist.get_world_size()
        if self.sharding_strategy.startswith(("HYBRID", "_HYBRID")):
            shape = self.device_mesh_shape or (self.num_nodes, world // self.num_nodes)
            if shape[0] * shape[1] != world:
                raise ValueError(
                    f"device_mesh={shape} needs {shape[0] * shape[1]} processes but the job has {world}: give "
                    "(replicas, shards) whose product is the world size."
                )
            return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))

    def _mp_policy(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.mixed_precision is not None:
            return self.mixed_precision
        precision = getattr(self.trainer, "precision", "32-true")
        dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        if dtype is None:
            return None
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    def _materialise(self, module: torch.nn.Module) -> None:
        """Each rank makes and initialises its own shards of what was built on the meta device.

        ``to_empty`` remakes every tensor of the module (FSDP re-points its shards through it), so what was not
        on the meta device (built in ``__init__``, maybe loaded) is copied aside and put back, and only the
        submodules that held meta tensors are initialised (``reset_parameters``)."""
        tensors = [*module.named_parameters(), *module.named_buffers()]
        if not any(t.is_meta for _, t in tensors):
            return
        kept = {name: t.detach().clone() for name, t in tensors if not t.is_meta}
        fresh = [
            sub
            for sub in module.modules()
            if any(t.is_meta for t in (*sub.parameters(recurse=False), *sub.buffers(recurse=False)))
        ]
        device = torch.device("cpu") if self.cpu_offload else self.root_device
        module.to_empty(device=device)
        with torch.no_grad():
            for sub in fresh:
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
            current = dict([*module.named_parameters(), *module.named_buffers()])
            for name, value in kept.items():
                current[name].copy_(value)

    # ------------------------------------------------------------------ optimizers and loading
    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        # A whole (unsharded) optimizer state, from a single-file checkpoint, is cut to this rank's shards.
        for optimizer in optimizers:
            if isinstance(optimizer, torch.optim.Optimizer):
                optimizer.register_load_state_dict_pre_hook(_shard_optimizer_state)

    def shard_like(self, value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``value`` (a whole tensor, the same on every rank) as ``like``'s layout: this rank's shard of it."""
        return _shard_like(value, like)

    def read_sharded(self, path: str) -> dict[str, Any]:
        """A sharded checkpoint's tensors as this rank's shards: DCP reads only them (resharding when the
        checkpoint was written by another number of ranks)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor import empty as dtensor_empty

        mesh = self.mesh
        if mesh is None:
            return super().read_sharded(path)
        placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
        device = torch.device("cpu") if self.cpu_offload else self.root_device

        def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if not shape:  # a scalar cannot be sharded: whole on every rank
                return torch.empty((), dtype=dtype, device=device)
            return dtensor_empty(shape, dtype=dtype, device_mesh=mesh, placements=placements)

        return sharded.read(path, make, process_group=self._control_group)

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: Any, batch_idx: int, *extra: Any) -> Any:
        beacon = self._beacon  # what the watchdog reads: attribute stores only
        beacon.batches += 1
        beacon.batch = batch_idx
        beacon.loop = "training"
        beacon.where = TRAINING_STEP
        out = super().training_step(batch, batch_idx, *extra)
        beacon.where = AFTER_STEP
        return out

    def backward(self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None) -> None:
        run = backward or torch.Tensor.backward
        self._run_backward(run, loss, self.sharded_module is not None and self._sync, _GRADIENTS)

    @contextlib.contextmanager
    def no_backward_sync(self) -> Iterator[None]:
        root = self.sharded_module
        if root is None:
            yield
            return
        # Gradients accumulate unsharded on each rank; the window's last backward reduce-scatters them.
        root.set_requires_gradient_sync(False)
        self._sync = False
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)
            self._sync = True

    # ------------------------------------------------------------------ checkpoints
    def whole_state_dict(self) -> dict[str, Any]:
        """The module's weights gathered whole on every rank (a collective per sharded tensor, in turn)."""
        return {k: (cast(Any, v).full_tensor() if _is_dtensor(v) else v) for k, v in self.model_state_dict().items()}

    @property
    def background_saves(self) -> bool:
        """A sharded checkpoint is written by every rank at once; a full one can go to the background writer."""
        return self.state_dict_type == "full"

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str,
        storage_options: BackgroundSave | None = None,
        before_rename: Callable[[str], None] | None = None,
    ) -> None:
        """``"full"``: every sharded tensor gathered whole to the CPU (each in turn, on every rank), then rank
        zero writes one file as other strategies do. ``"sharded"``: a checkpoint directory, each rank writing
        its own shards (``ember/checkpoint/sharded.py``), at once (``background_saves`` is False)."""
        if self.state_dict_type == "full":
            whole, shards = sharded.split(checkpoint, _is_dtensor)
            gathered = {}
            for key, tensor in shards.items():
                full = cast(Any, tensor).full_tensor()  # a collective: every rank, in the same order
                if self.is_global_zero:
                    gathered[key] = full.cpu()
            if self.is_global_zero:
                super().save_checkpoint(sharded.fill(whole, gathered), path, storage_options, before_rename)
            return
        if storage_options is not None:
            raise ValueError(
                "fsdp with state_dict_type='sharded' writes its checkpoints at once, every rank its shards: a "
                "BackgroundSave (storage_options) cannot be honoured. Pass storage_options=None, or use "
                "state_dict_type='full' to write one file in the background."
            )
        plain, shards = sharded.split(checkpoint, _is_dtensor)
        temporary = self.broadcast(
            os.path.join(os.path.dirname(path), f"{temporary_prefix(path)}{os.urandom(4).hex()}.tmp")
        )
        sharded.write(
            plain,
            shards,
            path,
            temporary,
            is_writer=self.is_global_zero,
            barrier=self.barrier,
            process_group=self._control_group,
            before_rename=before_rename,
        )


# ---------------------------------------------------------------------------------------------- helpers
def _policy(what: str, value: Any) -> Callable[[torch.nn.Module], bool] | None:
    if value is None:
        return None
    if isinstance(value, type) and issubclass(value, torch.nn.Module):
        value = {value}
    if isinstance(value, (set, frozenset, list, tuple)):
        classes = tuple(value)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, torch.nn.Module))]
        if bad:
            raise TypeError(f"{what} takes torch.nn.Module classes; {bad!r} are not.")
        return lambda module: isinstance(module, classes)
    if callable(value):
        if _positional_parameters(value) >= 3:  # FSDP1's policy signature, as Lightning users pass it
            return lambda module: bool(value(module, False, sum(p.numel() for p in module.parameters())))
        return value
    raise TypeError(
        f"{what} must be a set of torch.nn.Module classes or a callable module -> bool, got {type(value).__name__}."
    )


def _positional_parameters(fn: Callable[..., Any]) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _post_order(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Every submodule, children before their parents (FSDP shards the inner units first)."""
    out: list[torch.nn.Module] = []
    for child in module.children():
        out.extend(_post_order(child))
    out.append(module)
    return out


def _checkpoint_activations(module: torch.nn.Module) -> None:
    """``module`` recomputes its forward in backward (torch.utils.checkpoint, non-reentrant), its names kept."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def _shard_like(value: torch.Tensor, like: Any) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    if not _is_dtensor(like) or _is_dtensor(value) or not isinstance(value, torch.Tensor):
        return value
    local = value.to(device=like.device_mesh.device_type if like.device.type != "meta" else "cpu")
    # Every rank holds the whole value: each keeps its own piece, with no communication.
    return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)


def _shard_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = state_dict.get("state") or {}
    for pid, entries in state.items():
        if not isinstance(pid, int) or pid >= len(params) or not isinstance(entries, dict):
            continue
        param = params[pid]
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
                entries[name] = _shard_like(value, param)
    return state_dict


def shard_whole_weights(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """A load_state_dict pre-hook of the sharded module: whole tensors (a single-file checkpoint, a user's
    ``state_dict``) become this rank's shards of the parameters they load into."""
    current = module.state_dict(keep_vars=True)
    for key, value in list(state_dict.items()):
        name = key[len(prefix) :] if key.startswith(prefix) else key
        like = current.get(name)
        if like is not None and isinstance(value, torch.Tensor):
            state_dict[key] = _shard_like(value, like)
