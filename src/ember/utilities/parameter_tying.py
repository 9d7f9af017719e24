"""Tied (shared) parameters: find which names point at one parameter, and tie them again after a move."""

from __future__ import annotations

import functools

from torch import nn

__all__ = ["find_shared_parameters", "set_shared_parameters"]


def find_shared_parameters(module: nn.Module) -> list[list[str]]:
    """The groups of names under which one parameter is registered more than once.

    A parameter assigned to two modules (``decoder.weight = encoder.weight``), or a submodule reached
    through two paths, is one group.

    Args:
        module: the module to search.

    Returns:
        One list of dotted names per shared parameter, in registration order (first the name it was first
        reached by); empty when no parameter is shared.
    """
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def set_shared_parameters(module: nn.Module, shared_params: list[list[str]]) -> nn.Module:
    """Tie parameters again: every name of a group is pointed at the parameter of its first name.

    Use it after something replaced parameters one by one (moving a model to some devices does), with the
    groups that :func:`find_shared_parameters` returned before.

    Args:
        module: the module to change, in place.
        shared_params: groups of dotted names, as :func:`find_shared_parameters` returns them.

    Returns:
        ``module``.
    """
    for first, *others in shared_params:
        shared = _attribute(module, first)
        for path in others:
            owner, _, attribute = path.rpartition(".")
            setattr(_attribute(module, owner) if owner else module, attribute, shared)
    return module


def _attribute(module: nn.Module, path: str) -> nn.Module:
    return functools.reduce(getattr, path.split("."), module)
