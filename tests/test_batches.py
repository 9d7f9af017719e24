"""The nested-batch walkers: what each keeps, and where lightning-utilities' differs.

ember.utils.move_to_device (the Trainer's transfer and TrainModule's default hook), first_tensor,
DataModule's default transfer, scatter/gather's flatten/unflatten, and apply_to_collection as
DistributedDataParallel calls it. The CPU float64 cast is the observable "moved" here.
"""

from __future__ import annotations

import collections
import dataclasses
import types

import pytest
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

import ember
from ember.parallel.data_parallel import _to_device
from ember.parallel.scatter_gather import flatten, unflatten
from ember.utils import first_tensor, move_to_device

CPU = torch.device("cpu")
F64 = torch.float64
Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Sample:
    x: Tensor
    name: str = "s"


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: Tensor
    y: Tensor


@dataclasses.dataclass
class Derived:
    x: Tensor
    doubled: Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.doubled = self.x * 2


class Tagged(collections.UserDict):
    pass


def _nested() -> tuple[dict, dict]:
    """A batch nesting every walked container, and its non-tensor leaves by name."""
    leaves = {"text": "hello", "ids": [1, 2], "meta": {"split": "train"}, "none": None, "obj": object()}
    batch = {
        "inputs": [torch.ones(2, 3), (torch.zeros(2), leaves["text"])],
        "pair": Pair(torch.full((2,), 0.5), torch.arange(2)),
        "sample": Sample(torch.ones(2), name="a"),
        "ordered": collections.OrderedDict(mask=torch.ones(2, dtype=torch.bool), ids=leaves["ids"]),
        "plain": leaves["meta"],
        "none": leaves["none"],
        "obj": leaves["obj"],
        "nested": [Pair(Sample(torch.ones(1)), [torch.ones(1, dtype=torch.float16)])],
    }
    return batch, leaves


def _assert_moved(out: dict, leaves: dict) -> None:
    assert type(out) is dict
    assert type(out["inputs"]) is list and type(out["inputs"][1]) is tuple
    assert out["inputs"][0].dtype == F64 and out["inputs"][1][0].dtype == F64
    assert out["inputs"][1][1] is leaves["text"]
    assert type(out["pair"]) is Pair
    assert out["pair"].x.dtype == F64 and out["pair"].y.dtype == torch.int64  # only floats are cast
    assert torch.equal(out["pair"].y, torch.arange(2))
    assert type(out["sample"]) is Sample and out["sample"].x.dtype == F64 and out["sample"].name == "a"
    assert type(out["ordered"]) is collections.OrderedDict and list(out["ordered"]) == ["mask", "ids"]
    assert out["ordered"]["mask"].dtype == torch.bool and out["ordered"]["ids"] == leaves["ids"]
    assert out["plain"] == {"split": "train"}
    assert out["none"] is None and out["obj"] is leaves["obj"]
    inner = out["nested"][0]
    assert type(inner) is Pair and type(inner.x) is Sample and inner.x.x.dtype == F64
    assert type(inner.y) is list and inner.y[0].dtype == F64


# ---------------------------------------------------------------------- move_to_device (own walker)
def test_move_to_device_walks_every_container_and_keeps_types_and_leaves():
    batch, leaves = _nested()
    out = move_to_device(batch, CPU, F64)
    _assert_moved(out, leaves)
    assert batch["inputs"][0].dtype == torch.float32  # the input batch is not changed in place


def test_train_module_default_transfer_is_move_to_device():
    batch, leaves = _nested()
    out = ember.TrainModule().transfer_batch_to_device(batch, CPU, 0)
    assert type(out["pair"]) is Pair and type(out["sample"]) is Sample
    assert out["inputs"][0].dtype == torch.float32 and out["obj"] is leaves["obj"]


def test_move_to_device_rebuilds_frozen_dataclasses_where_the_library_cannot():
    batch = Frozen(torch.ones(2), torch.zeros(2))
    out = move_to_device(batch, CPU, F64)
    assert type(out) is Frozen and out.x.dtype == F64 and out.y.dtype == F64
    with pytest.raises(ValueError, match="frozen dataclass"):
        apply_to_collection(batch, Tensor, Tensor.to, F64)
    unmoved = apply_to_collection(batch, Tensor, Tensor.to, F64, allow_frozen=True)
    assert unmoved.x.dtype == torch.float32  # allow_frozen gives it back unmoved


def test_move_to_device_reruns_post_init_where_the_library_keeps_the_old_field():
    out = move_to_device(Derived(torch.ones(2)), CPU, F64)
    assert out.doubled.dtype == F64 and torch.equal(out.doubled, torch.full((2,), 2.0, dtype=F64))
    stale = apply_to_collection(Derived(torch.ones(2)), Tensor, Tensor.to, F64)
    assert stale.x.dtype == F64 and stale.doubled.dtype == torch.float32


def test_move_to_device_leaves_other_sequences_and_mappings_alone():
    proxy = types.MappingProxyType({"a": torch.ones(1)})
    batch = (torch.ones(1), range(3), proxy, b"raw")
    out = move_to_device(batch, CPU, F64)
    assert out[0].dtype == F64 and out[1] is batch[1] and out[2] is proxy and out[3] is batch[3]
    with pytest.raises(TypeError):
        apply_to_collection(batch, Tensor, Tensor.to, F64)  # the library rebuilds range(...) from a list


def test_move_to_device_keeps_defaultdict_factory_and_tuple_subclasses():
    class Row(tuple):
        pass

    dd = collections.defaultdict(list, x=torch.ones(1))
    out = move_to_device([dd, Row((torch.ones(1), 3))], CPU, F64)
    assert type(out[0]) is collections.defaultdict and out[0].default_factory is list
    assert out[0]["x"].dtype == F64
    assert type(out[1]) is Row and out[1][0].dtype == F64 and out[1][1] == 3


# ---------------------------------------------------------------------- first_tensor (own search)
def test_first_tensor_returns_the_first_tensor_in_walk_order():
    first, second = torch.zeros(4, 2), torch.zeros(7)
    batch = {"meta": ["id", 3, None], "inner": (Pair(None, Sample(first)), second)}
    assert first_tensor(batch) is first
    assert first_tensor([Frozen(second, first)]) is second
    assert first_tensor({"a": [1, "x"], "b": (None,)}) is None


# ---------------------------------------------------------------------- DataModule's default transfer
def test_datamodule_default_transfer_moves_anything_with_a_to():
    class Movable:
        def __init__(self) -> None:
            self.moved_to = None

        def to(self, device):
            self.moved_to = device
            return self

    movable = Movable()
    batch = {
        "pair": Pair(torch.ones(2), "label"),
        "items": [torch.ones(1), movable],
        "ordered": collections.OrderedDict(x=torch.ones(1)),
    }
    sample = Sample(torch.ones(1))
    batch["sample"] = sample
    out = ember.DataModule().transfer_batch_to_device(batch, F64, 0)  # Tensor.to(F64) casts
    assert type(out["pair"]) is Pair and out["pair"].x.dtype == F64 and out["pair"].y == "label"
    assert out["items"][0].dtype == F64 and out["items"][1] is movable and movable.moved_to == F64
    assert type(out["ordered"]) is dict and out["ordered"]["x"].dtype == F64  # a plain dict comes back
    assert out["sample"] is sample and sample.x.dtype == torch.float32  # dataclasses are leaves


# ---------------------------------------------------------------------- scatter's flatten / unflatten
def test_flatten_unflatten_round_trip_keeps_types_and_leaves():
    batch, leaves = _nested()
    batch["frozen"] = Frozen(torch.ones(2), torch.zeros(2))
    tagged = Tagged(x=torch.ones(2))
    tagged.tag = "kept"
    batch["tagged"] = tagged
    flat, spec = flatten(batch)
    assert sum(isinstance(leaf, Tensor) for leaf in flat) == 11
    out = unflatten(
        spec, [leaf.to(F64) if isinstance(leaf, Tensor) and leaf.is_floating_point() else leaf for leaf in flat]
    )
    _assert_moved(out, leaves)
    assert type(out["frozen"]) is Frozen and out["frozen"].x.dtype == F64
    assert type(out["tagged"]) is Tagged and out["tagged"].tag == "kept" and out["tagged"]["x"].dtype == F64
    assert batch["frozen"].x.dtype == torch.float32


def test_flatten_of_a_leaf_and_of_empty_containers():
    t = torch.ones(1)
    assert flatten(t) == ([t], None)
    empty: tuple[list, dict, tuple] = ([], {}, ())
    flat, spec = flatten(empty)
    assert flat[0] is empty[0] and flat[1] is empty[1] and flat[2] is empty[2]
    assert unflatten(spec, flat) == empty


def test_data_parallel_single_device_transfer_returns_the_batch_when_nothing_moves():
    batch = (torch.ones(2), {"x": Pair(torch.zeros(2), "y")})
    assert _to_device(batch, CPU) is batch


# ---------------------------------------------------------------------- the library, as DDP calls it
def test_apply_to_collection_as_ddp_uses_it_keeps_namedtuples_and_dataclasses():
    batch, leaves = _nested()
    out = apply_to_collection(batch, Tensor, Tensor.to, F64, non_blocking=True)
    assert type(out["pair"]) is Pair and out["pair"].x.dtype == F64
    assert type(out["sample"]) is Sample and out["sample"].x.dtype == F64 and out["sample"].name == "a"
    assert out["obj"] is leaves["obj"] and out["inputs"][1][1] is leaves["text"]
    grad_fns: list = []
    y = torch.ones(2, requires_grad=True) * 2
    apply_to_collection({"loss": y, "n": 3}, Tensor, lambda t: grad_fns.append(t.grad_fn))
    assert grad_fns == [y.grad_fn]
