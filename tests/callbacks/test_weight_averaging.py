"""WeightAveraging / EMAWeightAveraging: the average they end with, when they update, validation on the average,
the checkpoint layout (Lightning's) and a bitwise-exact resume."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint, WeightAveraging


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=g)
    return TensorDataset(x, x @ torch.randn(4, 1, generator=g) + 0.1)


class Net(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record(Callback):
    """The parameters after each optimizer step, and those validation runs with (listed after the averaging)."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []
        self.validated: list[list[torch.Tensor]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps.append([p.detach().clone() for p in module.parameters()])

    def on_validation_epoch_start(self, trainer: Any, module: Any) -> None:
        self.validated.append([p.detach().clone() for p in module.parameters()])


def fit(module: Net, callbacks: list[Any], max_epochs: int = 3, **kwargs: Any) -> ember.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = ember.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )
    trainer.fit(module, DataLoader(data(), batch_size=16), DataLoader(data(), batch_size=48), ckpt_path=ckpt_path)
    return trainer


def ema(weights: list[list[torch.Tensor]], decay: float) -> list[torch.Tensor]:
    """torch's EMA by hand: the first weights as they are, then ``decay * average + (1 - decay) * current``."""
    average = [w.clone() for w in weights[0]]
    for current in weights[1:]:
        average = [decay * a + (1 - decay) * c for a, c in zip(average, current)]
    return average


def test_the_module_ends_with_the_ema_and_validation_runs_on_it() -> None:
    torch.manual_seed(0)
    module, rec = Net(), Record()
    callback = EMAWeightAveraging(decay=0.8)
    fit(module, [callback, rec], num_sanity_val_steps=0)
    assert len(rec.steps) == 9  # 3 epochs of 3 steps
    for expected, p in zip(ema(rec.steps, 0.8), module.parameters()):
        assert torch.equal(expected, p.detach())
    # Each validation saw the average of the steps so far, and training went on from its own weights:
    # the steps after a validation would not give the EMA above otherwise.
    assert len(rec.validated) == 3
    for epoch, seen in enumerate(rec.validated):
        for expected, p in zip(ema(rec.steps[: 3 * (epoch + 1)], 0.8), seen):
            assert torch.equal(expected, p)
    assert not torch.equal(rec.validated[0][0], rec.steps[2][0])
    assert callback.state_dict() == {"latest_update_step": 9, "latest_update_epoch": -1}


def test_a_custom_should_update_averages_the_epochs_ends_equally() -> None:
    class EpochMean(WeightAveraging):  # the default avg_fn: the equal-weight mean (SWA)
        def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
            return epoch_idx is not None and epoch_idx >= 1

    torch.manual_seed(0)
    module, rec = Net(), Record()
    fit(module, [EpochMean(use_buffers=False), rec], max_epochs=4, num_sanity_val_steps=0)
    ends = [rec.steps[i] for i in (5, 8, 11)]  # the weights after epochs 1, 2 and 3
    for i, p in enumerate(module.parameters()):
        torch.testing.assert_close(p.detach(), torch.stack([e[i] for e in ends]).mean(0), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("kwargs", "steps", "epochs"),
    [  # answers of Lightning 2.6's EMAWeightAveraging.should_update for the same arguments
        (dict(), [True] * 6, [False] * 3),
        (
            dict(update_every_n_steps=2, update_starting_at_step=3),
            [False, False, False, False, True, False],
            [False] * 3,
        ),
        (dict(update_every_n_steps=0, update_starting_at_epoch=1), [False] * 6, [False, True, True]),
    ],
)
def test_ema_should_update_follows_lightnings_schedule(kwargs: dict, steps: list[bool], epochs: list[bool]) -> None:
    cb = EMAWeightAveraging(**kwargs)
    assert [cb.should_update(step_idx=i) for i in range(6)] == steps
    assert [cb.should_update(epoch_idx=i) for i in range(3)] == epochs


def test_only_optimizer_steps_are_updates() -> None:
    # With two batches a step, each epoch's 3 batches make 2 optimizer steps (the epoch's last batch steps on
    # its own): 6 batches, 4 steps, and should_update is asked once after each step only.
    torch.manual_seed(0)
    module = Net()
    seen: list[int] = []

    class Counting(EMAWeightAveraging):
        def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
            if step_idx is not None:
                seen.append(step_idx)
            return super().should_update(step_idx, epoch_idx)

    fit(module, [Counting(decay=0.5)], max_epochs=2, accumulate_grad_batches=2, limit_val_batches=0)
    assert seen == [0, 1, 2, 3]


# ---------------------------------------------------------------------- checkpoints
def test_the_checkpoint_holds_the_average_as_its_state_dict_and_a_resume_is_bitwise(tmp_path: Any) -> None:
    torch.manual_seed(0)
    reference = Net()
    initial = copy.deepcopy(reference.state_dict())
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    rec = Record()
    fit(reference, [EMAWeightAveraging(decay=0.7), rec, every], enable_checkpointing=True, max_epochs=4)

    saved = torch.load(tmp_path / "step=4.ckpt", weights_only=True)  # mid-epoch 1: 4 steps taken
    assert int(saved["averaging_state"]["n_averaged"]) == 4
    assert set(saved["state_dict"]) == set(saved["current_model_state"]) == set(reference.state_dict())
    names = [n for n, _ in reference.named_parameters()]
    for i, name in enumerate(names):  # as Lightning: the average is the state_dict, the trained weights beside it
        assert torch.equal(saved["state_dict"][name], ema(rec.steps[:4], 0.7)[i])
        assert torch.equal(saved["current_model_state"][name], rec.steps[3][i])

    for step in (4, 6, 10):  # mid-epoch, an epoch's end, mid-epoch again
        module = Net()
        module.load_state_dict(initial)
        fit(module, [EMAWeightAveraging(decay=0.7)], max_epochs=4, ckpt_path=str(tmp_path / f"step={step}.ckpt"))
        for (name, a), b in zip(reference.state_dict().items(), module.state_dict().values()):
            assert torch.equal(a, b), (step, name)


def test_a_checkpoint_loaded_outside_a_fit_gives_the_average(tmp_path: Any) -> None:
    torch.manual_seed(0)
    module = Net()
    trainer = fit(module, [EMAWeightAveraging(decay=0.5)], max_epochs=1, limit_val_batches=0)
    path = str(tmp_path / "end.ckpt")
    trainer.save_checkpoint(path)
    loaded = Net.load_from_checkpoint(path)
    for a, b in zip(loaded.state_dict().values(), module.state_dict().values()):
        assert torch.equal(a, b)  # the fit ended holding the average, and the checkpoint holds it too

    class Predicts(Net):
        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0])

    predictor = ember.Trainer(accelerator="cpu", logger=False, callbacks=[EMAWeightAveraging()])
    with pytest.warns(UserWarning, match="outside a fit"):
        predictor.predict(Predicts(), DataLoader(data(), batch_size=48), ckpt_path=path)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="AveragedModel does not take"):
        WeightAveraging(decay=0.9)
    with pytest.raises(ValueError, match="update_every_n_steps must be an int >= 0"):
        EMAWeightAveraging(update_every_n_steps=-1)
    with pytest.raises(ValueError, match="decay"):
        EMAWeightAveraging(decay=1.5)


def test_a_second_fit_averages_from_its_own_first_step() -> None:
    torch.manual_seed(0)
    callback, module = EMAWeightAveraging(decay=0.5), Net()
    fit(module, [callback], max_epochs=1, limit_val_batches=0)
    rec = Record()
    fit(module, [callback, rec], max_epochs=1, limit_val_batches=0)  # a new Trainer: global_step from 0 again
    for expected, p in zip(ema(rec.steps, 0.5), module.parameters()):
        assert torch.equal(expected, p.detach())
