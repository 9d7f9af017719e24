"""The ``fsdp`` strategy (PyTorch's FSDP2 under ember's Trainer) on 2 real gloo ranks.

One spawn of 2 ranks runs every check (each rank joins the harness's group as under torchrun) and returns
numbers; the tests assert on them. The main process then does what needs no group: it reads the sharded
checkpoints the ranks wrote whole (``load_from_checkpoint``), resumes them on one process (2 ranks -> 1), and
writes the 1-process checkpoint the ranks resume from (1 -> 2) before the spawn.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.checkpoint import sharded
from tests.helpers.dist import join_as_rank, run_ranks

pytestmark = [
    pytest.mark.processes,
    pytest.mark.timeout(150),
    pytest.mark.filterwarnings("ignore:Net defines validation_step, but this fit has no validation data"),
]
B, N, TOL = 4, 48, 1e-5


class Net(ember.TrainModule):
    """Three layers and a parameter of the module itself (sharded with the root unit)."""

    def __init__(self, lazy: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lazy = lazy
        self.seen_meta = False
        if not lazy:
            self._build()
        self.scale = torch.nn.Parameter(torch.ones(3))

    def _build(self) -> None:
        self.a, self.b, self.c = torch.nn.Linear(6, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)

    def configure_model(self) -> None:
        if self.lazy and not hasattr(self, "a"):
            with self.trainer.init_module(empty_init=True):
                self._build()
            self.seen_meta = all(p.is_meta for p in self.a.parameters())

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.scale

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class ManualNet(Net):
    """Manual optimization with clipping and a per-step LR schedule."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.3)
        opt.step()
        self.lr_schedulers().step()
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]


def data(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g))


def loader(batch: int, shuffle: bool = False) -> DataLoader:
    return DataLoader(data(), batch_size=batch, shuffle=shuffle, generator=torch.Generator().manual_seed(2))


def whole(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's weights, gathered whole (a collective under fsdp: every rank calls it)."""
    out = {}
    for k, v in module.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().clone().cpu()
    return out


def diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def trainer(strategy: str = "fsdp", devices: int = 2, **kwargs) -> ember.Trainer:
    args = dict(
        strategy=strategy,
        devices=devices,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=2,
    )
    args.update(kwargs)
    return ember.Trainer(**args)


# ------------------------------------------------------------------------------------------ the checks
class ShardedGrads(ember.Callback):
    """Per training batch, whether the parameters hold sharded gradients when it ends: FSDP's reduce-scatter
    is what makes them (its collectives do not go through ``torch.distributed``'s Python functions, so they
    are seen by what they leave, not counted)."""

    def __init__(self) -> None:
        self.per_batch: list[bool] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        grads = [p.grad for p in module.parameters()]
        self.per_batch.append(all(g is not None and hasattr(g, "to_local") for g in grads))


def parity(rank: int, world: int, **kwargs) -> dict:
    """fsdp on 2 ranks with batch B against one process with batch 2B, and against ddp on 2 ranks."""
    fsdp = Net()
    counter = ShardedGrads()
    trainer(gradient_clip_val=0.3, callbacks=[counter], **kwargs).fit(fsdp, loader(B))
    ddp = Net()
    trainer("ddp", gradient_clip_val=0.3, **kwargs).fit(ddp, loader(B))
    out = {"fsdp": whole(fsdp), "ddp": whole(ddp), "reductions": counter.per_batch}
    if rank == 0:
        single = Net()
        accumulate = kwargs.get("accumulate_grad_batches", 1)
        trainer("single", 1, gradient_clip_val=0.3, accumulate_grad_batches=accumulate).fit(single, loader(world * B))
        out["single"] = whole(single)
    return out


def memory(rank: int, world: int) -> dict:
    """What each rank holds of the parameters, gradients and optimizer states, against the whole model."""
    module = Net()
    t = trainer(max_epochs=1)
    t.fit(module, loader(B))
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    params = list(module.parameters())
    held = {
        "params": sum(local(p).numel() for p in params),
        "grads": sum(local(p.grad).numel() for p in params if p.grad is not None),
        "optimizer": sum(
            local(v).numel()
            for state in t.optimizers[0].state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ),
    }
    module.zero_grad(set_to_none=False)
    sizes = [p.shape[0] for p in params]
    return {
        "held": held,
        "whole": sum(p.numel() for p in params),
        "rows": sizes,
        "is_dtensor": hasattr(params[0], "to_local"),
        # Lightning's module.device_mesh: the mesh the parameters are sharded over.
        "mesh_is_the_parameters": module.device_mesh is not None and module.device_mesh == params[0].device_mesh,
    }


def resume(rank: int, world: int, tmp: str) -> dict:
    """Uninterrupted against stopped (after an epoch, and mid-epoch) and resumed from ``last``."""
    out = {}
    straight = Net()
    val = DataLoader(data(20), batch_size=B)
    t = trainer(max_epochs=3)
    t.fit(straight, loader(B, shuffle=True), val)
    out["straight_val_loss"] = float(t.callback_metrics["val_loss"])
    out["straight"] = whole(straight)
    for name, stop in (("epoch", {"max_epochs": 1}), ("mid_epoch", {"max_steps": 8})):
        root = os.path.join(tmp, name)
        ckpt = ember.callbacks.ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=4)
        first = Net()
        trainer(enable_checkpointing=True, callbacks=[ckpt], **stop).fit(first, loader(B, shuffle=True), val)
        again = Net()
        ckpt = ember.callbacks.ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=4)
        t = trainer(enable_checkpointing=True, callbacks=[ckpt], max_epochs=3)
        t.fit(again, loader(B, shuffle=True), val, ckpt_path="last")
        out[name] = whole(again)
        out[name + "_val_loss"] = float(t.callback_metrics["val_loss"])
        out[name + "_files"] = sorted(os.listdir(root))
    return out


def from_one_process(rank: int, world: int, tmp: str) -> dict:
    """Resume on 2 ranks from a checkpoint one fsdp process wrote: the first step starts from its weights."""
    module = Net()
    start = {}

    class Capture(ember.Callback):
        def on_train_start(self, trainer, module):
            start.update(whole(module))

    t = trainer(max_epochs=2, callbacks=[Capture()])
    t.fit(module, loader(B), ckpt_path=os.path.join(tmp, "one", "last.ckpt"))
    return {"start": start, "global_step": t.global_step}


def full_file(rank: int, world: int, tmp: str) -> dict:
    """state_dict_type="full": one ordinary file, gathered to rank zero."""
    from ember.strategies.fsdp import FSDPStrategy

    module = Net()
    t = trainer(FSDPStrategy(state_dict_type="full"), max_epochs=1)
    t.fit(module, loader(B))
    path = os.path.join(tmp, "full.ckpt")
    t.save_checkpoint(path)
    return {"weights": whole(module), "path": path}


def lazy(rank: int, world: int) -> dict:
    """Layers built in configure_model on the meta device, sharded, then materialised rank by rank."""
    untrained = Net(lazy=True)
    trainer(max_epochs=1, limit_train_batches=0).fit(untrained, loader(B))
    module = Net(lazy=True)
    trainer(max_epochs=1).fit(module, loader(B))
    return {
        "kept": whole(untrained)["scale"].tolist(),  # built in __init__, not on meta: its values, not memory's
        "seen_meta": module.seen_meta,
        "on_meta": any(p.is_meta for p in module.parameters()),
        "local_rows": module.a.weight.to_local().shape[0],
        "finite": all(torch.isfinite(v).all().item() for v in whole(module).values()),
    }


def features(rank: int, world: int) -> dict:
    """bf16 mixed precision, activation checkpointing, SHARD_GRAD_OP, hybrid, manual optimization, predict."""
    from ember.strategies.fsdp import FSDPStrategy

    out = {}
    reference = Net()
    t = trainer(max_epochs=1)
    t.fit(reference, loader(B))
    ref = whole(reference)
    out["fp32_loss"] = float(t.callback_metrics["loss_epoch"])
    for name, strategy in (
        ("checkpointing", FSDPStrategy(activation_checkpointing_policy={torch.nn.Linear})),
        ("grad_op", FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")),
        ("hybrid", FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(1, world))),
        ("per_layer", FSDPStrategy(auto_wrap_policy={torch.nn.Linear})),
        ("fsdp1_policy", FSDPStrategy(auto_wrap_policy=lambda m, recurse, n: isinstance(m, torch.nn.Linear))),
    ):
        module = Net()
        trainer(strategy, max_epochs=1).fit(module, loader(B))
        out[name] = diff(whole(module), ref)
    manual, manual_ddp = ManualNet(), ManualNet()
    trainer().fit(manual, loader(B))
    trainer("ddp").fit(manual_ddp, loader(B))
    out["manual_vs_ddp"] = diff(whole(manual), whole(manual_ddp))
    module = Net()
    t = trainer(max_epochs=1)
    t.fit(module, loader(B))
    t.fit(module, loader(B))  # the same Trainer again, on the module it sharded
    trainer(max_epochs=1).fit(module, loader(B))  # and a new Trainer
    out["refits"] = [t.global_step, all(torch.isfinite(v).all().item() for v in whole(module).values())]
    module = Net()
    t = trainer(precision="bf16-mixed", max_epochs=1)
    t.fit(module, loader(B))
    out["bf16_dtype"] = str(module.a.weight.dtype)
    out["bf16_vs_fp32"] = diff(whole(module), ref)
    out["bf16_loss"] = float(t.callback_metrics["loss_epoch"])
    t = trainer(max_epochs=1)
    out["predict"] = [p.shape for p in t.predict(reference, DataLoader(data(8), batch_size=B))]
    return out


CHECKS = {
    "parity": lambda r, w, tmp: parity(r, w),
    "accumulation": lambda r, w, tmp: parity(r, w, accumulate_grad_batches=2),
    "memory": lambda r, w, tmp: memory(r, w),
    "resume": resume,
    "from_one_process": from_one_process,
    "full_file": full_file,
    "lazy": lambda r, w, tmp: lazy(r, w),
    "features": lambda r, w, tmp: features(r, w),
}


def suite(rank: int, world: int, tmp: str) -> dict:
    join_as_rank(rank, world)
    out = {}
    for name, check in CHECKS.items():
        try:
            out[name] = check(rank, world, tmp)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def one_process(tmp) -> dict:
    """Before the ranks: one fsdp process (a group of its own) trains 2 epochs and writes ``one/last.ckpt``."""
    module = Net()
    ckpt = ember.callbacks.ModelCheckpoint(dirpath=os.path.join(tmp, "one"), save_last=True)
    trainer(devices=1, enable_checkpointing=True, callbacks=[ckpt]).fit(module, loader(2 * B))
    return {"weights": whole(module)}


@pytest.fixture(scope="module")
def ranks(tmp, one_process) -> list[dict]:
    return run_ranks(suite, 2, tmp, timeout=140)


def results(ranks: list[dict], name: str) -> list[dict]:
    for rank, r in enumerate(ranks):
        assert "error" not in r[name], f"rank {rank}:\n{r[name]['error']}"
    return [r[name] for r in ranks]


# ------------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("name", ["parity", "accumulation"])
def test_two_ranks_train_like_one_process_with_twice_the_batch_and_like_ddp(ranks, name):
    got = results(ranks, name)
    assert diff(got[0]["fsdp"], got[0]["single"]) <= TOL
    assert diff(got[0]["fsdp"], got[0]["ddp"]) <= TOL
    assert diff(got[1]["fsdp"], got[0]["fsdp"]) == 0.0  # the same model, gathered on either rank


def test_accumulation_reduces_gradients_only_at_the_window_end(ranks):
    for got in results(ranks, "accumulation"):
        reduced = got["reductions"]
        assert len(reduced) == 2 * N // (2 * B)  # 2 epochs of N / 2B batches per rank
        assert not any(reduced[0::2]), reduced  # inside the window: gradients kept whole on each rank, unsent
        assert all(reduced[1::2]), reduced  # its last batch: reduce-scattered into each rank's shard
    assert all(results(ranks, "parity")[0]["reductions"])  # without accumulation: every batch


def test_each_rank_holds_half_of_the_parameters_gradients_and_optimizer_states(ranks):
    for got in results(ranks, "memory"):
        assert got["is_dtensor"] and got["mesh_is_the_parameters"]
        # Sharded along the first dimension: a tensor of r rows keeps ceil(r / 2) of them on a rank.
        bound = sum((rows + 1) // 2 * (n // rows) for rows, n in zip(got["rows"], _numels(), strict=True))
        assert got["held"]["params"] <= bound < got["whole"]
        assert got["held"]["grads"] <= bound
        assert got["held"]["optimizer"] <= 2 * bound  # AdamW: exp_avg and exp_avg_sq


def _numels() -> list[int]:
    return [p.numel() for p in Net().parameters()]


@pytest.mark.parametrize("stop", ["epoch", "mid_epoch"])
def test_a_resumed_fit_is_bitwise_the_uninterrupted_one(ranks, stop):
    got = results(ranks, "resume")
    for r in got:
        assert diff(r[stop], r["straight"]) == 0.0
        assert r[stop + "_val_loss"] == r["straight_val_loss"]  # validated under fsdp, synced across the ranks
    files = got[0][stop + "_files"]
    assert "last.ckpt" in files and all(not f.endswith(".tmp") for f in files), files


def test_sharded_checkpoints_are_directories_that_one_plain_process_loads_whole(ranks, tmp):
    straight = results(ranks, "resume")[0]["straight"]
    path = os.path.join(tmp, "epoch", "last.ckpt")
    assert sharded.is_sharded(path)
    assert {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(path))
    module = Net.load_from_checkpoint(path)  # no process group here
    assert diff(whole(module), straight) == 0.0


def test_two_ranks_resume_what_one_process_saved(ranks, one_process):
    for got in results(ranks, "from_one_process"):
        assert diff(got["start"], one_process["weights"]) == 0.0
        assert got["global_step"] > 0


def test_one_process_resumes_what_two_ranks_saved(ranks, tmp):
    saved = Net.load_from_checkpoint(os.path.join(tmp, "mid_epoch", "last.ckpt"))
    start = {}

    class Capture(ember.Callback):
        def on_train_start(self, trainer, module):
            start.update(whole(module))

    t = trainer(devices=1, max_epochs=4, callbacks=[Capture()])
    t.fit(Net(), loader(2 * B), ckpt_path=os.path.join(tmp, "mid_epoch", "last.ckpt"))
    assert diff(start, whole(saved)) == 0.0
    assert t.current_epoch == 4


def test_a_full_state_dict_is_one_file_that_todays_readers_load(ranks):
    got = results(ranks, "full_file")[0]
    assert os.path.isfile(got["path"])
    checkpoint = torch.load(got["path"], weights_only=True)
    assert all(type(v) is torch.Tensor for v in checkpoint["state_dict"].values())
    assert diff(whole(Net.load_from_checkpoint(got["path"])), got["weights"]) == 0.0


def test_layers_built_in_configure_model_start_on_meta_and_end_sharded(ranks):
    for got in results(ranks, "lazy"):
        assert got["seen_meta"] and not got["on_meta"], got
        assert got["local_rows"] == 8, got  # half of Linear(6, 16)'s rows
        assert got["finite"], got
        assert got["kept"] == [1.0, 1.0, 1.0], got


def test_sharding_variants_train_the_same_model(ranks):
    got = results(ranks, "features")[0]
    assert got["refits"] == [6, True]
    assert got["manual_vs_ddp"] <= TOL
    for name in ("checkpointing", "grad_op", "hybrid", "per_layer", "fsdp1_policy"):
        assert got[name] <= TOL, name
    assert got["bf16_dtype"] == "torch.float32"  # the sharded parameters stay fp32; compute is bf16
    assert got["bf16_vs_fp32"] > 0  # computed in bf16: not the fp32 run's weights...
    assert got["bf16_loss"] == pytest.approx(got["fp32_loss"], rel=0.02)  # ...but the same training
    assert got["predict"] == [torch.Size([B, 3])]  # each rank predicts its half, as under ddp


def test_spawned_workers_hand_the_whole_trained_weights_back(ranks):
    from ember.strategies.fsdp import FSDPStrategy

    module = Net()
    trainer(FSDPStrategy(start_method="spawn"), gradient_clip_val=0.3).fit(module, loader(B))
    assert all(type(v) is torch.Tensor for v in module.state_dict().values())  # whole, in this process
    assert diff(whole(module), results(ranks, "parity")[0]["fsdp"]) == 0.0  # the ranks' fit, bitwise
