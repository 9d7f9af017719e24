"""measure_flops, move_data_to_device, is_picklable and AttributeDict, against Lightning 2.6.6's results."""

from __future__ import annotations

import collections
import pickle

import pytest
import torch
from torch import nn

from ember.hparams import AttributeDict as HparamsAttributeDict
from ember.utilities import AttributeDict, is_picklable, measure_flops, move_data_to_device


def test_measure_flops_on_the_meta_device():
    with torch.device("meta"):
        model = nn.Linear(32, 16)
        x = torch.randn(2, 32)
    assert measure_flops(model, lambda: model(x)) == 2048  # Lightning: 2048 forward
    assert measure_flops(model, lambda: model(x), lambda y: y.sum()) == 4096  # and 4096 with the backward


def test_measure_flops_on_the_cpu():
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 8)
    assert measure_flops(model, lambda: model(x)) == 400
    assert measure_flops(model, lambda: model(x), lambda y: y.sum()) == 880
    assert model[0].weight.grad is not None  # the backward ran


class Box:
    """A user type with a ``to`` method: moved like a tensor."""

    def __init__(self) -> None:
        self.moved_with = None

    def to(self, device, **kwargs):
        self.moved_with = (device, kwargs)
        return self


class InPlace:
    """A ``to`` that returns nothing: the object itself stays in the result."""

    def to(self, device, **kwargs):
        return None


Pair = collections.namedtuple("Pair", "a b")


def test_move_data_to_device_walks_collections_and_moves_objects_with_to():
    box, in_place = Box(), InPlace()
    batch = {"x": torch.ones(2), "l": [torch.zeros(1), "s", 3], "p": Pair(torch.ones(1), box), "i": in_place}
    out = move_data_to_device(batch, "cpu")
    # Lightning: tensors on the device, other leaves kept, the namedtuple rebuilt, Box.to called with the
    # torch.device and no keyword arguments, the in-place object itself kept.
    assert out["x"].device == torch.device("cpu") and out["l"][1:] == ["s", 3]
    assert type(out["p"]) is Pair and out["p"].b is box
    assert box.moved_with == (torch.device("cpu"), {})
    assert out["i"] is in_place
    assert move_data_to_device(torch.ones(1, dtype=torch.float64), torch.device("cpu")).dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_move_data_to_device_to_a_gpu():
    out = move_data_to_device({"x": torch.ones(2), "y": [torch.zeros(1)]}, "cuda:0")
    assert out["x"].device == torch.device("cuda", 0) and out["y"][0].device == torch.device("cuda", 0)
    assert move_data_to_device(out, "cpu")["x"].device == torch.device("cpu")


def test_is_picklable():
    # Lightning: True for plain values, tensors and modules; False for a lambda.
    assert [is_picklable(o) for o in (1, "a", [1, 2], lambda: 1, torch.ones(1), nn.Linear(1, 1))] == [
        True,
        True,
        True,
        False,
        True,
        True,
    ]


def test_attribute_dict():
    assert AttributeDict is HparamsAttributeDict  # what module.hparams is
    ad = AttributeDict(a=1)
    ad.b = 2
    assert (ad.a, ad["b"], dict(ad), isinstance(ad, dict)) == (1, 2, {"a": 1, "b": 2}, True)
    with pytest.raises(AttributeError):
        ad.c  # noqa: B018
    del ad.a
    assert dict(ad) == {"b": 2}
    assert pickle.loads(pickle.dumps(ad)) == {"b": 2}


def test_is_picklable_takes_obj_by_name():
    assert is_picklable(obj=1) is True  # Lightning's parameter is named obj
