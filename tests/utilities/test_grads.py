"""grad_norm: keys and values as Lightning 2.6.6's ``grad_norm`` gives them for the same gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember.utilities import grad_norm


def _model() -> nn.Module:
    """Fixed weights and gradients (no random numbers): three parameters with 6, 2 and 2 elements."""
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) - i)
            p.grad = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * (i + 1) - 1.5
    return model


# Lightning's values, rounded to 6 digits: per parameter (0.weight, 0.bias, 2.weight), then the total.
@pytest.mark.parametrize(
    "norm_type, p, values",
    [
        (1, "1.0", [10.0, 2.0, 3.0, 15.0]),
        (2, "2.0", [4.84768, 1.581139, 2.12132, 5.522681]),
        ("2", "2.0", [4.84768, 1.581139, 2.12132, 5.522681]),
        (2.5, "2.5", [4.314453, 1.537774, 1.979262, 4.66917]),
        ("inf", "inf", [3.5, 1.5, 1.5, 3.5]),
    ],
)
def test_keys_and_values_match_lightning(norm_type, p, values):
    norms = grad_norm(_model(), norm_type)
    prefix = f"grad_{p}_norm"
    assert list(norms) == [f"{prefix}/0.weight", f"{prefix}/0.bias", f"{prefix}/2.weight", f"{prefix}_total"]
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in norms.values())
    assert [round(float(v), 6) for v in norms.values()] == pytest.approx(values, abs=1e-6)


def test_group_separator_and_parameters_without_gradients():
    model = _model()
    assert list(grad_norm(model, 2, group_separator=".")) == [
        "grad_2.0_norm.0.weight",
        "grad_2.0_norm.0.bias",
        "grad_2.0_norm.2.weight",
        "grad_2.0_norm_total",
    ]
    model[2].weight.grad = None
    assert list(grad_norm(model, 2)) == ["grad_2.0_norm/0.weight", "grad_2.0_norm/0.bias", "grad_2.0_norm_total"]
    assert grad_norm(nn.Linear(2, 2), 2) == {}  # no gradient at all: no total either


@pytest.mark.parametrize("norm_type, shown", [(0, "0.0"), (-1, "-1.0"), ("0", "0.0")])
def test_non_positive_norm_types_raise(norm_type, shown):
    expected = f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {shown}"
    with pytest.raises(ValueError) as info:
        grad_norm(_model(), norm_type)
    assert str(info.value) == expected


def test_a_string_that_is_no_number_raises_floats_error():
    with pytest.raises(ValueError, match="could not convert string to float: 'abc'"):
        grad_norm(_model(), "abc")
