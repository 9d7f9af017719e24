"""BaseFinetuning / BackboneFinetuning: what trains when, the backbone's learning rate, and exact resume
(the optimizer a checkpoint saved has more parameter groups than configure_optimizers builds)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import BackboneFinetuning, BaseFinetuning, Callback, ModelCheckpoint
from tests.helpers.dist import join_as_rank, run_ranks


class Net(ember.TrainModule):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        self.head = torch.nn.Linear(4, 1)
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.head(self.backbone(x)), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        params = filter(lambda p: p.requires_grad, self.parameters())
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=0.01)
        return torch.optim.SGD(params, lr=0.1)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))


class EpochStarts(Callback):
    """What the optimizer and the module look like when each epoch starts (after the finetuning callback)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[tuple[int, float]], list[str], bool]] = []

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        groups = [(len(g["params"]), round(g["lr"], 6)) for g in trainer.optimizers[0].param_groups]
        trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        self.seen.append((trainer.current_epoch, groups, trainable, module.backbone[1].track_running_stats))


def test_backbone_finetuning_matches_lightning_schedule():
    """The values a Lightning 2.6.6 run of the same script prints: the backbone (but its BatchNorm) frozen in
    epoch 0, a group of its 2 Linear parameters at backbone_initial_lr from epoch 1, doubled every epoch."""
    rec = EpochStarts()
    trainer = ember.Trainer(
        max_epochs=5,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        callbacks=[BackboneFinetuning(1, backbone_initial_lr=0.001, train_bn=False), rec],
    )
    module = Net()
    before = module.backbone[0].weight.detach().clone()
    trainer.fit(module, DataLoader(data(), batch_size=4))
    bn_head = ["backbone.1.weight", "backbone.1.bias", "head.weight", "head.bias"]
    everything = ["backbone.0.weight", "backbone.0.bias", *bn_head]
    assert rec.seen == [
        (0, [(4, 0.1)], bn_head, True),
        (1, [(4, 0.1), (2, 0.001)], everything, True),
        (2, [(4, 0.1), (2, 0.002)], everything, True),
        (3, [(4, 0.1), (2, 0.004)], everything, True),
        (4, [(4, 0.1), (2, 0.008)], everything, True),
    ]
    assert not torch.equal(before, module.backbone[0].weight)  # trained once unfrozen


def test_backbone_lr_is_capped_at_the_head_lr_with_should_align():
    rec = EpochStarts()
    trainer = ember.Trainer(
        max_epochs=4,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        callbacks=[BackboneFinetuning(0, lambda_func=lambda e: 10.0), rec],
    )
    trainer.fit(Net(), DataLoader(data(), batch_size=4))
    assert [groups[-1][1] for _, groups, _, _ in rec.seen] == [0.01, 0.1, 0.1, 0.1]  # 0.1 * 0.1, then x10, capped


def test_backbone_finetuning_needs_a_backbone():
    class NoBackbone(Net):
        def __init__(self) -> None:
            super().__init__()
            del self.backbone

    trainer = ember.Trainer(
        max_epochs=1,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        callbacks=[BackboneFinetuning(1)],
    )
    with pytest.raises(ValueError, match="backbone"):
        trainer.fit(NoBackbone(), DataLoader(data(), batch_size=4))


def test_static_helpers_freeze_filter_and_add_groups():
    net = Net()
    BaseFinetuning.freeze(net.backbone, train_bn=False)
    assert not any(p.requires_grad for p in net.backbone.parameters())
    assert not net.backbone[1].track_running_stats
    assert len(BaseFinetuning.flatten_modules(net)) == 3  # Linear, BatchNorm1d, Linear
    opt = torch.optim.SGD(net.head.parameters(), lr=0.5)
    BaseFinetuning.unfreeze_and_add_param_group(net.backbone, opt)  # lr: the first group's / 10
    assert [(len(g["params"]), g["lr"]) for g in opt.param_groups] == [(2, 0.5), (4, 0.05)]
    assert net.backbone[1].track_running_stats
    # A parameter already in the optimizer is recognised by identity, not by value: two zero biases differ.
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([a], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert BaseFinetuning.filter_on_optimizer(opt, [b]) == [b]
    with pytest.warns(UserWarning, match="already in a parameter group"):
        assert BaseFinetuning.filter_on_optimizer(opt, [a, b]) == [b]


def _fit(root: str, max_epochs: int, ckpt_path: str | None = None, **kwargs: Any) -> tuple[Net, ember.Trainer]:
    ember.seed_everything(0)
    module = Net("adam")
    # The default configuration: a logger and checkpointing on.
    trainer = ember.Trainer(
        max_epochs=max_epochs,
        enable_progress_bar=False,
        default_root_dir=root,
        callbacks=[
            BackboneFinetuning(1, backbone_initial_lr=0.001),
            ModelCheckpoint(dirpath=os.path.join(root, "c"), every_n_train_steps=2),
        ],
        **kwargs,
    )
    trainer.fit(module, DataLoader(data(), batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    return module, trainer


@pytest.mark.parametrize("stop", [dict(max_epochs=2), dict(max_epochs=4, max_steps=10)], ids=["epoch-end", "mid-epoch"])
def test_resume_restores_the_added_group_and_trains_exactly_as_without_interruption(tmp_path, stop):
    """Adam's state for the backbone's group is in the checkpoint; the resumed run must rebuild that group
    (and keep the backbone trainable) before the optimizer state is loaded, and then train bit for bit as
    the uninterrupted run."""
    ref, _ = _fit(str(tmp_path / "ref"), 4)
    root = str(tmp_path / "run")
    max_epochs = stop.pop("max_epochs")
    _fit(root, max_epochs, **stop)
    resumed, trainer = _fit(root, 4, ckpt_path=os.path.join(root, "c", "last.ckpt"))
    assert trainer.global_step == 16
    assert len(trainer.optimizers[0].param_groups) == 2
    for (name, a), b in zip(ref.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def _ddp_fit(rank: int, world: int) -> list[Any]:
    join_as_rank(rank, world)
    warnings.simplefilter("ignore")
    rec = EpochStarts()
    torch.manual_seed(rank)  # different initial weights: the wrapper must broadcast rank 0's
    module = Net()
    trainer = ember.Trainer(
        strategy="ddp",
        devices=world,
        accelerator="cpu",
        max_epochs=3,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        callbacks=[BackboneFinetuning(1), rec],
    )
    trainer.fit(module, DataLoader(data(), batch_size=2))
    return [rec.seen, {k: v.clone() for k, v in module.state_dict().items()}]


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_backbone_finetuning_under_ddp_keeps_the_ranks_identical():
    """Two gloo ranks: both add the backbone's group at epoch 1, and the gradients of the parameters unfrozen
    then are all-reduced too (the reducer takes them in), so the weights stay identical on both ranks."""
    ranks = run_ranks(_ddp_fit, 2, timeout=80)
    assert ranks[0][0] == ranks[1][0]
    assert [len(groups) for _, groups, _, _ in ranks[0][0]] == [1, 2, 2]
    weights = [{k: v for k, v in r[1].items() if "running" not in k and "num_batches" not in k} for r in ranks]
    for name in weights[0]:  # (BatchNorm statistics are each rank's own)
        assert torch.equal(weights[0][name], weights[1][name]), name


def test_backbone_finetuning_under_dp_trains_as_one_device():
    """strategy="dp" replicates the module every step, so the backbone unfrozen at epoch 1 trains on every
    replica and the weights equal a single device's."""
    results = []
    for kwargs in (dict(), dict(strategy="dp", devices=2, accelerator="cpu")):
        torch.manual_seed(0)
        module = Net()
        module.backbone[1] = torch.nn.Identity()  # BatchNorm statistics are per replica under dp
        ember.Trainer(
            max_epochs=3,
            enable_progress_bar=False,
            logger=False,
            enable_checkpointing=False,
            callbacks=[BackboneFinetuning(1)],
            **kwargs,
        ).fit(module, DataLoader(data(), batch_size=4))
        results.append({k: v.clone() for k, v in module.state_dict().items()})
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, msg=name)
