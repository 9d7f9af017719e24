"""StochasticWeightAveraging: Lightning's schedule and learning rates, the mean it ends with, BatchNorm
statistics recomputed for it, exact resume, its errors, and the same result under dp and ddp."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import update_bn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint, StochasticWeightAveraging
from tests.helpers.dist import join_as_rank, run_ranks


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return TensorDataset(x, x @ torch.randn(4, 1, generator=g) + 0.1)


class Net(ember.TrainModule):
    def __init__(self, bn: bool = False, scheduler: bool = False, optimizers: int = 1) -> None:
        super().__init__()
        norm = [torch.nn.BatchNorm1d(8)] if bn else []
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), *norm, torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.scheduler, self.n_optimizers = scheduler, optimizers

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opts = [torch.optim.SGD(self.parameters(), lr=0.1) for _ in range(self.n_optimizers)]
        if self.scheduler:
            return opts, [torch.optim.lr_scheduler.StepLR(opts[0], 1, 0.5)]
        return opts


class Record(Callback):
    """The learning rate and the weights at each epoch's start (after SWA's own epoch-start work)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        self.weights.append({k: p.detach().clone() for k, p in module.named_parameters()})


def fit(module: Net, max_epochs: int = 6, callbacks: list[Any] | None = None, **kwargs: Any) -> ember.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = ember.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        callbacks=callbacks or [],
        **kwargs,
    )
    trainer.fit(module, DataLoader(data(), batch_size=16), ckpt_path=ckpt_path)
    return trainer


def swa(**kwargs: Any) -> StochasticWeightAveraging:
    kwargs.setdefault("swa_lrs", 0.05)
    kwargs.setdefault("swa_epoch_start", 0.5)
    kwargs.setdefault("annealing_epochs", 2)
    return StochasticWeightAveraging(**kwargs)


# ---------------------------------------------------------------------- the schedule and the mean
@pytest.mark.parametrize(
    ("strategy", "scheduler", "lrs"),
    [
        # Recorded with Lightning 2.6.6's StochasticWeightAveraging on the same run (max_epochs=6, swa_epoch_start=0.5,
        # annealing_epochs=2, SGD lr 0.1): SWA's first epoch is epoch 2 (0-based), SWALR steps at each epoch's end.
        ("cos", False, [0.1, 0.1, 0.1, 0.075, 0.05, 0.05]),
        ("linear", False, [0.1, 0.1, 0.1, 0.075, 0.05, 0.05]),
        ("cos", True, [0.1, 0.05, 0.025, 0.0375, 0.05, 0.05]),  # StepLR until SWA swaps it out
    ],
)
def test_learning_rates_follow_lightnings_schedule(strategy: str, scheduler: bool, lrs: list[float]) -> None:
    torch.manual_seed(0)
    rec = Record()
    trainer = fit(Net(scheduler=scheduler), callbacks=[swa(annealing_strategy=strategy), rec])
    assert rec.lrs == pytest.approx(lrs)
    assert len(trainer.lr_scheduler_configs) == 1
    assert type(trainer.lr_scheduler_configs[0].scheduler).__name__ == "SWALR"


def test_the_module_ends_with_the_mean_of_the_swa_epochs_starting_weights() -> None:
    """As Lightning: the weights at the start of each SWA epoch (2..5) are averaged; the last epoch's own
    training is not part of the mean."""
    torch.manual_seed(0)
    rec, callback = Record(), swa()
    module = Net()
    trainer = fit(module, callbacks=[callback, rec])
    assert callback.swa_start == 2 and callback.swa_end == 5
    assert int(callback.n_averaged) == 4
    for name, p in module.named_parameters():
        expected = torch.stack([w[name] for w in rec.weights[2:6]]).mean(0)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)
        assert not torch.equal(p.detach(), rec.weights[5][name])  # not simply the last epoch's start
    assert trainer.global_step == 24  # no extra epoch or step for the averaging


def test_an_int_start_counts_epochs_from_one_and_avg_fn_is_used() -> None:
    """swa_epoch_start=5 starts SWA with the fifth epoch (index 4); a custom avg_fn replaces the mean."""
    torch.manual_seed(0)
    rec = Record()
    calls = []

    def ema(avg: torch.Tensor, new: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        calls.append(int(n))
        return 0.5 * avg + 0.5 * new

    module = Net()
    fit(module, callbacks=[swa(swa_epoch_start=5, avg_fn=ema), rec])
    assert sorted(set(calls)) == [1]  # the second update (the first only copies)
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.detach(), 0.5 * rec.weights[4][name] + 0.5 * rec.weights[5][name])


def test_batch_norm_statistics_are_recomputed_for_the_averaged_weights() -> None:
    """The running statistics equal torch's update_bn over the train loader with the averaged weights."""
    torch.manual_seed(0)
    rec = Record()
    module = Net(bn=True)
    trainer = fit(module, callbacks=[swa(), rec])
    reference = copy.deepcopy(module.net)
    update_bn(DataLoader(data(), batch_size=16), reference)
    bn = module.net[1]
    torch.testing.assert_close(bn.running_mean, reference[1].running_mean)
    torch.testing.assert_close(bn.running_var, reference[1].running_var)
    assert bn.momentum == 0.1  # put back after the pass
    assert trainer.global_step == 24


def test_a_fit_stopped_before_its_last_epoch_keeps_its_own_weights() -> None:
    """As Lightning: with max_steps ending the fit in SWA's third epoch, the mean is not transferred."""
    torch.manual_seed(0)
    module = Net()
    callback = swa()
    fit(module, callbacks=[callback], max_steps=18)
    assert int(callback.n_averaged) == 3
    mean = callback.state_dict()["average_model_state"]
    assert any(not torch.equal(p.detach(), mean[n]) for n, p in module.named_parameters())


# ---------------------------------------------------------------------- checkpoints
def test_state_is_saved_and_a_resume_continues_exactly(tmp_path: Any) -> None:
    """Resuming from an epoch-end checkpoint and from a mid-epoch one, both inside the SWA phase, ends with
    the same weights, BatchNorm statistics and learning rates as the run that was not interrupted."""
    torch.manual_seed(0)
    reference = Net(bn=True, scheduler=True)
    initial = copy.deepcopy(reference.state_dict())
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    rec = Record()
    fit(reference, callbacks=[swa(), every, rec], enable_checkpointing=True)
    saved = torch.load(tmp_path / "step=14.ckpt", weights_only=True)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("StochasticWeightAveraging"))
    assert state["n_averaged"] == 2 and state["latest_update_epoch"] == 3
    assert set(state["average_model_state"]) == {n for n, _ in reference.named_parameters()}
    assert saved["lr_schedulers"] == [state["scheduler_state"]]  # SWALR took the StepLR's place

    for step in (8, 14, 18):  # epoch 2's end (SWA not started yet), mid-epoch 3, epoch 4's end
        module = Net(bn=True, scheduler=True)
        module.load_state_dict(initial)
        resumed_rec = Record()
        fit(module, callbacks=[swa(), resumed_rec], ckpt_path=str(tmp_path / f"step={step}.ckpt"))
        for (name, a), b in zip(reference.state_dict().items(), module.state_dict().values()):
            assert torch.equal(a, b), (step, name)
        assert resumed_rec.lrs == rec.lrs[-len(resumed_rec.lrs) :]


# ---------------------------------------------------------------------- mistakes
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(swa_epoch_start=0), ValueError, "counts epochs from 1"),
        (dict(swa_epoch_start=1.5), ValueError, r"fraction of max_epochs and must be in \[0, 1\]"),
        (dict(swa_epoch_start="2"), TypeError, "swa_epoch_start must be"),
        (dict(swa_lrs=-0.1), ValueError, "swa_lrs must be a positive number"),
        (dict(swa_lrs=[0.1, 0.0]), ValueError, "swa_lrs must be a positive number"),
        (dict(swa_lrs=[]), ValueError, "swa_lrs must be a positive number"),
        (dict(annealing_epochs=-1), ValueError, "annealing_epochs must be"),
        (dict(annealing_strategy="cosine"), ValueError, "'cos' or 'linear'"),
        (dict(avg_fn="mean"), TypeError, "avg_fn must be a function"),
        (dict(device=0), TypeError, "device must be"),
    ],
)
def test_bad_arguments_say_what_is_expected(kwargs: dict[str, Any], error: type, match: str) -> None:
    kwargs.setdefault("swa_lrs", 0.05)
    with pytest.raises(error, match=match):
        StochasticWeightAveraging(**kwargs)


@pytest.mark.parametrize(
    ("module", "callback", "fit_kwargs", "match"),
    [
        (Net(optimizers=2), swa(), {}, "works with one optimizer; configure_optimizers returned 2"),
        (Net(), swa(), dict(max_epochs=-1, max_steps=8), "swa_epoch_start=0.5. is a fraction of max_epochs"),
        (Net(), swa(swa_epoch_start=8), {}, "would start at epoch 8 .* max_epochs=6"),
        (Net(), swa(swa_lrs=[0.1, 0.1]), {}, "got 2 swa_lrs but the optimizer has 1 parameter groups"),
    ],
)
def test_a_fit_swa_cannot_serve_is_refused(module: Net, callback: Any, fit_kwargs: dict[str, Any], match: str) -> None:
    kwargs = {"max_epochs": 6, **fit_kwargs}
    if module.n_optimizers == 2:
        module.automatic_optimization = False
    with pytest.raises(ValueError, match=match):
        fit(module, callbacks=[callback], **kwargs)


def test_exported_beside_the_other_callbacks() -> None:
    assert "StochasticWeightAveraging" in ember.callbacks.__all__
    assert ember.callbacks.StochasticWeightAveraging is StochasticWeightAveraging


# ---------------------------------------------------------------------- dp and ddp
def test_dp_ends_with_the_same_mean_as_one_device() -> None:
    """Under dp the replicas' losses combine to one device's, so the mean (and the learning rates) match it."""
    results = []
    for kwargs in (dict(), dict(strategy="dp", devices=2)):
        torch.manual_seed(0)
        module, rec = Net(), Record()
        fit(module, callbacks=[swa(), rec], **kwargs)
        results.append((module.state_dict(), rec.lrs))
    assert results[0][1] == results[1][1]
    for name, a in results[0][0].items():
        torch.testing.assert_close(a, results[1][0][name], rtol=1e-5, atol=1e-6)


def _ddp_fit(rank: int, world: int) -> dict[str, Any]:
    join_as_rank(rank, world)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    module, rec = Net(bn=True), Record()
    callback = swa()
    fit(module, callbacks=[callback, rec], strategy="ddp", devices=world)
    # What the BatchNorm pass saw on this rank alone, for the check that the ranks' statistics were averaged.
    own = copy.deepcopy(module.net)
    shard = DataLoader(torch.utils.data.Subset(data(), range(rank, 64, world)), batch_size=16)
    update_bn(shard, own)
    return {
        "state": {k: v.clone() for k, v in module.state_dict().items()},
        "expected": {
            name: torch.stack([w[name] for w in rec.weights[2:6]]).mean(0) for name, _ in module.named_parameters()
        },
        "own_mean": own[1].running_mean.clone(),
        "n_averaged": int(callback.n_averaged),
    }


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_ddp_ranks_end_with_the_same_mean_and_batch_norm_statistics() -> None:
    ranks = run_ranks(_ddp_fit, 2, timeout=100)
    for r in ranks:
        assert r["n_averaged"] == 4
        for name, expected in r["expected"].items():
            torch.testing.assert_close(r["state"][name], expected, rtol=1e-6, atol=1e-7)
    for name, a in ranks[0]["state"].items():
        assert torch.equal(a, ranks[1]["state"][name]), name
    # The statistics are the mean of the ranks' own (each rank saw its half of the data).
    torch.testing.assert_close(
        ranks[0]["state"]["net.1.running_mean"], (ranks[0]["own_mean"] + ranks[1]["own_mean"]) / 2
    )
    assert not torch.allclose(ranks[0]["own_mean"], ranks[1]["own_mean"])


def test_lightnings_static_helpers_average_modules_and_save_and_restore_batch_norm_state():
    from ember.callbacks import StochasticWeightAveraging

    average, n = torch.nn.Linear(3, 2), torch.tensor(0)
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(torch.nn.Linear(3, 2))
        StochasticWeightAveraging.update_parameters(average, models[-1], n, StochasticWeightAveraging.avg_fn)
    assert int(n) == 3
    expected = torch.stack([m.weight.detach() for m in models]).mean(0)
    torch.testing.assert_close(average.weight.detach(), expected)

    swa = StochasticWeightAveraging(swa_lrs=0.1)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, momentum=0.3))
    net.train()
    net(torch.randn(8, 3))
    bn = net[1]
    swa.reset_batch_norm_and_save_state(net)
    assert bn.momentum is None and swa.momenta == {bn: 0.3}
    assert torch.equal(bn.running_mean, torch.zeros(4)) and torch.equal(bn.running_var, torch.ones(4))
    assert int(bn.num_batches_tracked) == 0
    swa.reset_momenta()
    assert bn.momentum == 0.3


def test_reset_batch_norm_and_save_state_takes_the_module_as_lightnings_pl_module():
    swa = StochasticWeightAveraging(swa_lrs=0.1)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, momentum=0.2))
    net.train()
    net(torch.randn(8, 3))
    assert not torch.equal(net[1].running_mean, torch.zeros(4))
    swa.reset_batch_norm_and_save_state(pl_module=net)  # by keyword, as Lightning's signature names it
    assert net[1].momentum is None and swa.momenta == {net[1]: 0.2}
    assert torch.equal(net[1].running_mean, torch.zeros(4))
