"""TrainModule.to_torchscript and to_onnx (Lightning's methods): eval mode while exporting, the training
flags back afterwards, example_input_array as the default input, and clear errors for what is missing."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import BoringModel, fast_trainer, regression_loader


class WithDropout(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)
        self.example_input_array = torch.ones(3, 4)

    def forward(self, x):
        return self.layer(self.drop(x))


@pytest.mark.parametrize("method", ["script", "trace"])
def test_to_torchscript_exports_in_eval_mode_and_puts_the_mode_back(method, tmp_path):
    module = WithDropout()
    fast_trainer(max_steps=1).fit(module, regression_loader())  # after a fit, as a user would
    module.train()
    path = tmp_path / "model.pt"
    scripted = module.to_torchscript(path, method=method)
    assert module.training and module.drop.training
    x = torch.randn(5, 4)
    loaded = torch.jit.load(str(path))
    module.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), module(x))  # eval mode: no dropout, same numbers
        assert torch.equal(scripted(x), module(x))


def test_to_torchscript_errors_say_what_to_do():
    with pytest.raises(ValueError, match="use 'script' or 'trace'"):
        BoringModel().to_torchscript(method="compile")
    with pytest.raises(ValueError, match=r"pass example_inputs=\.\.\., or set self\.example_input_array"):
        BoringModel().to_torchscript(method="trace")


@pytest.mark.timeout(240)
def test_to_onnx_writes_a_model_that_onnx_reads(tmp_path, monkeypatch):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    import tqdm

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # the exporter's progress bars: no monitor thread
    module = WithDropout()
    path = tmp_path / "model.onnx"
    module.to_onnx(path)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert [i.name for i in model.graph.input] and module.training
    assert not any(node.op_type == "Dropout" for node in model.graph.node)  # exported in eval mode
    with pytest.raises(ValueError, match=r"pass input_sample=\.\.\., or set self\.example_input_array"):
        BoringModel().to_onnx(tmp_path / "none.onnx")
