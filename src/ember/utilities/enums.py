"""Lightning's enum base and ``GradClipAlgorithmType``.

``LightningEnum`` is lightning-utilities' ``StrEnum`` (the class Lightning's name points at): members are
strings equal to their value whatever its case, and ``from_str`` finds one by key or value.
"""

from __future__ import annotations

from lightning_utilities.core.enums import StrEnum as LightningEnum

__all__ = ["GradClipAlgorithmType", "LightningEnum"]


class GradClipAlgorithmType(LightningEnum):
    """``Trainer(gradient_clip_algorithm=...)``: clip the gradients' total norm, or each value."""

    VALUE = "value"
    NORM = "norm"

    @staticmethod
    def supported_type(val: str) -> bool:
        """Whether ``val`` is the value of one of the algorithms (exact case)."""
        return any(member.value == val for member in GradClipAlgorithmType)

    @staticmethod
    def supported_types() -> list[str]:
        """The algorithms' values."""
        return [str(member.value) for member in GradClipAlgorithmType]
