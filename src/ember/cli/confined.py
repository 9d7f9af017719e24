"""A config builds only what the types ask for: EmberCLI's parser and its guard types.

jsonargparse builds an object from ``{class_path: ..., init_args: ...}`` wherever a parameter's type
accepts one. Where the type is a class that is the point (``callbacks: list[Callback]`` is given its
callbacks by class path), and jsonargparse imports the path and checks that it names a subclass
before building it. But a type that accepts anything accepts every class too: with
``Trainer(max_time: Any)``, the config ``trainer.max_time: {class_path: os.system, init_args:
{command: ...}}`` ran the command while EmberCLI built its objects, and so did a module's
``object`` parameter, an unannotated one, a ``dict[str, Any]`` value, a ``list[Any]`` item or a
``Callable`` given a class. jsonargparse's own settings for this are process-wide (they would change
every other parser in the program) and still import the path.

So :class:`ConfinedParser` rewrites each argument's type as the argument is added (:func:`confine`),
before any value is parsed: every position that accepts anything is replaced by a guard type, which
takes plain data (numbers, strings, lists, mappings, or a Python object given as a default) and
refuses, naming the parser key, a mapping with a ``class_path`` anywhere in it, before anything is
imported. A ``Callable`` whose return type is no class takes the import path of a function, never a
class to build. Class-typed positions (a class, a union, list or mapping of classes, a ``Callable``
returning one) are left to jsonargparse: the path it imports there is one subclass check away from
being refused. A ``typing.Protocol`` counts as accepting anything: jsonargparse matches it by the
methods a class has, not by its bases, so ``subprocess.Popen`` may fit one.

The guard types are jsonargparse registered types (``jsonargparse.typing.register_type``) whose
deserializer checks the value; they are registered once, for our own classes only. The parser
subclass customises ``add_argument``, the hook jsonargparse offers for this (its argument groups
get the same ``add_argument``). Arguments read from a signature arrive there with their type
already inside jsonargparse's action, the only place jsonargparse keeps it; :func:`_confine_action`
reads and replaces it there, and fails loudly if a jsonargparse release moves it.
"""

from __future__ import annotations

import collections
import collections.abc as abc
import enum
import inspect
import os
import pathlib
import re
import types
import typing
from collections.abc import Callable, Mapping
from datetime import date, datetime, time, timedelta
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

import jsonargparse
from jsonargparse import ArgumentParser, Namespace, get_loader
from jsonargparse.typing import get_registered_type, register_type

from ember.cli.instantiate import import_path

__all__ = ["ConfinedParser", "confine"]

#: From this release on, jsonargparse gives a parser's argument groups the parser's own ``add_argument``.
MIN_JSONARGPARSE = (4, 37)
_release = re.match(r"(\d+)\.(\d+)", jsonargparse.__version__)
if _release is None or (int(_release[1]), int(_release[2])) < MIN_JSONARGPARSE:
    raise ImportError(
        f"EmberCLI needs jsonargparse {'.'.join(map(str, MIN_JSONARGPARSE))} or later (this is "
        f"{jsonargparse.__version__}), without which it cannot check what a config builds: "
        "pip install -U 'ember[cli]'."
    )
try:
    from jsonargparse._typehints import ActionTypeHint  # the action that carries an argument's type
except ImportError as err:
    raise ImportError(
        "This jsonargparse release keeps an argument's type where EmberCLI does not look, so EmberCLI "
        "cannot check what a config builds. Install a release EmberCLI supports: pip install 'ember[cli]'."
    ) from err

#: Types whose values are data, never a class to build (jsonargparse's own leaf types included).
_LEAVES: tuple[type, ...] = (
    str, bytes, bytearray, bool, int, float, complex, type(None), range,
    os.PathLike, pathlib.PurePath, timedelta, datetime, date, time, enum.Enum,
)  # fmt: skip
_MAPPINGS = {dict, abc.Mapping, abc.MutableMapping, collections.OrderedDict, collections.defaultdict}
_TUPLES = {tuple}
_SETS = {set, frozenset, abc.Set, abc.MutableSet}
_SEQUENCES = {list, abc.Sequence, abc.MutableSequence, abc.Iterable, abc.Collection, collections.deque}
_UNIONS = {Union, types.UnionType}


# ---------------------------------------------------------------------- the guard types
class _Guard:
    """Base of the guard types. No value is ever an instance: each one is checked by :meth:`check`."""

    #: What the value must be (None: anything) and what it is given back as.
    shape: ClassVar[tuple[type, ...] | None] = None
    make: ClassVar[Callable[[Any], Any] | None] = None
    #: The type the guard stands for, as the error names it.
    stands_for: ClassVar[str] = "Any"

    @classmethod
    def check(cls, value: Any) -> Any:
        _refuse_sub_option(value, cls.stands_for)
        value = _loaded(value)
        _refuse_class_paths(value, cls.stands_for)
        if cls.shape is not None:
            if isinstance(value, str) or not isinstance(value, cls.shape):
                raise TypeError(f"expected a {cls.stands_for}, got {type(value).__name__} {value!r}")
            if cls.make is not None:
                value = cls.make(value)
        return value


class AnyValue(_Guard):
    """Stands for ``Any``, ``object``, an unannotated parameter, a Protocol or a type jsonargparse cannot
    check: any plain value."""


class AnyMapping(_Guard):
    """Stands for ``dict`` and mappings of values of any type."""

    shape, make, stands_for = (abc.Mapping,), dict, "dict"


class AnyList(_Guard):
    """Stands for ``list``, ``Sequence`` and ``Iterable`` without item types."""

    shape, make, stands_for = (list, tuple), list, "list"


class AnyTuple(_Guard):
    """Stands for ``tuple`` without item types."""

    shape, make, stands_for = (list, tuple), tuple, "tuple"


class AnySet(_Guard):
    """Stands for ``set`` and ``frozenset`` without item types."""

    shape, make, stands_for = (list, tuple, set, frozenset), set, "set"


class AnyCallable(_Guard):
    """Stands for a ``Callable`` whose return type is no class: a function, or its import path."""

    stands_for = "Callable"

    @classmethod
    def check(cls, value: Any) -> Any:
        _refuse_sub_option(value, cls.stands_for)
        _refuse_class_paths(value, cls.stands_for)
        if isinstance(value, str):
            value = import_path(value.strip())
            if inspect.isclass(value):
                raise TypeError(
                    f"{value.__module__}.{value.__qualname__} is a class, and EmberCLI builds a class only "
                    "where a parameter's type names it or a base of it. Give the import path of a function, "
                    "or type the parameter Callable[..., <the base class>]."
                )
        if not callable(value):
            raise TypeError(f"expected a function or its import path, got {type(value).__name__} {value!r}")
        return value


_GUARDS = (AnyValue, AnyMapping, AnyList, AnyTuple, AnySet, AnyCallable)


def _loaded(value: Any) -> Any:
    """A string parsed as YAML, as jsonargparse parses one for ``Any`` (``"3"`` is 3, ``"{a: 1}"`` a
    dict); a string that is not YAML stays as it is."""
    if not isinstance(value, str) or value.strip() in ("", "-"):
        return value
    try:
        return get_loader("yaml")(value)
    except Exception:  # (a YAML error of whichever loader jsonargparse is set to use)
        return value


def _refuse_class_paths(value: Any, stands_for: str, where: str = "") -> None:
    """Raise when ``value`` holds a mapping with a ``class_path`` anywhere, before anything is imported."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, Mapping):
        if "class_path" in value:
            at = f" (at {where})" if where else ""
            raise ValueError(
                f"class_path {value['class_path']!r}{at} is given where the type ({stands_for}) names no class "
                "to build. EmberCLI builds a class_path only where the parameter's type is a class (or a union, "
                "list or Callable of classes) and the path names a subclass of it, and imports nothing else. "
                "Give plain data here, or type the parameter with the class it should build."
            )
        for key, item in value.items():
            _refuse_class_paths(item, stands_for, f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, item in enumerate(value):
            _refuse_class_paths(item, stands_for, f"{where}[{i}]")


def _refuse_sub_option(value: Any, stands_for: str) -> None:
    """Raise for a dotted sub-option (``--model.x.command=...``, which jsonargparse hands over as a
    ``NestedArg(key, val)``): a parameter of this type has none, its value is given whole."""
    if getattr(type(value), "_fields", None) == ("key", "val"):
        raise ValueError(
            f"{value.key!r} is not an option here: a parameter of type {stands_for} takes its value whole "
            "(on the command line: --<key> '<YAML or JSON>'), and has no options of its own."
        )


def _serialized(value: Any) -> Any:
    """A guard type's value as YAML can hold it: plain data as it is, a function or class as its import
    path, anything else as its text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, Mapping):
        return {k: _serialized(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_serialized(v) for v in value]
    module = getattr(value, "__module__", None)
    for name in (getattr(value, "__name__", None), getattr(value, "__qualname__", None)):
        if module and name and "<" not in name:  # (``torch.relu``, whose qualified name is a class's method)
            try:
                if import_path(f"{module}.{name}") is value:
                    return f"{module}.{name}"
            except TypeError:
                continue
    return str(value)


for _guard in _GUARDS:
    # Named as the types they stand for, so that --help shows a parameter's own type (``Optional[Any]``).
    _guard.__name__ = _guard.__qualname__ = _guard.stands_for
    # Values are never instances of a guard (type_check is False), so every value is checked.
    if get_registered_type(_guard) is None:
        register_type(_guard, serializer=_serialized, deserializer=_guard.check, type_check=lambda v, t: False)


# ---------------------------------------------------------------------- rewriting a type
def _is_protocol(hint: type) -> bool:
    return bool(getattr(hint, "_is_protocol", False)) and typing.Protocol in getattr(hint, "__mro__", ())


def _names_a_class(hint: Any) -> bool:
    """Whether jsonargparse builds only subclasses of ``hint`` at a position of that type (a Callable's
    return type): a class that is not data, or a union of such (None aside)."""
    if get_origin(hint) in _UNIONS:
        members = [a for a in get_args(hint) if a is not type(None)]
        return bool(members) and all(_names_a_class(a) for a in members)
    return confine(hint) is hint and inspect.isclass(get_origin(hint) or hint) and not _is_data(hint)


def _is_data(hint: Any) -> bool:
    cls = get_origin(hint) or hint
    return inspect.isclass(cls) and (
        issubclass(cls, _LEAVES) or cls in _MAPPINGS | _TUPLES | _SETS | _SEQUENCES or cls is object
    )


def _accepts_anything(hint: Any) -> bool:
    if get_origin(hint) in _UNIONS:
        return any(_accepts_anything(a) for a in get_args(hint))
    return confine(hint) is AnyValue


def confine(hint: Any) -> Any:
    """``hint`` with every position that accepts anything replaced by a guard type; ``hint`` itself
    (the same object) when it has none.

    Examples: ``Any`` and ``object`` become :class:`AnyValue`; ``int | Any`` becomes ``int | AnyValue``;
    ``dict`` and ``dict[str, Any]`` become :class:`AnyMapping` (a mapping of anything is checked whole,
    so a mapping given as a class spec is refused too); ``list[Any]`` becomes ``list[AnyValue]``;
    ``Callable[..., Any]`` becomes :class:`AnyCallable`; ``Callback``, ``list[Callback]``,
    ``Callable[..., Optimizer]`` and ``int`` stay as they are.
    """
    if hint in _GUARDS:
        return hint
    if hint is Any or hint is object:  # (Any is a class since Python 3.11)
        return AnyValue
    origin, args = get_origin(hint), get_args(hint)
    if origin in _UNIONS:
        confined = tuple(confine(a) for a in args)
        return hint if confined == args else Union[confined]  # noqa: UP007  (a tuple of members)
    if origin is typing.Annotated:
        inner = confine(args[0])
        rebuilt = (inner, *hint.__metadata__)  # (the type and its metadata, as Annotated takes them)
        return hint if inner is args[0] else typing.Annotated[rebuilt]
    if origin is Literal or origin is type or hint is type:
        return hint
    if origin is abc.Callable or hint in (abc.Callable, typing.Callable):
        return hint if args and _names_a_class(args[-1]) else AnyCallable
    base = origin if origin is not None else hint
    if not isinstance(base, abc.Hashable):
        return AnyValue
    if base in _MAPPINGS:
        if not args or _accepts_anything(args[-1]) or _accepts_anything(args[0]):
            return AnyMapping
        return _rebuilt(hint, base, args)
    if base in _TUPLES | _SETS | _SEQUENCES:
        if not args:
            return AnyTuple if base in _TUPLES else AnySet if base in _SETS else AnyList
        return _rebuilt(hint, base, args)
    if origin is not None:  # Required[...], NotRequired[...], a generic class of the user's
        return _rebuilt(hint, origin, args) if not inspect.isclass(origin) else hint
    if isinstance(hint, typing.NewType):
        return hint if confine(hint.__supertype__) is hint.__supertype__ else confine(hint.__supertype__)
    if inspect.isclass(hint) and not _is_protocol(hint):
        return hint  # data, or a class: jsonargparse builds only its subclasses
    return AnyValue  # Any, object, a Protocol, a TypeVar, an annotation jsonargparse could not resolve


def _rebuilt(hint: Any, origin: Any, args: tuple[Any, ...]) -> Any:
    """``origin[confined args]``, or ``hint`` itself when no argument changed."""
    confined = tuple(a if a is Ellipsis else confine(a) for a in args)
    if confined == args:
        return hint
    return origin[confined if len(confined) > 1 else confined[0]]


def _confine_action(action: Any) -> None:
    """Confine the type inside an argument's action (see the module docstring for why it is read there)."""
    if not hasattr(action, "_typehint"):
        raise RuntimeError(
            "This jsonargparse release keeps an argument's type where EmberCLI does not look, so EmberCLI "
            "cannot check what a config builds. Install a release EmberCLI supports: pip install 'ember[cli]'."
        )
    typehint = action._typehint  # noqa: SLF001  (jsonargparse offers no other way to read it)
    confined = confine(typehint)
    if confined is not typehint:
        action._typehint = confined  # noqa: SLF001


# ---------------------------------------------------------------------- the parser
class ConfinedParser(ArgumentParser):
    """jsonargparse's ``ArgumentParser`` whose arguments build only what their types ask for (see the
    module docstring). The parsers jsonargparse makes for a class named in a config (a callback's
    arguments, a subclass of the model) are of the same class, so the rule holds at every depth."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        # jsonargparse copies this method's source into the parser's argument groups' class, so it names
        # only module-level helpers (and zero-argument super()).
        if "type" in kwargs:
            kwargs["type"] = confine(kwargs["type"])
        if isinstance(kwargs.get("action"), ActionTypeHint):
            _confine_action(kwargs["action"])
        return super().add_argument(*args, **kwargs)
