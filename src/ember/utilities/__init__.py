"""User-facing helpers under Lightning's names (``lightning.pytorch.utilities``)."""

from __future__ import annotations

from ember.utilities.combined_loader import CombinedLoader

__all__ = ["CombinedLoader"]
