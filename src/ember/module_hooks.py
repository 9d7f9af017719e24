"""Two groups of TrainModule's hooks, with their defaults, and a group of its properties, that
:class:`~ember.module.TrainModule` inherits:

- :class:`DataHooks` (Lightning's ``DataHooks``): where the module's loaders come from, and how a
  batch reaches the device;
- :class:`ModeHooks`: the module's mode around evaluation (eval before it, each submodule's own
  ``training`` flag back after it: :func:`restore_modes`, which the evaluation loop runs too);
- :class:`PlacementProperties`: ``device``, ``dtype`` (tracked as Lightning's ``DeviceDtypeModuleMixin``
  tracks it), ``on_gpu`` and ``local_rank``.

The Trainer calls only the hooks a subclass defines (``ember.overrides.defines_hook``); otherwise it does
the same work inline. The lifecycle hooks (``setup``, ``on_fit_start``, ...) stay in TrainModule's own
class body (``module.py``), where the tests' hook lists read them (``vars(TrainModule)``).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from ember.batches import move_to_device


class DataHooks:
    """The loader hooks (a subclass defines the ones it uses) and the batch-transfer hooks."""

    # The loaders, when neither fit's arguments nor a datamodule give them. The Trainer calls only the ones
    # a subclass defines (as Lightning, whose DataHooks define them too, so that hook lists name them).
    def train_dataloader(self) -> Any:
        """The training loader (any iterable of batches), requested once per fit after the sanity check."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no train_dataloader(); define it, or pass train_dataloaders to fit."
        )

    def val_dataloader(self) -> Any:
        """One validation loader or a list of them, requested when the sanity check starts (or after the
        training loader). An empty list: this fit does not validate (None is refused, as in Lightning)."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no val_dataloader(); define it, or pass val_dataloaders to fit."
        )

    def test_dataloader(self) -> Any:
        """One test loader or a list of them, requested when ``trainer.test`` starts."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no test_dataloader(); define it, or pass dataloaders to test."
        )

    def predict_dataloader(self) -> Any:
        """One predict loader or a list of them, requested when ``trainer.predict`` starts."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no predict_dataloader(); define it, or pass dataloaders to predict."
        )

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change the batch before it is moved to the device; return it."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move ``batch`` to ``device`` (default: every tensor in nested lists, tuples and dicts)."""
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change the batch after it was moved to the device; return it."""
        return batch


class ModeHooks(nn.Module):
    """The hooks that put the module in eval mode before an evaluation (releasing its gradients first, in a
    fit's validation), and back after it."""

    def on_validation_model_zero_grad(self) -> None:
        """Before a validation inside fit (outside an accumulation window): release the gradients
        (``zero_grad()``, whose default sets them to None)."""
        self.zero_grad()

    def on_validation_model_eval(self) -> None:
        """Put the module in eval mode before validation (default: ``self.eval()``)."""
        self.eval()

    def on_validation_model_train(self) -> None:
        """After validation; by default every submodule gets back its own previous ``training`` flag."""
        restore_modes(self)

    def on_test_model_eval(self) -> None:
        self.eval()

    def on_test_model_train(self) -> None:
        restore_modes(self)

    def on_predict_model_eval(self) -> None:
        self.eval()


_P = TypeVar("_P", bound="PlacementProperties")


class PlacementProperties(nn.Module):
    """``device``, ``dtype``, ``on_gpu`` and ``local_rank``, as Lightning's ``LightningModule`` has them.

    ``dtype`` is tracked rather than read from the parameters, as in Lightning: the default dtype when the
    module was built, then whatever ``to(dtype)`` / ``to(tensor)``, ``type``, ``float``, ``double`` or
    ``half`` last set, on this module and every TrainModule inside it (``bfloat16()`` does not change it,
    as in Lightning).
    """

    #: Properties TorchScript must not compile (TrainModule adds these to its own list).
    PLACEMENT_PROPERTIES = ["device", "dtype", "on_gpu", "local_rank", "device_mesh"]

    def __init__(self) -> None:
        super().__init__()
        self._dtype: torch.dtype | str = torch.get_default_dtype()

    @property
    def dtype(self) -> torch.dtype | str:
        """The dtype last given to ``to`` / ``type`` / ``float`` / ``double`` / ``half`` (at first, the default
        dtype); a string when ``type`` was given one."""
        return self.__dict__.get("_dtype", torch.get_default_dtype())

    @dtype.setter
    def dtype(self, new_dtype: torch.dtype | str) -> None:
        raise RuntimeError(
            f"Cannot set {type(self).__name__}.dtype to {new_dtype!r} directly: convert the module instead, "
            "with module.to(dtype) (or .double(), .half(), .float())."
        )

    @property
    def device(self) -> torch.device:
        """The device of the module's first parameter or buffer (CPU for a module with none)."""
        for param in self.parameters():
            return param.device
        for buf in self.buffers():
            return buf.device
        return torch.device("cpu")

    @property
    def on_gpu(self) -> bool:
        """Whether the module is on a CUDA device (``self.device.type == "cuda"``)."""
        return self.device.type == "cuda"

    @property
    def device_mesh(self) -> Any:
        """The ``DeviceMesh`` the Trainer's strategy shards the module over (``strategy="fsdp"``, once its
        ``setup`` has run; None otherwise)."""
        trainer = self.__dict__.get("_trainer")
        return getattr(trainer.strategy, "mesh", None) if trainer is not None else None

    @property
    def local_rank(self) -> int:
        """The index of this process on its machine (the Trainer's ``local_rank``; 0 without a Trainer)."""
        trainer = self.__dict__.get("_trainer")
        return int(trainer.local_rank) if trainer is not None else 0

    def to(self: _P, *args: Any, **kwargs: Any) -> _P:
        """See :meth:`torch.nn.Module.to`; a dtype (or a tensor's) given becomes ``dtype``."""
        out = super().to(*args, **kwargs)
        dtype = kwargs.get("dtype")
        for arg in (*args, kwargs.get("tensor")):
            if isinstance(arg, torch.dtype):
                dtype = arg
            elif isinstance(arg, torch.Tensor):
                dtype = arg.dtype
        _set_dtype(self, dtype)
        return out

    def type(self: _P, dst_type: torch.dtype | str) -> _P:
        """See :meth:`torch.nn.Module.type`; ``dst_type`` becomes ``dtype``."""
        out = super().type(dst_type)
        _set_dtype(self, dst_type)
        return out

    def float(self: _P) -> _P:
        """See :meth:`torch.nn.Module.float`; ``dtype`` becomes ``torch.float32``."""
        out = super().float()
        _set_dtype(self, torch.float32)
        return out

    def double(self: _P) -> _P:
        """See :meth:`torch.nn.Module.double`; ``dtype`` becomes ``torch.float64``."""
        out = super().double()
        _set_dtype(self, torch.float64)
        return out

    def half(self: _P) -> _P:
        """See :meth:`torch.nn.Module.half`; ``dtype`` becomes ``torch.float16``."""
        out = super().half()
        _set_dtype(self, torch.float16)
        return out


def _set_dtype(root: nn.Module, dtype: torch.dtype | str | None) -> None:
    """Record ``dtype`` on ``root`` and on every module inside it that tracks one (nothing for None)."""
    if dtype is None:
        return
    for module in root.modules():
        if isinstance(module, PlacementProperties):
            module.__dict__["_dtype"] = dtype


def restore_modes(module: nn.Module) -> None:
    """Give every submodule the ``training`` flag saved by the loop before evaluation."""
    saved = getattr(module, "_ember_saved_modes", None)
    if saved is None:
        module.train()
        return
    for m, flag in saved:
        m.training = flag
