"""``strategy="fsdp"`` on CUDA (NCCL): what the gloo tests (``tests/strategies/test_fsdp.py``) cannot show.

On one GPU the job is one rank (a mesh of one): the fit equals a plain CUDA loop, bf16 mixed precision
computes in bf16 on fp32 shards, ``cpu_offload`` keeps the shards on the CPU and trains the same, a sharded
checkpoint resumes bitwise. On two GPUs, the same against ``ddp``. Skipped without CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

import ember
from ember.strategies.fsdp import FSDPStrategy
from tests.cuda.cuda_helpers import MLP, loader, needs_cuda, plain_cuda_loop, trainer

pytestmark = [pytest.mark.processes, needs_cuda, pytest.mark.timeout(120)]


def whole(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu()
        for k, v in module.state_dict().items()
    }


def test_one_gpu_fsdp_fit_equals_a_plain_cuda_loop():
    module = MLP()
    t = trainer(strategy="fsdp")
    t.fit(module, loader())
    weight = module.net[0].weight
    assert hasattr(weight, "to_local") and weight.to_local().device.type == "cuda"
    assert t.global_step == 8
    reference = plain_cuda_loop()
    for (name, got), want in zip(whole(module).items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want.float().cpu(), atol=1e-6, rtol=0, msg=name)


def test_bf16_mixed_computes_in_bf16_on_fp32_shards():
    module = MLP()
    t = trainer(strategy="fsdp", precision="bf16-mixed")
    t.fit(module, loader())
    assert module.seen[0] == ("cuda", torch.bfloat16)  # the forward's output: bf16 compute
    assert module.net[0].weight.dtype == torch.float32  # the sharded parameters the optimizer steps
    assert torch.isfinite(t.callback_metrics["loss"])


def test_cpu_offload_keeps_the_shards_on_the_cpu_and_trains_the_same():
    module = MLP()
    trainer(strategy=FSDPStrategy(cpu_offload=True)).fit(module, loader())
    assert module.net[0].weight.to_local().device.type == "cpu"
    reference = MLP()
    trainer(strategy="fsdp").fit(reference, loader())
    for name, got in whole(module).items():
        torch.testing.assert_close(got, whole(reference)[name], atol=1e-5, rtol=0, msg=name)


def test_a_sharded_checkpoint_resumes_bitwise_on_the_gpu(tmp_path):
    straight = MLP()
    trainer(strategy="fsdp", max_epochs=3).fit(straight, loader(shuffle=True))
    ckpt = lambda: ember.callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_last=True)  # noqa: E731
    trainer(strategy="fsdp", max_epochs=1, enable_checkpointing=True, callbacks=[ckpt()]).fit(
        MLP(), loader(shuffle=True)
    )
    assert os.path.isdir(tmp_path / "last.ckpt")
    resumed = MLP()
    t = trainer(strategy="fsdp", max_epochs=3, enable_checkpointing=True, callbacks=[ckpt()])
    t.fit(resumed, loader(shuffle=True), ckpt_path="last")
    got, want = whole(resumed), whole(straight)
    assert all(torch.equal(got[k], want[k]) for k in want)
    loaded = whole(MLP.load_from_checkpoint(str(tmp_path / "last.ckpt")))  # a plain process's whole read
    assert all(torch.equal(loaded[k], got[k]) for k in got)
