"""Precision on CPU: 32-true, 64-true, bf16-mixed (autocast) and 16-mixed (autocast + GradScaler)."""

from __future__ import annotations

import pytest
import torch

from ember.trainer.precision import Precision, normalize_precision
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


def _cpu_fp16_autocast_works() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            out = torch.nn.Linear(2, 2)(torch.randn(1, 2))
        torch.amp.GradScaler("cpu")
        return out.dtype == torch.float16
    except (RuntimeError, ValueError, TypeError):
        return False


needs_cpu_fp16 = pytest.mark.skipif(
    not _cpu_fp16_autocast_works(), reason="this torch build has no float16 autocast / GradScaler on CPU"
)


class Spy(BoringModel):
    """Records the dtypes seen in the step and the gradient norm seen before the optimizer step."""

    def __init__(self, loss_factor: float = 1.0) -> None:
        super().__init__()
        self.loss_factor = loss_factor
        self.seen: dict[str, object] = {}
        self.grad_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.seen.update(
            x=x.dtype, out=out.dtype, param=self.layer.weight.dtype, autocast=torch.is_autocast_enabled("cpu")
        )
        if out.dtype != torch.float64:
            out = out.float()
        return self.loss_factor * torch.nn.functional.mse_loss(out, y.to(out.dtype))

    def on_before_optimizer_step(self, optimizer):
        self.grad_norms.append(float(torch.linalg.vector_norm(self.layer.weight.grad)))


def _fit(precision, loss_factor=1.0, **kwargs):
    torch.manual_seed(0)
    module = Spy(loss_factor)
    trainer = fast_trainer(precision=precision, **kwargs)
    trainer.fit(module, regression_loader())
    return trainer, module


def test_32_true():
    trainer, m = _fit("32-true")
    assert trainer.precision == "32-true"
    assert m.seen == {"x": torch.float32, "out": torch.float32, "param": torch.float32, "autocast": False}


def test_64_true_converts_module_and_floating_inputs():
    trainer, m = _fit("64-true")
    assert trainer.precision == "64-true"
    assert m.seen["x"] == m.seen["out"] == m.seen["param"] == torch.float64
    assert m.layer.weight.dtype == torch.float64


def test_64_true_leaves_integer_inputs_alone():
    seen = []

    class Ints(BoringModel):
        def training_step(self, batch, batch_idx):
            x, idx = batch
            seen.append(idx.dtype)
            return self(x).sum()

    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 4), torch.arange(8)), batch_size=4
    )
    fast_trainer(precision="64-true").fit(Ints(), loader)
    assert seen == [torch.int64, torch.int64]


def test_64_true_matches_a_double_precision_loop():
    torch.manual_seed(0)
    module = BoringModel()
    reference = BoringModel()
    reference.load_state_dict(module.state_dict())
    reference.double()
    opt = reference.configure_optimizers()
    for x, y in regression_loader():
        opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x.double()), y.double()).backward()
        opt.step()
    fast_trainer(precision=64).fit(module, regression_loader())
    torch.testing.assert_close(module.layer.weight, reference.layer.weight, atol=1e-12, rtol=0)


def test_bf16_mixed_autocasts_forward_and_keeps_float32_weights():
    trainer, m = _fit("bf16-mixed")
    assert trainer.precision == "bf16-mixed"
    assert m.seen == {"x": torch.float32, "out": torch.bfloat16, "param": torch.float32, "autocast": True}
    assert trainer._precision.scaler is None


def test_bf16_mixed_trains_close_to_32():
    _, m32 = _fit("32-true", max_epochs=3)
    _, m16 = _fit("bf16-mixed", max_epochs=3)
    torch.testing.assert_close(m16.layer.weight, m32.layer.weight, atol=5e-2, rtol=0)


def test_bf16_mixed_autocasts_evaluation_and_prediction():
    trainer = fast_trainer(precision="bf16-mixed")
    out = trainer.predict(BoringModel(), regression_loader(n=8))
    assert out[0].dtype == torch.bfloat16


@needs_cpu_fp16
def test_16_mixed_uses_a_grad_scaler_and_unscales_before_the_optimizer_step():
    # A small loss, so that loss * 65536 (the scaler's first scale) does not overflow float16.
    trainer, m16 = _fit("16-mixed", loss_factor=1e-2)
    _, m32 = _fit("32-true", loss_factor=1e-2)
    assert trainer.precision == "16-mixed"
    assert isinstance(trainer._precision.scaler, torch.amp.GradScaler)
    assert m16.seen["out"] == torch.float16 and m16.seen["param"] == torch.float32 and m16.seen["autocast"]
    # The hook sees true-scale gradients, not gradients times the loss scale (65536).
    assert m16.grad_norms == pytest.approx(m32.grad_norms, rel=1e-2)
    torch.testing.assert_close(m16.layer.weight, m32.layer.weight, atol=1e-2, rtol=0)


@needs_cpu_fp16
def test_16_mixed_clipping_happens_on_unscaled_gradients():
    _, m16 = _fit("16-mixed", loss_factor=1e-2, gradient_clip_val=0.005)
    _, m32 = _fit("32-true", loss_factor=1e-2, gradient_clip_val=0.005)
    _, unclipped = _fit("32-true", loss_factor=1e-2)
    torch.testing.assert_close(m16.layer.weight, m32.layer.weight, atol=1e-4, rtol=0)
    assert not torch.allclose(m32.layer.weight, unclipped.layer.weight, atol=1e-3)


@needs_cpu_fp16
def test_16_mixed_skips_steps_whose_gradients_overflow():
    # loss * 65536 overflows float16 on the first batches: the scaler skips those steps and lowers its scale.
    trainer, m = _fit("16-mixed", loss_factor=1e4, limit_train_batches=1)
    assert len(m.grad_norms) == 1 and not torch.isfinite(torch.tensor(m.grad_norms[0]))
    torch.manual_seed(0)
    assert torch.equal(m.layer.weight, Spy().layer.weight)  # the step was skipped
    assert trainer._precision.scaler.get_scale() < 65536.0


class SkipsWindows(BoringModel):
    """training_step returns None on ``none_at``; records on_before_optimizer_step (global step, whether there
    are gradients) and configure_gradient_clipping, and the weights at each hook."""

    def __init__(self, none_at: set[int]) -> None:
        super().__init__()
        self.none_at = none_at
        self.calls: list[str] = []
        self.weights: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        return None if batch_idx in self.none_at else super().training_step(batch, batch_idx) * 1e-2

    def on_before_optimizer_step(self, optimizer):
        grad = self.layer.weight.grad
        self.calls.append(f"before_step gs={self.trainer.global_step} grad={grad is not None}")
        self.weights.append(self.layer.weight.detach().clone())

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.calls.append(f"clip {gradient_clip_val}")
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", pytest.param("16-mixed", marks=needs_cpu_fp16)])
def test_a_window_whose_batches_all_returned_none_still_runs_the_pre_step_hooks(precision):
    # As Lightning 2.6.6 (under each precision it runs on the CPU): the step of a window whose batches all
    # returned None counts, and on_before_optimizer_step and configure_gradient_clipping run for it, on no
    # gradients. Under 16-mixed nothing was scaled, so nothing is unscaled: the scaler's next step works.
    torch.manual_seed(0)
    module = SkipsWindows({0, 1, 4, 5})
    trainer = fast_trainer(
        precision=precision, accumulate_grad_batches=2, gradient_clip_val=1.0, limit_train_batches=8, max_epochs=1
    )
    with pytest.warns(UserWarning, match="training_step returned None for batch 0"):
        trainer.fit(module, regression_loader(n=64))
    assert module.calls == [
        "before_step gs=0 grad=False",
        "clip 1.0",
        "before_step gs=1 grad=True",
        "clip 1.0",
        "before_step gs=2 grad=False",
        "clip 1.0",
        "before_step gs=3 grad=True",
        "clip 1.0",
    ]
    assert trainer.global_step == 4
    w = module.weights + [module.layer.weight.detach()]
    assert torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])  # the first window updated nothing
    assert torch.equal(w[2], w[3]) and not torch.equal(w[3], w[4])  # nor the third; the fourth did


@pytest.mark.parametrize(
    "alias,name",
    [
        (32, "32-true"),
        ("32", "32-true"),
        (64, "64-true"),
        ("64", "64-true"),
        ("bf16", "bf16-mixed"),
        (16, "16-mixed"),
        ("16", "16-mixed"),
        ("16-mixed", "16-mixed"),
    ],
)
def test_precision_aliases(alias, name):
    assert normalize_precision(alias) == name
    assert fast_trainer(precision=alias).precision == name


@pytest.mark.parametrize("bad", ["fp8", "16-true", 8])
def test_unknown_precision(bad):
    message = r"Unknown precision .*Use one of '32-true', '64-true', 'bf16-mixed', '16-mixed'"
    with pytest.raises(ValueError, match=message):
        fast_trainer(precision=bad)


def test_precision_none_is_the_default():
    """As Lightning 2.6.6: Trainer(precision=None).precision == '32-true'."""
    assert fast_trainer(precision=None).precision == "32-true"


def test_precision_plugin_state_dict_round_trip():
    p = Precision("32-true", "cpu")
    assert p.state_dict() == {}
    p.load_state_dict({})
