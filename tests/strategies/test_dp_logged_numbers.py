"""strategy="dp": Python numbers the replicas log are combined on the host, tensors on the device.

Two CPU replicas; the batch is built so that replica 0's chunk starts with 1.0 and replica 1's with
5.0, and each replica logs values derived from that first element. (That no number is copied to a
GPU is checked on CUDA in tests/cuda/test_cuda_sync_ddp.py.)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from tests.helpers.models import fast_trainer


class LogsNumbers(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        first = x[0, 0]
        number = float(first)  # 1.0 on replica 0, 5.0 on replica 1
        self.log("max_number", number, reduce_fx="max")
        self.log("min_number", number, reduce_fx="min")
        self.log("sum_number", number, reduce_fx="sum")
        self.log("mean_number", number)  # weighted by chunk size (2 and 2)
        # Mixed: replica 1 logs a tensor, replica 0 a number.
        mixed: Any = first * 1.0 if number > 2 else number
        self.log("max_mixed", mixed, reduce_fx="max")
        self.log("min_mixed", mixed, reduce_fx="min")
        self.log("sum_mixed", mixed, reduce_fx="sum")
        # A NaN from either replica makes max and min NaN, as torch.max and torch.min do.
        self.log("max_nan_second", math.nan if number > 2 else number, reduce_fx="max")
        self.log("min_nan_first", math.nan if number < 2 else number, reduce_fx="min")
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_numbers_logged_by_replicas_combine_on_the_host():
    x = torch.tensor([[1.0, 0.0], [0.0, 0.0], [5.0, 0.0], [0.0, 0.0]])  # replica 0: rows 0-1, replica 1: 2-3
    trainer = fast_trainer(strategy="dp", devices=2, accelerator="cpu", max_steps=1, num_sanity_val_steps=0)
    trainer.fit(LogsNumbers(), DataLoader(TensorDataset(x), batch_size=4))
    got = {k: v for k, v in trainer.callback_metrics.items()}
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in got.values()), got
    values = {k: v.item() for k, v in got.items()}
    assert {k: values[k] for k in ("max_number", "min_number", "sum_number", "mean_number")} == {
        "max_number": 5.0,
        "min_number": 1.0,
        "sum_number": 6.0,
        "mean_number": 3.0,
    }
    assert {k: values[k] for k in ("max_mixed", "min_mixed", "sum_mixed")} == {
        "max_mixed": 5.0,
        "min_mixed": 1.0,
        "sum_mixed": 6.0,
    }
    assert math.isnan(values["max_nan_second"]) and math.isnan(values["min_nan_first"]), values


def test_the_replicas_log_redirects_go_with_the_replicas():
    # Each step's replicas send their self.log calls to a sink of their own (ember.module.redirect_log);
    # once the fit is over and the replicas are gone, no entry is left, and the module itself logs into
    # its trainer again.
    import gc

    from ember import module as module_file

    x = torch.tensor([[1.0, 0.0], [0.0, 0.0], [5.0, 0.0], [0.0, 0.0]])
    trainer = fast_trainer(strategy="dp", devices=2, accelerator="cpu", max_steps=3, num_sanity_val_steps=0)
    model = LogsNumbers()
    trainer.fit(model, DataLoader(TensorDataset(x), batch_size=4))
    gc.collect()
    assert module_file._LOG_REDIRECTS == {}
    assert module_file._redirected_sink(model) is None


def test_a_redirect_is_for_its_own_module_only():
    from ember import module as module_file

    class Sink:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def log(self, name: str, value: Any, **options: Any) -> None:
            self.calls.append(name)

    first, other = LogsNumbers(), LogsNumbers()
    sink = Sink()
    module_file.redirect_log(first, sink)
    first.log("a", 1.0)
    assert sink.calls == ["a"]
    assert module_file._redirected_sink(other) is None
    del first
    import gc

    gc.collect()
    assert module_file._LOG_REDIRECTS == {}
