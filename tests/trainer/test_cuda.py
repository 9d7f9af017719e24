"""The single-device trainer on CUDA: skipped cleanly on machines without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.models import BoringModel, fast_trainer, regression_loader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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
