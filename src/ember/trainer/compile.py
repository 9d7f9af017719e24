"""``trainer.fit(torch.compile(module))``: train the module inside a ``torch.compile`` result, compiled.

``torch.compile(module)`` returns a ``torch._dynamo.OptimizedModule`` that wraps the TrainModule but is
not one. As Lightning does (``from_compiled``), the Trainer takes the wrapped module back and replaces,
on that instance, ``forward`` and the four ``*_step`` methods with their compiled versions (the same
compile settings, from the wrapper's ``dynamo_ctx``). Everything else stays the module's own: the
strategy moves and wraps it as usual, so under ``ddp`` the gradient hooks sit on its parameters
before any compiled step runs, and its ``state_dict`` has the plain keys, so its checkpoints load into
an uncompiled module. ``to_uncompiled`` puts the original methods back.

``dp`` refuses a compiled module (as Lightning's strategies other than single / ddp / fsdp do): its
replicas are shallow copies that would share the original's compiled methods, bound to the original.
"""

from __future__ import annotations

from typing import Any

from ember.module import TrainModule

_CTX = "_ember_compiler_ctx"
_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")


def _optimized_module_class() -> Any:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch build without dynamo: nothing can be compiled
        return None
    return OptimizedModule


def _original(model: Any) -> Any:
    """The module a ``torch.compile`` result wraps."""
    return model._orig_mod  # noqa: SLF001  (torch's public way in: torch.compile documents _orig_mod)


def from_compiled(model: Any) -> TrainModule:
    """The TrainModule inside ``torch.compile(module)``, with its forward and steps compiled."""
    optimized = _optimized_module_class()
    if optimized is None or not isinstance(model, optimized):
        raise TypeError(f"Expected the result of torch.compile(module), got {type(model).__name__}.")
    module = _original(model)
    if not isinstance(module, TrainModule):
        raise TypeError(
            f"torch.compile wrapped a {type(module).__name__}, not an ember.TrainModule. Compile the "
            "TrainModule (trainer.fit(torch.compile(module))) or a submodule inside it."
        )
    ctx = model.dynamo_ctx
    if _CTX in vars(module):  # compiled before (fit then validate): start from the original methods
        to_uncompiled(module)
    vars(module)[_CTX] = {name: vars(module).get(name) for name in _METHODS}
    for name in _METHODS:
        setattr(module, name, ctx(getattr(module, name)))
    return module


def to_uncompiled(model: Any) -> TrainModule:
    """The module with its original (uncompiled) forward and steps back; ``model`` may be the
    ``torch.compile`` result or a module ``from_compiled`` returned."""
    optimized = _optimized_module_class()
    module = _original(model) if optimized is not None and isinstance(model, optimized) else model
    saved = vars(module).pop(_CTX, None)
    if saved is None:
        return module
    for name, own in saved.items():
        if own is None:
            vars(module).pop(name, None)  # back to the class's method
        else:
            vars(module)[name] = own
    return module


def is_compiled(module: TrainModule) -> bool:
    """Whether ``from_compiled`` compiled this module's forward and steps."""
    return _CTX in vars(module)


def unwrap_compiled(model: Any) -> Any:
    """``model`` itself, or the compiled TrainModule inside a ``torch.compile`` result."""
    optimized = _optimized_module_class() if type(model).__name__ == "OptimizedModule" else None
    if optimized is not None and isinstance(model, optimized):
        return from_compiled(model)
    return model
