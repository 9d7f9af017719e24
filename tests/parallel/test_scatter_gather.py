"""scatter / gather over nested batches: structures, uneven splits, errors, autograd, a property."""

from __future__ import annotations

import collections
import dataclasses
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.parallel.scatter_gather import (
    Gather,
    Scatter,
    as_device,
    chunk_sizes,
    flatten,
    gather,
    scatter,
    scatter_kwargs,
    unflatten,
)

CPU2 = ["cpu", "cpu"]
Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    label: str = "b"
    n: int = dataclasses.field(init=False, default=-1)

    def __post_init__(self) -> None:
        self.n = len(self.x)


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    meta: dict


class Tagged(dict):
    pass


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_as_device_follows_pytorch_conventions():
    assert as_device(1) == torch.device("cuda", 1)
    assert as_device(-1) == torch.device("cpu")  # output_device=-1 means the CPU
    assert as_device("cpu") == as_device(torch.device("cpu"))
    with pytest.raises(TypeError, match="expected a device"):
        as_device(1.5)


@pytest.mark.parametrize("batch, n", [(10, 4), (5, 4), (3, 4), (8, 2), (7, 3), (1, 2), (9, 9)])
def test_chunk_sizes_match_torch_chunk(batch, n):
    expected = [c.size(0) for c in torch.arange(batch).chunk(n)]
    assert chunk_sizes(batch, n) == expected


def test_chunk_sizes_examples_and_empty_batch():
    assert chunk_sizes(5, 4) == [2, 2, 1]  # only 3 of 4 devices get work
    assert chunk_sizes(3, 4) == [1, 1, 1]
    assert chunk_sizes(0, 2) == [0, 0]
    with pytest.raises(ValueError, match="at least one device"):
        chunk_sizes(4, 0)


def test_scatter_tensor_gives_views_on_cpu():
    x = torch.arange(12.0).view(6, 2)
    parts = scatter(x, ["cpu"] * 3)
    assert [p.shape[0] for p in parts] == [2, 2, 2]
    assert all(same_storage(p, x) for p in parts)
    assert torch.equal(torch.cat(parts), x)


def test_scatter_uneven_and_smaller_than_device_count():
    x = torch.arange(5)
    assert [p.tolist() for p in scatter(x, ["cpu"] * 4)] == [[0, 1], [2, 3], [4]]
    assert [p.tolist() for p in scatter(torch.arange(2), ["cpu"] * 4)] == [[0], [1]]


def test_scatter_along_other_dim():
    x = torch.arange(12).view(2, 6)
    parts = scatter(x, CPU2, dim=1)
    assert [p.shape for p in parts] == [torch.Size([2, 3])] * 2


def test_scatter_walks_every_structure_and_keeps_types():
    x = torch.arange(4)
    batch = {
        "tuple": (x, "t"),
        "list": [x, 3],
        "pair": Pair(x, None),
        "ordered": collections.OrderedDict(a=x),
        "tagged": Tagged(a=x),
        "default": collections.defaultdict(list, a=x),
        "data": Batch(x, label="L"),
        "frozen": Frozen(x, {"k": 1}),
        "max": torch.max(torch.ones(4, 2), 1),
    }
    parts = scatter(batch, CPU2)
    assert len(parts) == 2
    for r, part in enumerate(parts):
        want = x[2 * r : 2 * r + 2]
        assert type(part) is dict
        assert type(part["tuple"]) is tuple and torch.equal(part["tuple"][0], want)
        assert type(part["list"]) is list and part["list"][1] == 3
        assert type(part["pair"]) is Pair and part["pair"].y is None
        assert type(part["ordered"]) is collections.OrderedDict
        assert type(part["tagged"]) is Tagged
        assert part["default"].default_factory is list
        assert type(part["data"]) is Batch and torch.equal(part["data"].x, want)
        assert part["data"].label == "L" and part["data"].n == 2  # __post_init__ saw the chunk
        assert type(part["frozen"]) is Frozen and part["frozen"].meta == {"k": 1}
        assert type(part["max"]) is type(batch["max"]) and part["max"].values.shape == (2,)


def test_non_tensor_leaves_and_empty_containers_are_shared_by_reference():
    meta, empty_list, empty_dict = {"lr": object()}, [], {}
    parts = scatter((torch.ones(4), meta["lr"], empty_list, empty_dict, ()), CPU2)
    for part in parts:
        assert part[1] is meta["lr"]
        assert part[2] is empty_list and part[3] is empty_dict and part[4] == ()


def test_scatter_kwargs_splits_args_and_kwargs_together():
    args, kwargs = scatter_kwargs((torch.ones(3, 2),), {"mask": torch.zeros(3), "flag": True}, CPU2)
    assert [a[0].shape[0] for a in args] == [2, 1]
    assert [k["mask"].shape[0] for k in kwargs] == [2, 1]
    assert all(k["flag"] is True for k in kwargs)
    assert scatter_kwargs((), {}, CPU2) == ([], [])
    # kwargs only: every replica still gets a positional tuple
    args, kwargs = scatter_kwargs((), {"x": torch.ones(2)}, CPU2)
    assert args == [(), ()] and len(kwargs) == 2


def test_scatter_error_when_no_tensor():
    with pytest.raises(ValueError, match="holds no tensor.*int, str"):
        scatter((1, "a"), CPU2)
    with pytest.raises(ValueError, match="holds no tensor"):
        scatter_kwargs(([],), {}, CPU2)


def test_scatter_error_names_tensors_of_different_sizes():
    with pytest.raises(ValueError, match=r"same size along dim 0.*\['x'\]: 4.*\['mask'\]: 3"):
        scatter({"x": torch.ones(4), "mask": torch.ones(3)}, CPU2)


def test_scatter_error_for_zero_dim_tensor():
    with pytest.raises(ValueError, match=r"batch\[1\] \(a 0-dim tensor\)"):
        scatter((torch.ones(4), torch.tensor(0.5)), CPU2)


def test_gather_concatenates_structures():
    outs = [
        {"y": torch.ones(2, 3), "aux": (torch.zeros(2), None), "name": "m"},
        {"y": torch.ones(1, 3), "aux": (torch.zeros(1), None), "name": "m"},
    ]
    got = gather(outs, "cpu")
    assert got["y"].shape == (3, 3) and got["aux"][0].shape == (3,)
    assert got["aux"][1] is None and got["name"] == "m"
    assert gather([torch.ones(2, 2), torch.ones(2, 1)], "cpu", dim=1).shape == (2, 3)


def test_gather_differing_non_tensors_become_a_list():
    assert gather([(torch.ones(1), 1), (torch.ones(1), 2)], "cpu")[1] == [1, 2]


def test_gather_dict_key_mismatch_is_an_error():
    keys = r"replica 1.*dict keys differ: \['a', 'b'\] vs \['a', 'c'\]"
    with pytest.raises(ValueError, match=keys):
        gather([{"a": torch.ones(1), "b": torch.ones(1)}, {"a": torch.ones(1), "c": torch.ones(1)}], "cpu")
    with pytest.raises(ValueError, match="different structures"):
        gather([(torch.ones(1),), [torch.ones(1)]], "cpu")


def test_gather_scalars_become_a_vector_with_a_warning():
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        got = gather([torch.tensor(1.0), torch.tensor(2.0)], "cpu")
    assert got.tolist() == [1.0, 2.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gather([torch.tensor(1.0)], "cpu", warn_on_scalars=False).shape == (1,)


def test_scatter_gather_autograd_roundtrip_and_double_backward():
    devices = [torch.device("cpu")] * 3

    def roundtrip(x):
        parts = Scatter.apply(devices, [2, 2, 1], 0, x)
        return Gather.apply(torch.device("cpu"), 0, *(p * (i + 1) for i, p in enumerate(parts)))

    x = torch.randn(5, 2, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(roundtrip, (x,))
    assert torch.autograd.gradgradcheck(roundtrip, (x,))


def test_scatter_of_tensor_requiring_grad_sends_grads_back():
    x = torch.randn(5, 3, requires_grad=True)
    parts = scatter(x, ["cpu"] * 3)
    assert all(p.grad_fn is not None for p in parts)
    gather([p * 2 for p in parts], "cpu").sum().backward()
    assert torch.equal(x.grad, torch.full((5, 3), 2.0))


def test_flatten_unflatten_roundtrip():
    obj = {"a": [1, (torch.ones(1), Pair(2, 3))], "b": Batch(torch.ones(2))}
    leaves, spec = flatten(obj)
    assert len(leaves) == 6  # 1, tensor, 2, 3, tensor, "b"
    back = unflatten(spec, leaves)
    assert back["a"][1][1] == Pair(2, 3) and torch.equal(back["b"].x, obj["b"].x)


# --- property: gather(scatter(x)) == x ----------------------------------------------------------
@dataclasses.dataclass
class Node:
    value: object
    tag: int = 0


def _batches(batch_size: int):
    def tensor(shape: list[int], seed: int) -> torch.Tensor:
        return torch.randn(batch_size, *shape, generator=torch.Generator().manual_seed(seed))

    tensors = st.builds(tensor, st.lists(st.integers(1, 3), max_size=2), st.integers(0, 2**16))
    others = st.one_of(st.integers(), st.text(max_size=3), st.none(), st.just(()), st.just([]))
    leaves = st.one_of(tensors, others)
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, min_size=1, max_size=3),
            st.lists(inner, min_size=1, max_size=3).map(tuple),
            st.dictionaries(st.text("abc", min_size=1, max_size=2), inner, min_size=1, max_size=3),
            st.tuples(inner, inner).map(lambda p: Pair(*p)),
            inner.map(Node),
        ),
        max_leaves=8,
    ).filter(lambda b: any(isinstance(t, torch.Tensor) for t in flatten(b)[0]))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, Node):
        return a.tag == b.tag and _same(a.value, b.value)
    return a == b


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch_size=st.integers(1, 7), devices=st.integers(1, 4))
def test_property_gather_of_scatter_is_identity(data, batch_size, devices):
    batch = data.draw(_batches(batch_size))
    parts = scatter(batch, ["cpu"] * devices)
    assert len(parts) == len(chunk_sizes(batch_size, devices)) <= devices
    assert len(parts) == min(devices, math.ceil(batch_size / math.ceil(batch_size / devices)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no 0-dim tensors here, so no scalar warning either
        assert _same(gather(parts, "cpu"), batch)
