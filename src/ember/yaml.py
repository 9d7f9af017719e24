"""A small YAML emitter for ``hparams.yaml`` (PyYAML is not a dependency).

Nested dicts and lists of plain values in block style; a string that is not a plain name, or that
YAML would read as a boolean or null, is written as a JSON (double-quoted) string.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "~"}


def _yaml_scalar(value: Any) -> str:
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d tensor or numpy scalar
        value = value.item()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        return repr(value)
    text = value if isinstance(value, str) else str(value)
    if _PLAIN.match(text) and text.lower() not in _RESERVED:
        return text
    # A JSON string is a valid YAML double-quoted scalar.
    return json.dumps(text, ensure_ascii=False)


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, (dict, list, tuple, set, frozenset))


def _inline(value: Any) -> bool:
    """Scalars, empty containers and flat lists of scalars fit on one line (``[1, 2]``)."""
    if _is_scalar(value) or not value:
        return True
    return not isinstance(value, dict) and all(_is_scalar(v) for v in value)


def _yaml_lines(obj: Any, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            k = _yaml_scalar(key if isinstance(key, str) else str(key))
            if _inline(value):
                lines.append(f"{pad}{k}: {_yaml_inline(value)}")
            else:
                lines.append(f"{pad}{k}:")
                lines.extend(_yaml_lines(value, indent + 2))
    else:
        for item in obj:
            if _inline(item):
                lines.append(f"{pad}- {_yaml_inline(item)}")
            else:
                lines.append(f"{pad}-")
                lines.extend(_yaml_lines(item, indent + 2))
    return lines


def _yaml_inline(value: Any) -> str:
    if isinstance(value, dict):
        return (
            "{}"
            if not value
            else "{" + ", ".join(f"{_yaml_scalar(str(k))}: {_yaml_inline(v)}" for k, v in value.items()) + "}"
        )
    if isinstance(value, (list, tuple, set, frozenset)):
        return "[" + ", ".join(_yaml_inline(v) for v in value) + "]"
    return _yaml_scalar(value)


def to_yaml(data: dict[str, Any]) -> str:
    """Block-style YAML for a dict of numbers, strings, bools, None, lists and dicts.

    Anything else is written as its ``str()``, quoted, so the file always parses.
    """
    if not data:
        return "{}\n"
    return "\n".join(_yaml_lines(data, 0)) + "\n"
