"""Moved: ``seed_everything`` now lives in :mod:`ember.rng`, with the rest of the random generator code.

This module re-exports it, so that ``from ember.seed import seed_everything`` keeps working.
"""

from __future__ import annotations

from ember.rng import seed_everything

__all__ = ["seed_everything"]
