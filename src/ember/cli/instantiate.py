"""Building an object from a class spec (``{"class_path": ..., "init_args": ...}``) outside a parse:
:func:`instantiate_class` for a spec a module holds (an optimizer the CLI linked to it), and
:func:`instantiate_module` for a module or datamodule from a config section, checked as EmberCLI checks one.

:func:`instantiate_class` imports and calls what the spec names, as the caller asks: give it specs that
came from code or from a class-typed position of a parsed config (EmberCLI refuses a ``class_path``
anywhere else, ``confined.py``), never a file's raw contents. :func:`instantiate_module` parses the
config first, with EmberCLI's parser, so a ``class_path`` in it builds only what the types ask for.
"""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

__all__ = ["import_path", "instantiate_class", "instantiate_module"]

_T = TypeVar("_T")


def import_path(path: str) -> Any:
    """The object a dotted import path names (``torch.nn.functional.relu``): the longest importable module
    prefix, then attributes (nested classes too). A path that names nothing is a ``TypeError``."""
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise TypeError(f"expected the dotted import path of a function, got {path!r}")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception as err:  # the module's own code failed: a parse error naming the key, not a crash
            raise TypeError(f"importing {'.'.join(parts[:cut])!r} failed: {type(err).__name__}: {err}") from err
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            break
        return obj
    raise TypeError(f"{path!r} names nothing that can be imported")


def _resolve(path: str) -> Any:
    """What a ``class_path`` names (``import_path``), or a ValueError saying it names nothing."""
    try:
        return import_path(path)
    except TypeError as err:
        raise ValueError(
            f"class_path must be a dotted import path like 'torch.optim.Adam' that names a class: {err}."
        ) from err


def instantiate_class(args: Any, init: dict[str, Any]) -> Any:
    """Build the class that ``init["class_path"]`` names, with ``args`` first and ``init["init_args"]`` as
    keyword arguments: ``instantiate_class(self.parameters(), {"class_path": "torch.optim.SGD", "init_args":
    {"lr": 0.1}})``.

    Args:
        args: the positional argument, or a tuple of them (``(optimizer,)``, ``(params, extra)``).
        init: the spec: ``class_path`` (a dotted import path) and, optionally, ``init_args``.

    Returns:
        The object built.
    """
    if "class_path" not in init:
        raise ValueError(f"instantiate_class needs a spec with a 'class_path' key, got keys {sorted(init)}.")
    cls = _resolve(init["class_path"])
    if not callable(cls):
        raise TypeError(f"class_path {init['class_path']!r} names a {type(cls).__name__}, which cannot be called.")
    positional = args if isinstance(args, tuple) else (args,)
    return cls(*positional, **dict(init.get("init_args") or {}))


def instantiate_module(class_type: type[_T], config: dict[str, Any]) -> _T:
    """Build ``class_type`` (a module or datamodule class) from a config section as EmberCLI reads one: its
    values are checked against the constructor's types, and a ``class_path`` inside builds only what those
    types ask for. A ``_class_path`` key names a subclass of ``class_type`` to build instead, the other keys
    being its arguments.

    Args:
        class_type: the class, or the base class when ``config`` holds ``_class_path``.
        config: the constructor's arguments, as a config gives them.

    Returns:
        The object built.
    """
    try:
        from ember.cli.parser import EmberArgumentParser  # (jsonargparse: the cli extra, needed here only)
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("jsonargparse"):
            raise
        raise ImportError("instantiate_module needs jsonargparse: pip install 'ember[cli]'.") from err

    parser = EmberArgumentParser(exit_on_error=False)
    if "_class_path" in config:
        parser.add_subclass_arguments(class_type, "module", fail_untyped=False)
        rest = {k: v for k, v in config.items() if k != "_class_path"}
        section: dict[str, Any] = {"class_path": config["_class_path"], "init_args": rest}
    else:
        parser.add_class_arguments(class_type, "module", fail_untyped=False)
        section = dict(config)
    parsed = parser.parse_object({"module": section})
    return parser.instantiate_classes(parsed).module
