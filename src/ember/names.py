"""Names in error messages: the closest of the valid options, for "did you mean" hints."""

from __future__ import annotations


def closest(name: str, options: list[str]) -> str | None:
    """The option most similar to ``name``, for "did you mean" messages."""
    import difflib

    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return match[0] if match else None
