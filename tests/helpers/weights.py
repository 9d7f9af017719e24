"""Comparing two modules' weights, as the parity and resume tests do."""

from __future__ import annotations

import torch


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-6, *, bitwise: bool = False) -> None:
    """Asserts that ``a`` and ``b`` have the same ``state_dict`` keys and the same values under each.

    By default the values are compared with ``torch.testing.assert_close`` (absolute tolerance ``atol``,
    no relative tolerance); the first key that differs is named. ``bitwise=True`` asks for equal tensors
    (``torch.equal``, ``atol`` unused), as a resumed run must give, and names every key that differs.
    """
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    if bitwise:
        diff = [k for k in sa if not torch.equal(sa[k], sb[k])]
        assert not diff, f"weights differ: {diff}"
        return
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
