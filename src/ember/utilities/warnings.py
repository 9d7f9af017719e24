"""``disable_possible_user_warnings``: silence ember's warnings about what may well be intended."""

from __future__ import annotations

import warnings

from ember.exceptions import PossibleUserWarning

__all__ = ["PossibleUserWarning", "disable_possible_user_warnings"]


def disable_possible_user_warnings(module: str = "") -> None:
    """Ignore ``PossibleUserWarning`` from now on.

    Args:
        module: a regular expression of the modules whose warnings to ignore (``"ember.trainer"``); by
            default every module's.
    """
    warnings.filterwarnings("ignore", category=PossibleUserWarning, module=module)
