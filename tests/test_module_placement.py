"""TrainModule's ``dtype``, ``on_gpu`` and ``local_rank`` (Lightning's ``DeviceDtypeModuleMixin`` and
``LightningModule`` properties).

Every expected value was first observed on Lightning 2.6.6 with the same classes (as LightningModule),
unless a test says that ember deliberately differs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ember
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


class Inner(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)


class Outer(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.seq = torch.nn.Sequential(Inner())  # a TrainModule below a plain module


def dtypes(m: Outer) -> tuple:
    return m.dtype, m.inner.dtype, m.seq[0].dtype, m.inner.layer.weight.dtype


def test_dtype_follows_each_conversion_on_every_nested_module():
    m = Outer()
    assert m.dtype is torch.float32
    m.double()
    assert dtypes(m) == (torch.float64,) * 4
    m.half()
    assert dtypes(m) == (torch.float16,) * 4
    m.float()
    assert dtypes(m) == (torch.float32,) * 4
    m.to(torch.float64)
    assert dtypes(m) == (torch.float64,) * 4
    m.to(dtype=torch.float16)
    assert dtypes(m) == (torch.float16,) * 4
    m.to("cpu")  # a device only: the dtype stays
    assert dtypes(m) == (torch.float16,) * 4
    m.to(torch.zeros(1))  # a tensor's dtype
    assert dtypes(m) == (torch.float32,) * 4
    m.to("cpu", torch.float64)
    assert dtypes(m) == (torch.float64,) * 4
    m.type(torch.float32)
    assert dtypes(m) == (torch.float32,) * 4
    assert m.to(tensor=torch.zeros(1, dtype=torch.float16)) is m and m.dtype is torch.float16


def test_dtype_is_tracked_not_read_from_the_parameters():
    m = Outer()
    m.bfloat16()  # as Lightning: bfloat16() is not one of the tracked conversions
    assert dtypes(m) == (torch.float32, torch.float32, torch.float32, torch.bfloat16)
    m.float()
    m.inner.double()  # a nested module's own conversion does not change its parent's
    assert dtypes(m) == (torch.float32, torch.float64, torch.float32, torch.float64)
    m2 = Outer()
    m2.type("torch.DoubleTensor")  # what type() was given, as Lightning
    assert m2.dtype == "torch.DoubleTensor"


def test_default_dtype_at_construction_and_copies():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert Outer().dtype is torch.float64
    finally:
        torch.set_default_dtype(previous)
    import copy
    import pickle

    m = Outer().double()
    assert copy.deepcopy(m).dtype is torch.float64 and pickle.loads(pickle.dumps(m)).dtype is torch.float64


def test_setting_dtype_says_to_convert_instead():
    m = Outer()
    with pytest.raises(RuntimeError, match=r"Cannot set Outer.dtype .* module.to\(dtype\)"):
        m.dtype = torch.float64
    assert m.dtype is torch.float32


def test_a_failed_conversion_leaves_dtype_as_it_was():
    # ember deliberately differs: Lightning records int64 before torch refuses the conversion.
    m = Outer()
    with pytest.raises(TypeError):
        m.to(torch.int64)
    assert m.dtype is torch.float32


def test_on_gpu_and_local_rank_outside_a_trainer():
    m = Outer()
    assert m.on_gpu is False and m.local_rank == 0
    m.trainer = SimpleNamespace(local_rank=3)  # (what the module reads of its Trainer)
    assert m.local_rank == 3 and m.inner.local_rank == 3


class Seen(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.dtype, self.local_rank, self.on_gpu))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("precision, dtype", [("32-true", torch.float32), ("64-true", torch.float64)])
def test_inside_a_fit(precision, dtype):
    m = Seen()
    fast_trainer(precision=precision, max_epochs=1).fit(m, regression_loader(n=8, batch_size=4))
    assert m.seen[0] == (dtype, 0, False) and m.dtype is dtype


def test_to_torchscript_does_not_compile_the_properties():
    m = BoringModel()
    scripted = m.to_torchscript()
    assert scripted(torch.zeros(1, 4)).shape[0] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_gpu_on_a_gpu():
    m = Outer().cuda()
    assert m.on_gpu is True and m.device.type == "cuda"
