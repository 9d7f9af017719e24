"""RichModelSummary: ModelSummary's rows and totals drawn as a rich table; rich stays optional."""

from __future__ import annotations

import importlib.util
import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ModelSummary, RichModelSummary


class Net(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 1)
        self.head.requires_grad_(False)
        self.example_input_array = torch.zeros(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.encoder.parameters(), lr=0.1)


def printed(monkeypatch: pytest.MonkeyPatch, callback: ModelSummary) -> str:
    rich = pytest.importorskip("rich")
    from rich.console import Console

    out = io.StringIO()
    monkeypatch.setattr(rich, "_console", Console(file=out, width=160, color_system=None))  # get_console()'s
    trainer = ember.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
        callbacks=[callback],
    )  # fmt: skip
    trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 1)), batch_size=2))
    return out.getvalue()


def test_the_summary_is_a_rich_table_of_model_summarys_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    text = printed(monkeypatch, RichModelSummary())
    rows = [line for line in text.splitlines() if "│" in line]
    assert len(rows) == 2
    cells = [[c.strip() for c in row.strip("│ ").split("│")] for row in rows]
    # #, Name, Type, Params, Mode, FLOPs, In sizes, Out sizes (Lightning's), then ember's Trainable, Frozen
    assert cells[0] == ["0", "encoder", "Linear", "40", "train", "128", "[2, 4]", "[2, 8]", "40", "0"]
    assert cells[1] == ["1", "head", "Linear", "9", "train", "32", "[2, 8]", "[2, 1]", "0", "9"]
    for header in ("Name", "Type", "Params", "Mode", "FLOPs", "In sizes", "Out sizes"):
        assert header in text
    for line in (
        "Trainable params: 40",
        "Non-trainable params: 9",
        "Total params: 49",
        "Total estimated model params size (MB): 0.000",
        "Modules in train mode: 2",
        "Modules in eval mode: 0",
        "Total FLOPs: 160",
    ):
        assert line in text
    assert isinstance(RichModelSummary(), ModelSummary)  # so the Trainer adds no plain summary beside it


def test_max_depth_zero_prints_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert printed(monkeypatch, RichModelSummary(max_depth=0)) == ""


def test_without_rich_it_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rich" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install rich"):
        RichModelSummary()
