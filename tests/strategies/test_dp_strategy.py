"""strategy="dp": exact parity with "single", combined logging, errors, no thread left behind."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ember
from ember.strategies.dp import DataParallelStrategy
from tests.helpers.models import fast_trainer, regression_data
from tests.helpers.weights import assert_same_weights


class MLP(ember.TrainModule):
    """Per-sample-mean loss, momentum SGD, and logging of every reduction kind."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        err = (self(x) - y).pow(2)
        loss = err.mean()
        self.log("train_loss", loss, on_epoch=True)
        self.log("sq_sum", err.sum(), reduce_fx="sum", on_step=False, on_epoch=True)
        self.log("sq_max", err.max(), reduce_fx="max", on_step=False, on_epoch=True)
        return {"loss": loss, "n": torch.tensor(float(len(x)))}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader(n: int = 37, batch_size: int = 8) -> DataLoader:
    # 37 = 4 x 8 + 5: the last batch splits unevenly over 2 and over 3 replicas (so do the 8s
    # over 3), and with accumulate_grad_batches=2 the last window is short.
    return DataLoader(regression_data(n), batch_size=batch_size)


def fit(strategy: Any, devices: int, **kwargs: Any) -> tuple[MLP, ember.Trainer]:
    module = MLP()
    trainer = fast_trainer(
        strategy=strategy, devices=devices, accelerator="cpu", max_epochs=2, num_sanity_val_steps=0, **kwargs
    )
    trainer.fit(module, loader(), loader(13, 4))
    return module, trainer


@pytest.mark.parametrize("devices", [2, 3])
def test_dp_parity_with_single_accumulation_and_clipping(devices):
    options = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
    single, t_single = fit("single", 1, **options)
    dp, t_dp = fit("dp", devices, **options)
    assert t_dp.global_step == t_single.global_step == 6
    assert_same_weights(dp, single)
    for key in ("train_loss_epoch", "sq_sum", "sq_max", "val_loss"):
        torch.testing.assert_close(
            torch.as_tensor(t_dp.callback_metrics[key]),
            torch.as_tensor(t_single.callback_metrics[key]),
            rtol=1e-5,
            atol=1e-6,
            msg=key,
        )


def test_dp_one_graph_backward_gives_the_same_weights():
    single, _ = fit("single", 1, gradient_clip_val=0.5)
    dp, _ = fit(DataParallelStrategy(parallel_backward=False), 2, gradient_clip_val=0.5)
    assert_same_weights(dp, single)


def test_dp_drives_lbfgs_like_one_device():
    import copy

    from tests.helpers.models import regression_loader
    from tests.trainer.test_math import LBFGSLinear

    ember.seed_everything(3)
    single = LBFGSLinear()
    dp = copy.deepcopy(single)
    fast_trainer(max_epochs=2).fit(single, regression_loader(n=32, batch_size=16))
    trainer = fast_trainer(max_epochs=2, strategy="dp", devices=2)
    trainer.fit(dp, regression_loader(n=32, batch_size=16))
    assert single.calls > trainer.global_step == 4  # the closure ran several times per step
    assert_same_weights(dp, single)


def test_dp_predictions_are_concatenated_in_order():
    module = MLP()
    data = DataLoader(regression_data(11), batch_size=5)
    expected = fast_trainer(devices=1, accelerator="cpu").predict(module, data)
    got = fast_trainer(strategy="dp", devices=3, accelerator="cpu").predict(module, data)
    assert len(got) == len(expected) == 3
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_dp_step_outputs_combined():
    seen = []

    class Probe(ember.callbacks.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(outputs)

    fit("dp", 3, callbacks=[Probe()])
    first = seen[0]
    x, y = next(iter(loader()))
    torch.testing.assert_close(first["loss"], F.mse_loss(MLP()(x), y).detach())  # whole batch
    # "n" (a 0-dim tensor) is combined like the loss: the chunk-weighted mean of 3, 3 and 2
    torch.testing.assert_close(first["n"], torch.tensor((3 * 3 + 3 * 3 + 2 * 2) / 8))


class FailsOnSmallChunks(MLP):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if len(batch[0]) < 3:
            raise ArithmeticError("chunk too small")
        return super().training_step(batch, batch_idx)


def test_exception_names_the_replica_and_leaves_no_thread():
    trainer = fast_trainer(strategy="dp", devices=3, accelerator="cpu")
    with pytest.raises(ArithmeticError, match=r"(?s)in replica 2 on device cpu.*chunk too small"):
        trainer.fit(FailsOnSmallChunks(), loader())
    assert not [t for t in threading.enumerate() if t.name.startswith("ember-replica")]


def test_no_thread_left_after_fit():
    before = threading.active_count()
    fit("dp", 2)
    assert threading.active_count() == before


def test_manual_optimization_is_refused():
    class Manual(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="automatic optimization only"):
        fast_trainer(strategy="dp", devices=2, accelerator="cpu").fit(Manual(), loader())


def test_skipping_on_some_replicas_only_is_an_error():
    class SkipsSome(MLP):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return None if len(batch[0]) < 3 else super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match=r"returned None on replicas \[2\]"):
        fast_trainer(strategy="dp", devices=3, accelerator="cpu").fit(SkipsSome(), loader())


def test_one_device_is_the_plain_module():
    single, _ = fit("single", 1)
    dp, _ = fit("dp", 1)
    assert_same_weights(dp, single)


def test_parallel_backward_on_cuda_is_refused_before_the_module_moves():
    strategy = DataParallelStrategy(accelerator="cuda", devices=[torch.device("cuda", 0)] * 2, parallel_backward=True)
    module = MLP()
    with pytest.raises(ValueError, match=r"parallel_backward=True .* on cuda:0 it would deadlock"):
        strategy.setup(None, module)
    assert module.device.type == "cpu"
