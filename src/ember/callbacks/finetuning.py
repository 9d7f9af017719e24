"""BaseFinetuning: freeze part of a model before training and unfreeze it on a schedule, as Lightning's.

A subclass says what to freeze (``freeze_before_training``, called in ``setup``) and what to do when
each epoch starts (``finetune_function``, usually ``unfreeze_and_add_param_group`` at some epoch).
Unfreezing adds a parameter group to the optimizer, so the optimizer a checkpoint saved has more
groups than the one ``configure_optimizers`` builds when the run resumes. This callback therefore
saves every optimizer's groups (parameters by name, and each group's settings) in its state, and
puts them back in ``on_fit_start``, before the optimizers' state is loaded; it also saves which
parameters were frozen and which BatchNorm layers stopped tracking statistics, so a resumed run
trains exactly the parameters the interrupted one did.

Two details differ from Lightning, both on the side of the user: a parameter counts as "already in
the optimizer" by identity (Lightning compares values with ``torch.equal``, so a fresh bias of zeros
can be taken for another one and silently left out), and the frozen/trainable flags are restored
on resume (Lightning restores the groups but leaves a module unfrozen in an earlier epoch frozen).
"""

from __future__ import annotations

import warnings
from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module, ModuleDict
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer

from ember.callbacks.callback import Callback
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer
    from ember.types import Stage

Modules = Module | Iterable[Module | Iterable]


class BaseFinetuning(Callback):
    """Base class for finetuning callbacks: override ``freeze_before_training`` and ``finetune_function``.

    Build the optimizer in ``configure_optimizers`` from the trainable parameters only
    (``filter(lambda p: p.requires_grad, self.parameters())``): the frozen ones join it, in a group of
    their own, when ``unfreeze_and_add_param_group`` unfreezes them.

    Example::

        class Unfreeze(BaseFinetuning):
            def freeze_before_training(self, module):
                self.freeze(module.backbone)

            def finetune_function(self, module, epoch, optimizer):
                if epoch == 5:
                    self.unfreeze_and_add_param_group(module.backbone, optimizer, lr=1e-4)
    """

    def __init__(self) -> None:
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}
        self._restarting = False
        self._restored_flags: dict[str, Any] | None = None
        self._module: Module | None = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"internal_optimizer_metadata": self._internal_optimizer_metadata}
        if self._module is not None:
            state["frozen_parameters"] = [n for n, p in self._module.named_parameters() if not p.requires_grad]
            state["untracked_batchnorms"] = [
                n for n, m in self._module.named_modules() if isinstance(m, _BatchNorm) and not m.track_running_stats
            ]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restarting = True
        self._internal_optimizer_metadata = dict(state_dict.get("internal_optimizer_metadata", {}))
        if "frozen_parameters" in state_dict:
            self._restored_flags = {k: set(state_dict[k]) for k in ("frozen_parameters", "untracked_batchnorms")}

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, module: TrainModule, stage: Stage) -> None:
        self._module = module
        self.freeze_before_training(module)

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        if not self._restarting:
            return
        self._restarting = False
        named = dict(module.named_parameters())
        for opt_idx, optimizer in enumerate(trainer.optimizers):
            groups = self._internal_optimizer_metadata.get(opt_idx)
            if groups:
                missing = sorted({n for g in groups for n in g["params"]} - set(named))
                if missing:
                    raise ValueError(
                        f"{type(self).__name__} cannot restore optimizer {opt_idx}'s parameter groups "
                        f"from the checkpoint: the module has no parameters named {missing[:5]}. Resume "
                        "with the module that wrote the checkpoint."
                    )
                optimizer.param_groups = self._apply_mapping_to_param_groups(groups, named)
        flags, self._restored_flags = self._restored_flags, None
        if flags is not None:
            for name, param in named.items():
                param.requires_grad = name not in flags["frozen_parameters"]
            for name, mod in module.named_modules():
                if isinstance(mod, _BatchNorm):
                    mod.track_running_stats = name not in flags["untracked_batchnorms"]

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        for opt_idx, optimizer in enumerate(trainer.optimizers):
            num_param_groups = len(optimizer.param_groups)
            self.finetune_function(module, trainer.current_epoch, optimizer)
            self._store(module, opt_idx, num_param_groups, optimizer.param_groups)

    # ------------------------------------------------------------------ what a subclass defines
    def freeze_before_training(self, pl_module: TrainModule) -> None:
        """Freeze what trains later (``self.freeze(pl_module.backbone)``). Called in ``setup``."""
        raise NotImplementedError(f"{type(self).__name__} must define freeze_before_training(module).")

    def finetune_function(self, pl_module: TrainModule, epoch: int, optimizer: Optimizer) -> None:
        """Called when each epoch starts, once per optimizer: unfreeze or change learning rates here."""
        raise NotImplementedError(f"{type(self).__name__} must define finetune_function(module, epoch, optimizer).")

    # ------------------------------------------------------------------ helpers (Lightning's static API)
    @staticmethod
    def flatten_modules(modules: Modules) -> list[Module]:
        """The leaf modules of ``modules`` (a module, a ModuleDict, or nested iterables of them), plus the
        parents that hold parameters of their own."""
        if isinstance(modules, ModuleDict):
            modules = modules.values()
        if isinstance(modules, Iterable):
            found: list[Module] = []
            for m in modules:
                found.extend(BaseFinetuning.flatten_modules(m))
            candidates: Iterable[Module] = found
        else:
            candidates = modules.modules()
        # Leaves, and modules holding parameters of their own beside their children (Lightning: ``m._parameters``).
        return [m for m in candidates if not list(m.children()) or next(m.parameters(recurse=False), None) is not None]

    @staticmethod
    def filter_params(
        modules: Modules, train_bn: bool = True, requires_grad: bool = True
    ) -> Generator[torch.nn.Parameter, None, None]:
        """The parameters of ``modules`` whose ``requires_grad`` equals ``requires_grad`` (BatchNorm's
        left out when ``train_bn`` is False)."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and not train_bn:
                continue
            for param in mod.parameters(recurse=False):  # a parent's children are visited on their own
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Unfreeze every parameter of ``modules`` (BatchNorm layers track statistics again)."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm):
                mod.track_running_stats = True
            for param in mod.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: Module) -> None:
        """Freeze ``module``'s own parameters (a BatchNorm layer also stops tracking statistics)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze ``modules``; with ``train_bn`` their BatchNorm layers stay trainable."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(mod)
            else:
                BaseFinetuning.freeze_module(mod)

    @staticmethod
    def filter_on_optimizer(optimizer: Optimizer, params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """``params`` less those already in one of ``optimizer``'s groups (warned: they stay where they are)."""
        present = {id(p) for group in optimizer.param_groups for p in group["params"]}
        out: list[torch.nn.Parameter] = []
        removed: list[torch.nn.Parameter] = []
        for param in params:
            (removed if id(param) in present else out).append(param)
        if removed:
            warnings.warn(
                f"{len(removed)} of the parameters to add are already in a parameter group of "
                f"{type(optimizer).__name__}; they keep that group's settings. To give them the new "
                "group's, build the optimizer in configure_optimizers from the trainable parameters only: "
                f"{type(optimizer).__name__}(filter(lambda p: p.requires_grad, self.parameters()), ...).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        return out

    @staticmethod
    def unfreeze_and_add_param_group(
        modules: Modules,
        optimizer: Optimizer,
        lr: float | None = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        """Unfreeze ``modules`` and add their parameters to ``optimizer`` as a new group.

        Args:
            lr: the new group's learning rate; by default the first group's divided by ``initial_denom_lr``.
            initial_denom_lr: see ``lr``.
            train_bn: also train (and add) the BatchNorm layers' parameters.
        """
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_on_optimizer(
            optimizer, BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        )
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})

    # ------------------------------------------------------------------ the groups, by parameter name
    @staticmethod
    def _apply_mapping_to_param_groups(param_groups: list[dict[str, Any]], mapping: dict) -> list[dict[str, Any]]:
        out = []
        for group in param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            settings["params"] = [mapping[p] for p in group["params"]]
            out.append(settings)
        return out

    def _store(
        self, module: Module, opt_idx: int, num_param_groups: int, current_param_groups: list[dict[str, Any]]
    ) -> None:
        mapping = {p: n for n, p in module.named_parameters()}
        if opt_idx not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[opt_idx] = self._apply_mapping_to_param_groups(
                current_param_groups, mapping
            )
        elif num_param_groups != len(current_param_groups):  # groups added at this epoch
            self._internal_optimizer_metadata[opt_idx].extend(
                self._apply_mapping_to_param_groups(current_param_groups[num_param_groups:], mapping)
            )
