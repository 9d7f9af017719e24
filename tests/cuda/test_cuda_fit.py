"""One GPU through the Trainer: the fit equals a plain CUDA loop, every precision, batch transfer,
the accelerator and device choice.

Skipped without CUDA (the whole suite is: ``tests/cuda`` runs on a GPU machine through
``benchmarks/device_check.sh``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.utils import move_to_device
from tests.cuda.cuda_helpers import (
    MLP,
    assert_close_modules,
    loader,
    needs_cuda,
    needs_two_gpus,
    plain_cuda_loop,
    trainer,
)
from tests.helpers.models import BoringModel, fast_trainer, regression_loader

pytestmark = [pytest.mark.processes, needs_cuda, pytest.mark.timeout(120)]


def test_single_device_fit_equals_a_plain_cuda_loop():
    module = MLP()
    t = trainer()
    t.fit(module, loader())
    assert module.device == torch.device("cuda", 0) and module.seen[0] == ("cuda", torch.float32)
    assert t.global_step == 8
    assert_close_modules(module, plain_cuda_loop())


@pytest.mark.parametrize(
    "precision, dtype",
    [
        ("32-true", torch.float32),
        ("bf16-mixed", torch.bfloat16),
        ("16-mixed", torch.float16),
        ("64-true", torch.float64),
    ],
)
def test_each_precision_matches_the_same_plain_cuda_loop(precision, dtype):
    module = MLP()
    t = trainer(precision=precision)
    t.fit(module, loader())
    assert module.seen[0] == ("cuda", dtype)
    if precision == "64-true":
        assert next(module.parameters()).dtype == torch.float64
        reference = plain_cuda_loop().double()
        atol = 1e-5  # float64 here, float32 in the loop
    else:
        assert next(module.parameters()).dtype == torch.float32  # mixed precision keeps float32 weights
        reference = plain_cuda_loop(autocast=dtype if dtype != torch.float32 else None, scaler=precision == "16-mixed")
        atol = 1e-6
    if precision == "16-mixed":
        assert t._precision.scaler is not None and t._precision.scaler.get_scale() > 0
    assert_close_modules(module, reference, atol=atol)


def test_pinned_batches_are_moved_to_the_gpu_without_blocking_and_arrive_intact():
    pinned: list[bool] = []
    values: list[float] = []

    class Spy(MLP):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            pinned.append(batch[0].is_pinned())
            return batch

        def training_step(self, batch, batch_idx):
            values.append(float(batch[0].sum()))  # read at once: the copy must have landed
            return super().training_step(batch, batch_idx)

    t = trainer(max_epochs=1)
    t.fit(Spy(), loader(pin_memory=True))
    assert pinned and all(pinned)
    expected = [float(x.sum()) for x, _ in loader()]
    assert values == pytest.approx(expected, abs=1e-4)


def test_moving_to_the_cpu_never_copies_asynchronously():
    # A non-blocking copy towards the CPU returns before the data has landed, so
    # a value read (or pickled by ddp_spawn) at once could be stale. The GPU is kept busy first.
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the fill
    x.fill_(7.0)
    moved = move_to_device({"x": x}, torch.device("cpu"))["x"]
    assert bool((moved == 7.0).all()), "the CPU copy was read before it had landed"


def test_the_module_transfer_hook_default_lands_on_the_gpu_asynchronously():
    # The copy is queued behind ~0.1 s of GPU work: a hook that waited for it (a blocking copy, a
    # synchronisation) returns only once that work is done, so the event recorded after it has completed.
    batch = (torch.randn(4, 8).pin_memory(), torch.randn(4, 1).pin_memory())
    module = MLP()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    moved = module.transfer_batch_to_device(batch, torch.device("cuda", 0), 0)
    returned = torch.cuda.Event()
    returned.record()
    assert not returned.query(), "the hook waited for the GPU: the copy was not asynchronous"
    torch.cuda.synchronize()
    assert all(t.device.type == "cuda" for t in moved)
    assert torch.equal(moved[0].cpu(), batch[0]) and torch.equal(moved[1].cpu(), batch[1])


@needs_two_gpus
@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_devices_1_makes_gpu_1_the_current_device(strategy):
    # Work that names no device (a "cuda" tensor made in a step) lands on GPU 1.
    current: list[int] = []

    class Spy(MLP):
        def training_step(self, batch, batch_idx):
            current.append(torch.cuda.current_device())
            assert torch.ones(1, device="cuda").device == torch.device("cuda", 1)
            return super().training_step(batch, batch_idx)

    try:
        trainer(strategy=strategy, devices=[1], max_epochs=1).fit(Spy(), loader())
    finally:
        torch.cuda.set_device(0)  # the fit leaves GPU 1 current, as Lightning does; later tests expect 0
    assert set(current) == {1}


def test_logged_values_stay_on_the_gpu():
    # No per-step copy to the host: callback_metrics hold CUDA tensors, read only when printed.
    t = trainer(max_epochs=1)
    t.fit(MLP(), loader())
    assert t.callback_metrics["loss"].device.type == "cuda"


# ---------------------------------------------------------------------- accelerator choice, the tests' BoringModel
def test_auto_accelerator_picks_cuda():
    trainer = fast_trainer(accelerator="auto")
    assert trainer.strategy.root_device == torch.device("cuda", 0)


def test_fit_on_cuda_matches_a_plain_cuda_loop():
    torch.manual_seed(0)
    module = BoringModel()
    reference = BoringModel()
    reference.load_state_dict(module.state_dict())
    reference.cuda()
    opt = reference.configure_optimizers()
    for x, y in regression_loader():
        opt.zero_grad()
        F.mse_loss(reference(x.cuda()), y.cuda()).backward()
        opt.step()
    trainer = fast_trainer(accelerator="cuda", devices=1)
    trainer.fit(module, regression_loader())
    assert module.device.type == "cuda"
    torch.testing.assert_close(module.layer.weight, reference.layer.weight, atol=1e-6, rtol=0)


def test_16_mixed_on_cuda_uses_a_cuda_grad_scaler():
    seen = []

    class Spy(BoringModel):
        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self(x)
            seen.append((x.device.type, out.dtype))
            return 1e-2 * F.mse_loss(out.float(), y)

    trainer = fast_trainer(accelerator="cuda", precision="16-mixed")
    trainer.fit(Spy(), regression_loader())
    assert seen[0] == ("cuda", torch.float16)
    assert trainer._precision.scaler is not None and trainer.global_step == 4


def test_more_devices_than_this_machine_has():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"devices={n + 1} but only {n} CUDA device\(s\) are available"):
        fast_trainer(accelerator="cuda", devices=n + 1)
