"""Exporting a TrainModule for inference: TorchScript (``to_torchscript``) and ONNX (``to_onnx``).

Both follow Lightning's methods of the same names: the module is exported in eval mode and its
``training`` flags are put back afterwards; the example input (``input_sample`` / ``example_inputs``,
else ``module.example_input_array``) goes through ``on_before_batch_transfer`` and
``transfer_batch_to_device`` first, so it lands where the module is. While exporting, the module's
``trainer`` property returns None instead of raising outside a fit (TorchScript reads every attribute).

ONNX export needs the ``onnx`` package (and, for torch's exporter since 2.9, ``onnxscript``):
``pip install ember[onnx]``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


@contextlib.contextmanager
def exporting(module: nn.Module) -> Iterator[None]:
    """Eval mode (each submodule's ``training`` flag restored after) and the ``_exporting`` marker."""
    modes = [(m, m.training) for m in module.modules()]
    module.__dict__["_exporting"] = True
    module.eval()
    try:
        yield
    finally:
        module.__dict__.pop("_exporting", None)
        for m, flag in modes:
            m.training = flag


def _example(module: Any, given: Any, what: str, method: str) -> Any:
    sample = given if given is not None else module.example_input_array
    if sample is None:
        raise ValueError(
            f"{type(module).__name__}.{method} needs an example input: pass {what}=..., or set "
            "self.example_input_array in __init__."
        )
    sample = module.on_before_batch_transfer(sample, 0)
    return module.transfer_batch_to_device(sample, module.device, 0)


def to_torchscript(
    module: Any,
    file_path: str | os.PathLike | None = None,
    method: str = "script",
    example_inputs: Any = None,
    **kwargs: Any,
) -> Any:
    if method not in ("script", "trace"):
        raise ValueError(f"to_torchscript(method={method!r}): use 'script' or 'trace'.")
    with exporting(module):
        if method == "script":
            scripted = torch.jit.script(module, **kwargs)
        else:
            scripted = torch.jit.trace(
                module,
                example_inputs=_example(module, example_inputs, "example_inputs", "to_torchscript(method='trace')"),
                **kwargs,
            )
    if file_path is not None:
        torch.jit.save(scripted, os.fspath(file_path))
    return scripted


def to_onnx(module: Any, file_path: str | os.PathLike | None = None, input_sample: Any = None, **kwargs: Any) -> Any:
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(
            f"{type(module).__name__}.to_onnx() needs {' and '.join(missing)}: "
            "pip install 'ember[onnx]' (or pip install onnx onnxscript)."
        )
    with exporting(module), torch.no_grad():
        sample = _example(module, input_sample, "input_sample", "to_onnx")
        args = sample if isinstance(sample, tuple) else (sample,)
        return torch.onnx.export(module, args, None if file_path is None else os.fspath(file_path), **kwargs)
