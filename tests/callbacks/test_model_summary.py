"""ModelSummary: the table printed at fit start."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ModelSummary
from ember.callbacks.model_summary import summarize


class Net(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))
        self.norm = torch.nn.BatchNorm1d(5)
        self.head = torch.nn.Linear(5, 1)
        for p in self.encoder[0].parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(self.norm(self.encoder(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


def test_table_counts_and_size():
    text = summarize(Net())
    lines = text.splitlines()
    # Lightning's columns in its order (FLOPs are 0 without an example input), then ember's two.
    assert lines[0] == "  | Name    | Type        | Params | Mode  | FLOPs | Trainable | Frozen"
    assert set(lines[1]) == {"-"} and lines[5] == lines[1]
    rows = {cells[1]: cells[2:] for cells in ([c.strip() for c in ln.split("|")] for ln in lines[2:5])}
    # encoder: 10*20+20 frozen, 20*5+5 trainable; norm: 5+5; head: 5+1
    assert rows["encoder"] == ["Sequential", "325", "train", "0", "105", "220"]
    assert rows["norm"] == ["BatchNorm1d", "10", "train", "0", "10", "0"]
    assert rows["head"] == ["Linear", "6", "train", "0", "6", "0"]
    assert "121        Trainable params" in text
    assert "220        Non-trainable params" in text
    assert "341        Total params" in text
    # 341 float32 parameters + BatchNorm's running mean/var (float32) and num_batches_tracked (int64)
    assert f"{(341 * 4 + 10 * 4 + 8) / 1e6:<10.3f} Total estimated model size" in text


def test_depth_and_large_counts():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(1000, 1500)), torch.nn.Linear(2, 2))
    shallow = summarize(model, max_depth=1)
    deep = summarize(model, max_depth=2)
    assert "0.0 " not in shallow and "1.5 M" in shallow
    assert "0.0" in deep and "0.0.weight" not in deep and len(deep.splitlines()) == len(shallow.splitlines()) + 1
    assert summarize(model, max_depth=0).splitlines()[0].endswith("Trainable params")
    shared = torch.nn.Linear(3, 3)
    assert "12         Total params" in summarize(torch.nn.Sequential(shared, shared))


def test_printed_at_fit_start_on_rank_zero(capsys):
    ds = TensorDataset(torch.randn(8, 10), torch.randn(8, 1))
    trainer = ember.Trainer(
        max_epochs=1, logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=True
    )
    assert any(isinstance(c, ModelSummary) for c in trainer.callbacks)
    trainer.fit(Net(), DataLoader(ds, batch_size=4))
    out = capsys.readouterr().out
    assert out.startswith("  | Name") and "341        Total params" in out
    with pytest.raises(ValueError, match="max_depth"):
        ModelSummary(max_depth=-2)
