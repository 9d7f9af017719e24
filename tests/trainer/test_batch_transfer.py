"""Moving batches to the device (and casting them for 64-true), and inferring their size for self.log."""

from __future__ import annotations

import collections
import dataclasses

import torch

from ember.utils import closest, first_tensor, infer_batch_size, move_to_device
from tests.helpers.models import BoringModel, fast_trainer

CPU = torch.device("cpu")
Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    n: int = 0
    derived: torch.Tensor | None = dataclasses.field(init=False, default=None)


def test_move_keeps_structure_and_casts_only_floats():
    batch = {"a": (torch.ones(2), [torch.arange(3), "text"]), "b": Pair(torch.zeros(1), 7), "c": None}
    out = move_to_device(batch, CPU, torch.float64)
    assert type(out) is dict and type(out["a"]) is tuple and type(out["a"][1]) is list
    assert out["a"][0].dtype == torch.float64 and out["a"][1][0].dtype == torch.int64
    assert out["a"][1][1] == "text" and out["c"] is None
    assert isinstance(out["b"], Pair) and out["b"].x.dtype == torch.float64 and out["b"].y == 7


def test_move_without_dtype_leaves_dtypes():
    out = move_to_device([torch.ones(1, dtype=torch.float16)], CPU)
    assert out[0].dtype == torch.float16


def test_move_dataclasses_and_mapping_subclasses():
    out = move_to_device(Batch(torch.ones(2), n=3), CPU, torch.float64)
    assert isinstance(out, Batch) and out.x.dtype == torch.float64 and out.n == 3
    ordered = move_to_device(collections.OrderedDict(x=torch.ones(1)), CPU, torch.float64)
    assert type(ordered) is collections.OrderedDict and ordered["x"].dtype == torch.float64
    dd = collections.defaultdict(list, x=torch.ones(1))
    moved = move_to_device(dd, CPU, torch.float64)
    assert type(moved) is collections.defaultdict and moved.default_factory is list
    assert moved["x"].dtype == torch.float64


def test_a_defaultdict_batch_trains_in_64_true():
    class DictModel(BoringModel):
        def training_step(self, batch, batch_idx):
            assert batch["x"].dtype == torch.float64
            return self(batch["x"]).pow(2).mean()

    loader = [collections.defaultdict(list, x=torch.randn(4, 4)) for _ in range(2)]
    trainer = fast_trainer(precision="64-true")
    trainer.fit(DictModel(), loader)
    assert trainer.global_step == 2


def test_infer_batch_size_and_first_tensor():
    assert infer_batch_size((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert infer_batch_size({"meta": "id", "x": [torch.zeros(3, 1)]}) == 3
    assert infer_batch_size(Batch(torch.zeros(6))) == 6
    assert infer_batch_size(torch.tensor(1.0)) == 1  # a scalar counts as one
    assert infer_batch_size(["no tensors"]) == 1
    assert first_tensor({"a": 1}) is None


def test_closest():
    assert closest("singel", ["single", "dp", "ddp"]) == "single"
    assert closest("xyz", ["single", "dp"]) is None
