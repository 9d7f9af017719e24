"""Checkpoints on CUDA: written on the GPU and resumed on the CPU and back; exact mid-epoch resume.

Uses the resume suite's run (``tests/trainer/test_checkpoint_resume.py``: dropout, Adam, a step
scheduler, a checkpoint every 4 steps, 12 steps per epoch) with ``accelerator="cuda"``.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from ember.callbacks import Callback
from tests.cuda.cuda_helpers import needs_cuda
from tests.helpers.weights import assert_same_weights
from tests.trainer.test_checkpoint_resume import BATCH, EPOCHS, N, StopAt, fit

pytestmark = [needs_cuda, pytest.mark.timeout(120)]
STEPS_PER_EPOCH = N // BATCH


@pytest.fixture
def deterministic_reset():
    # deterministic=True switches torch's global flags on; later tests must not inherit them.
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = False


class Where(Callback):
    """Where the weights and the optimizer state are, and the weights when training starts."""

    def on_train_start(self, trainer, module):
        self.start = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        self.start_step = trainer.global_step

    def on_train_end(self, trainer, module):
        self.device = module.device.type
        state = trainer.optimizers[0].state
        self.optimizer_devices = {
            t.device.type for s in state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0
        }


def test_checkpoint_written_on_cuda_resumes_on_cpu_and_back(tmp_path):
    root = str(tmp_path)
    first, t1 = fit(root, max_epochs=1, accelerator="cuda")
    assert t1.global_step == STEPS_PER_EPOCH and first.device.type == "cuda"
    on_cpu = Where()
    _, t2 = fit(root, max_epochs=2, accelerator="cpu", ckpt_path="last", callbacks=[on_cpu])
    assert on_cpu.start_step == STEPS_PER_EPOCH and t2.global_step == 2 * STEPS_PER_EPOCH
    assert on_cpu.device == "cpu" and on_cpu.optimizer_devices == {"cpu"}
    for k, v in first.state_dict().items():  # the CPU run started from the GPU run's weights
        assert torch.equal(on_cpu.start[k], v.cpu()), k
    back = Where()
    last, t3 = fit(root, max_epochs=EPOCHS, accelerator="cuda", ckpt_path="last", callbacks=[back])
    assert back.start_step == 2 * STEPS_PER_EPOCH and t3.global_step == EPOCHS * STEPS_PER_EPOCH
    assert back.device == "cuda" and back.optimizer_devices == {"cuda"}
    assert len(last.seen) == N  # the last run trained exactly its one epoch


def test_mid_epoch_resume_on_cuda_with_deterministic_is_bitwise(tmp_path, monkeypatch, deterministic_reset):
    # cuBLAS needs this to be deterministic (torch raises without it); set here so that this test
    # checks the resume alone (test_deterministic_true_needs_no_setup_on_cuda checks the setup).
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    reference, _ = fit(str(tmp_path / "ref"), accelerator="cuda", deterministic=True)
    root = str(tmp_path / "run")
    with pytest.raises(RuntimeError, match="stop at step"):
        fit(root, callbacks=[StopAt(17)], accelerator="cuda", deterministic=True)
    gc.collect()
    resumed, trainer = fit(root, ckpt_path="last", accelerator="cuda", deterministic=True)
    assert trainer.global_step == EPOCHS * STEPS_PER_EPOCH
    assert_same_weights(resumed, reference, bitwise=True)  # dropout masks from the restored CUDA generator too


def test_deterministic_true_needs_no_setup_on_cuda(tmp_path, monkeypatch, deterministic_reset):
    # As Lightning: Trainer(deterministic=True) makes cuBLAS deterministic itself
    # (CUBLAS_WORKSPACE_CONFIG), rather than failing at the first matmul.
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    _, trainer = fit(str(tmp_path), max_epochs=1, accelerator="cuda", deterministic=True)
    assert trainer.global_step == STEPS_PER_EPOCH


def test_multi_rank_rng_form_carries_the_real_cuda_generators():
    # A multi-rank checkpoint exchanges every rank's states as one flat tensor: the CUDA
    # generators must survive it, or a ddp resume on GPUs draws other dropout masks.
    from ember.rng import apply_rng, capture_rng, rng_from_tensor, rng_to_tensor

    torch.cuda.init()
    state = capture_rng()
    assert len(state["cuda"]) == torch.cuda.device_count()
    expected = torch.rand(4, device="cuda")
    back = rng_from_tensor(rng_to_tensor(state), state)
    apply_rng(back)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
