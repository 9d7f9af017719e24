"""Hyper-parameters: ``save_hyperparameters``, ``hparams`` and ``hparams_initial`` for modules and datamodules.

Imports nothing of ember, so that both ``module.py`` and ``data/datamodule.py`` can use it.

``save_hyperparameters()`` reads the arguments of the constructor calls of the object that is
being built: it walks up the Python stack from its caller, through helpers called from
``__init__``, and collects every ``__init__`` frame whose first argument is the object (whatever
that argument is named), innermost (a base class, a mixin) first, so that a subclass's value
wins. A dataclass contributes its ``init`` fields instead. Unlike Lightning, a frame counts by
its first argument rather than by a ``super()`` call in it, so an ``__init__`` that calls
``Base.__init__(self)`` explicitly is included, and a module built inside another module's
``__init__`` does not pick up its parent's arguments.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import types
import warnings
from argparse import Namespace
from collections.abc import MutableMapping, Sequence
from typing import Any

from ember.user_frames import user_stacklevel

_VARARGS = inspect.CO_VARARGS
_VARKEYWORDS = inspect.CO_VARKEYWORDS


class AttributeDict(dict):
    """A dict whose keys are also attributes: ``self.hparams.lr``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as err:
            raise AttributeError(f"No hyper-parameter named {key!r}; saved ones: {sorted(self)}") from err

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        try:
            del self[key]
        except KeyError as err:
            raise AttributeError(f"No hyper-parameter named {key!r}; saved ones: {sorted(self)}") from err


class HyperparametersMixin:
    """``save_hyperparameters`` / ``hparams`` / ``hparams_initial``, shared by TrainModule and DataModule."""

    @property
    def hparams(self) -> AttributeDict:
        """The saved hyper-parameters; change them freely (checkpoints record their values at save time)."""
        hp = self.__dict__.get("_hparams")
        if hp is None:
            hp = self.__dict__["_hparams"] = AttributeDict()
        return hp

    @property
    def hparams_initial(self) -> AttributeDict:
        """A copy of the hyper-parameters as ``save_hyperparameters`` saved them; later changes to ``hparams`` do
        not show here."""
        initial = self.__dict__.get("_hparams_initial")
        return AttributeDict() if initial is None else copy.deepcopy(initial)

    def save_hyperparameters(
        self,
        *args: Any,
        ignore: Sequence[str] | str | None = None,
        frame: types.FrameType | None = None,
        logger: bool = True,
    ) -> None:
        """Store the constructor's arguments in ``self.hparams`` (and so in checkpoints and the loggers).

        Args:
            *args: names of the arguments to keep (all of them by default), or one dict / ``Namespace``
                to save instead of the arguments.
            ignore: argument names to leave out (e.g. an ``nn.Module`` passed in, which the weights already hold);
                also removes them from what an earlier call (a base class's) saved.
            frame: the frame of the ``__init__`` to read (default: the caller's).
            logger: whether the loggers receive these hyper-parameters.
        """
        self.__dict__["_log_hyperparams"] = logger
        if frame is None:
            here = inspect.currentframe()
            frame = here.f_back if here is not None else None
        save_hyperparameters(self, *args, ignore=ignore, frame=frame)

    def remove_ignored_hparams(self, ignore_list: Sequence[str] | str) -> None:
        """Drop the named hyper-parameters from ``hparams`` (``hparams_initial`` keeps them), as Lightning's.

        ``save_hyperparameters(ignore=...)`` calls it, so that a subclass drops what a base class saved.

        Args:
            ignore_list: the names to drop (one name as a string); names not saved are skipped.
        """
        hparams = self.hparams
        for key in [ignore_list] if isinstance(ignore_list, str) else ignore_list:
            hparams.pop(key, None)


def save_hyperparameters(
    obj: Any, *args: Any, ignore: Sequence[str] | str | None = None, frame: types.FrameType | None = None
) -> None:
    """See ``HyperparametersMixin.save_hyperparameters``; ``frame`` is where the search for ``__init__`` starts."""
    if len(args) == 1 and not isinstance(args[0], str) and not args[0]:
        return  # an empty dict / Namespace: nothing to save, as Lightning
    if dataclasses.is_dataclass(obj):
        init_args = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    else:
        init_args = collect_init_args(obj, frame)
    ignored = _names(ignore)
    init_args = {k: v for k, v in init_args.items() if k not in ignored}

    given = [a for a in args if not isinstance(a, str)]
    hp: dict[str, Any]
    if not args:
        hp = init_args
        name: str | None = "kwargs" if hp else None
    elif len(given) == 1:
        # One dict / Namespace (string names beside it are ignored, as Lightning does).
        hp = _as_dict(given[0])
        name = next((k for k, v in init_args.items() if v is given[0]), None)
    elif given:
        raise ValueError(
            f"save_hyperparameters takes argument names or one dict / Namespace; got {len(given)} "
            f"objects that are not names ({', '.join(type(g).__name__ for g in given)})."
        )
    else:
        unknown = [a for a in args if a not in init_args]
        if unknown:
            where = sorted(init_args) if init_args else "none: call it from __init__"
            raise KeyError(
                f"save_hyperparameters({', '.join(map(repr, args))}): {unknown} are not arguments of "
                f"{type(obj).__name__}.__init__ (its arguments: {where})."
            )
        hp = {a: init_args[a] for a in args}
        name = "kwargs"
    hparams = obj.hparams
    hparams.update(hp)
    # A subclass's ignore= also drops what a base class's call saved (through the object's method, as Lightning).
    remove = getattr(obj, "remove_ignored_hparams", None)
    if remove is not None:
        remove(sorted(ignored))
    else:
        for k in ignored:
            hparams.pop(k, None)
    obj.__dict__["_hparams_name"] = name
    _warn_about_modules(hparams)
    try:
        obj.__dict__["_hparams_initial"] = copy.deepcopy(hparams)
    except Exception as err:  # e.g. a lock or an open file
        bad = [k for k, v in hparams.items() if not _copyable(v)]
        raise TypeError(
            f"save_hyperparameters could not copy the hyper-parameter(s) {bad} of "
            f"{type(obj).__name__} ({err}). Leave them out with "
            f"save_hyperparameters(ignore={bad!r})."
        ) from err


def collect_init_args(obj: Any, frame: types.FrameType | None) -> dict[str, Any]:
    """The arguments of the ``__init__`` calls building ``obj`` found from ``frame`` upwards; outer ones win."""
    found: list[dict[str, Any]] = []
    while frame is not None:
        if _first_argument(frame) is obj:
            if frame.f_code.co_name == "__init__":
                found.append(_arguments(frame))
        elif found:
            break  # the chain of obj's constructors ended
        frame = frame.f_back
    out: dict[str, Any] = {}
    for args in found:  # innermost (the base class) first
        out.update(args)
    return out


def _first_argument(frame: types.FrameType) -> Any:
    code = frame.f_code
    if code.co_argcount == 0:
        return None
    return frame.f_locals.get(code.co_varnames[0])


def _arguments(frame: types.FrameType) -> dict[str, Any]:
    """A frame's named arguments (without the first one) and its ``**kwargs`` items; ``*args`` is left out."""
    code = frame.f_code
    local = frame.f_locals
    n = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[1:n])
    out = {k: local[k] for k in names if k in local}
    if code.co_flags & _VARKEYWORDS:
        index = n + (1 if code.co_flags & _VARARGS else 0)
        extra = local.get(code.co_varnames[index])
        if isinstance(extra, dict):
            out.update(extra)
    return out


def _names(ignore: Sequence[str] | str | None) -> set[str]:
    if ignore is None:
        return set()
    if isinstance(ignore, str):
        return {ignore}
    return {k for k in ignore if isinstance(k, str)}


def _as_dict(hp: Any) -> dict[str, Any]:
    if isinstance(hp, Namespace):
        return dict(vars(hp))
    if isinstance(hp, MutableMapping):
        return dict(hp)
    if isinstance(hp, (bool, int, float, str)):
        raise ValueError(
            f"save_hyperparameters got the value {hp!r}: pass argument names as strings, or one "
            "dict / Namespace of hyper-parameters."
        )
    raise ValueError(
        f"save_hyperparameters cannot save a {type(hp).__name__}: pass argument names, or one dict / "
        "argparse.Namespace of hyper-parameters."
    )


def _warn_about_modules(hparams: dict[str, Any]) -> None:
    try:
        from torch import nn
    except ImportError:  # pragma: no cover - torch is a dependency
        return
    for k, v in hparams.items():
        if isinstance(v, nn.Module):
            warnings.warn(
                f"Hyper-parameter {k!r} is an nn.Module, whose weights the checkpoint already holds. "
                f"Leave it out with self.save_hyperparameters(ignore=[{k!r}]).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )


def _copyable(value: Any) -> bool:
    try:
        copy.deepcopy(value)
    except Exception:
        return False
    return True


def is_picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except (pickle.PickleError, AttributeError, RuntimeError, TypeError):
        return False
    return True


def drop_unpicklable(hparams: MutableMapping[str, Any]) -> list[str]:
    """Remove, with a warning each, the entries of ``hparams`` that cannot be pickled; return their names.

    Lightning does this when a run starts (``trainer.fit`` / ``validate`` / ...), so the Trainer calls it.
    """
    dropped = [k for k, v in hparams.items() if not is_picklable(v)]
    for k in dropped:
        warnings.warn(
            f"Hyper-parameter {k!r} was removed from hparams because it cannot be pickled. Leave it out "
            f"with self.save_hyperparameters(ignore=[{k!r}]) to silence this.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        del hparams[k]
    return dropped


def build_from_hparams(cls: Any, saved: Any, hparams_name: Any, overrides: dict[str, Any]) -> Any:
    """``cls(...)`` from hyper-parameters saved in a checkpoint (``overrides`` win), as Lightning builds it.

    The saved hyper-parameters updated with ``overrides`` are the constructor's keyword arguments;
    those it does not accept are left out (unless it takes ``**kwargs``), with a warning for the
    overrides; when ``save_hyperparameters(cfg)`` saved one dict argument (``hparams_name``), they
    are passed as that argument. A ``TypeError`` from the constructor propagates.
    """
    merged = {**dict(saved or {}), **overrides}
    params = inspect.signature(cls.__init__).parameters
    names = [n for i, (n, p) in enumerate(params.items()) if i > 0 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
    as_one = isinstance(hparams_name, str) and hparams_name in names
    kwargs: dict[str, Any] = {str(hparams_name): merged} if as_one else dict(merged)
    kwargs.update(overrides)
    if not any_keyword:
        dropped = [] if as_one else [k for k in overrides if k not in names]  # as_one: they went into that dict
        if dropped:
            warnings.warn(
                f"load_from_checkpoint: {cls.__name__}.__init__ takes no argument named {dropped} "
                f"(its arguments: {names}); ignored.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        kwargs = {k: v for k, v in kwargs.items() if k in names}
    return cls(**kwargs)
