"""ModelSummary hands a custom ``summarize`` Lightning's columns, FLOPs and shapes included."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import ember
from ember.callbacks import ModelSummary
from ember.callbacks.model_summary import summarize, summary_data
from tests.helpers.models import fast_trainer, regression_loader


class Example(ember.TrainModule):
    """A 10-20-5 encoder and a 5-1 head, three parameters of its own, and an example input of 4 samples."""

    def __init__(self, with_example: bool = True) -> None:
        super().__init__()
        self.extra = torch.nn.Parameter(torch.zeros(3))
        self.enc = torch.nn.Sequential(torch.nn.Linear(4, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))
        self.head = torch.nn.Linear(5, 1)
        if with_example:
            self.example_input_array = torch.randn(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_columns_flops_and_shapes_of_an_example_input():
    data = dict(summary_data(Example()))
    assert list(data) == [
        " ",
        "Name",
        "Type",
        "Params",
        "Mode",
        "FLOPs",
        "In sizes",
        "Out sizes",
        "Trainable",
        "Frozen",
    ]
    assert data["Name"] == ["enc", "head", "other params"]  # the module's own parameters: a row of their own
    assert data["Params"] == ["205", "6", "3"]
    # A linear layer's forward is 2 * batch * in * out FLOPs: 2*4*4*20 + 2*4*20*5 = 1440, 2*4*5*1 = 40.
    assert data["FLOPs"] == ["1.4 K", "40", "n/a"]
    assert data["In sizes"] == ["[4, 4]", "[4, 5]", "n/a"]
    assert data["Out sizes"] == ["[4, 5]", "[4, 1]", "n/a"]
    deep = dict(summary_data(Example(), max_depth=-1))
    assert deep["Name"] == ["enc", "enc.0", "enc.1", "enc.2", "head"]
    assert deep["FLOPs"] == ["1.4 K", "640", "0", "800", "40"]
    assert deep["Out sizes"][1] == "[4, 20]"


def test_without_an_example_input_flops_are_zero_and_there_are_no_shape_columns():
    data = dict(summary_data(Example(with_example=False)))
    assert list(data) == [" ", "Name", "Type", "Params", "Mode", "FLOPs", "Trainable", "Frozen"]
    assert data["FLOPs"] == ["0", "0", "n/a"]


def test_the_example_forward_leaves_the_modes_and_gradients_as_they_were():
    model = Example()
    model.head.eval()
    text = summarize(model)
    assert model.training and model.enc.training and not model.head.training
    assert all(p.grad is None for p in model.parameters())
    assert "1.5 K      Total Flops" in text  # 1440 + 40
    assert "4          Modules in train mode" in text and "1          Modules in eval mode" in text


def test_a_custom_summarize_gets_the_columns_in_lightnings_positions_and_the_totals():
    calls: list[dict[str, Any]] = []

    class Recording(ModelSummary):
        @staticmethod
        def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, **kw):
            calls.append(dict(data=summary_data, total=total_parameters, modes=total_training_modes, **kw))

    fast_trainer(callbacks=[Recording()], max_steps=1).fit(Example(), regression_loader(n=8))
    (call,) = calls
    assert [header for header, _ in call["data"][:6]] == [" ", "Name", "Type", "Params", "Mode", "FLOPs"]
    assert call["data"][4][1][:2] == ["train", "train"]
    assert call["total"] == 214 and call["modes"] == {"train": 5, "eval": 0}
    assert call["total_flops"] == 1480
