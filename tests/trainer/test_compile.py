"""trainer.fit(torch.compile(module)) and a compiled submodule, under single and ddp (dp refuses), and their
checkpoints loading into uncompiled modules.

The compiled graphs run on a counting eager backend: what is tested here is ember's part (unwrapping the
``torch.compile`` result, compiling its steps, the strategies around them, the checkpoint keys), not
inductor's code generation, which would take minutes per test on a small CPU machine.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ember
from tests.helpers.models import BoringModel, fast_trainer, regression_loader

pytestmark = pytest.mark.compile


class CountingBackend:
    """A torch.compile backend that runs the captured graphs eagerly and counts them."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_fit_a_compiled_module_runs_its_compiled_steps_and_trains_as_eager(tmp_path):
    eager = BoringModel()
    compiled_module = copy.deepcopy(eager)
    fast_trainer(max_epochs=2).fit(eager, regression_loader())
    backend = CountingBackend()
    trainer = ember.Trainer(max_epochs=2, accelerator="cpu", default_root_dir=tmp_path, enable_progress_bar=False)
    trainer.fit(torch.compile(compiled_module, backend=backend), regression_loader())
    assert backend.graphs > 0  # the steps ran through dynamo
    assert trainer.module is compiled_module and trainer.global_step == 8
    for a, b in zip(eager.parameters(), compiled_module.parameters()):
        torch.testing.assert_close(a, b)
    # The default checkpoint has the plain keys and loads into an uncompiled module.
    ckpt = trainer.checkpoint_callback.best_model_path
    loaded = BoringModel.load_from_checkpoint(ckpt)
    for a, b in zip(loaded.parameters(), compiled_module.parameters()):
        assert torch.equal(a, b)
    # validate takes the torch.compile result too.
    assert trainer.validate(torch.compile(compiled_module, backend=backend), regression_loader())[0]["val_loss"] >= 0


class CompiledInside(BoringModel):
    def __init__(self, compile_layer: bool = True) -> None:
        super().__init__()
        if compile_layer:
            self.layer = torch.compile(self.layer, backend="eager")


def test_a_compiled_submodule_trains_and_its_checkpoint_loads_either_way(tmp_path):
    module = CompiledInside()
    trainer = fast_trainer(max_epochs=1, enable_checkpointing=True, default_root_dir=tmp_path)
    trainer.fit(module, regression_loader())
    path = str(tmp_path / "compiled.ckpt")
    trainer.save_checkpoint(path)
    assert "layer._orig_mod.weight" in torch.load(path, weights_only=True)["state_dict"]
    plain = CompiledInside.load_from_checkpoint(path, compile_layer=False)
    assert torch.equal(plain.layer.weight, module.layer.weight)
    # ... and a checkpoint of the uncompiled module resumes a fit of the compiled one.
    plain_path = str(tmp_path / "plain.ckpt")
    trainer = fast_trainer(max_epochs=1, default_root_dir=tmp_path)
    trainer.fit(CompiledInside(compile_layer=False), regression_loader())
    trainer.save_checkpoint(plain_path)
    resumed = fast_trainer(max_epochs=2, default_root_dir=tmp_path)
    resumed.fit(CompiledInside(), regression_loader(), ckpt_path=plain_path)
    assert resumed.global_step == 8


def test_dp_refuses_a_compiled_module_with_what_to_do():
    with pytest.raises(ValueError, match="strategy='dp' cannot run a torch.compile'd module.*'single' or 'ddp'"):
        fast_trainer(strategy="dp", devices=2).fit(torch.compile(BoringModel(), backend="eager"), regression_loader())


def test_compiling_something_else_than_a_train_module_is_refused():
    with pytest.raises(TypeError, match="torch.compile wrapped a Linear, not an ember.TrainModule"):
        fast_trainer().fit(torch.compile(torch.nn.Linear(4, 1), backend="eager"), regression_loader())


def _two_ranks(rank: int, world: int) -> dict:
    from tests.helpers.dist import join_as_rank

    join_as_rank(rank, world)
    torch.manual_seed(0)
    eager = BoringModel()
    compiled = copy.deepcopy(eager)
    backend = CountingBackend()
    for module in (eager, torch.compile(compiled, backend=backend)):
        ember.Trainer(
            strategy="ddp",
            devices=world,
            accelerator="cpu",
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
        ).fit(module, regression_loader())
    return {
        "graphs": backend.graphs,
        "eager": [p.detach() for p in eager.parameters()],
        "compiled": [p.detach() for p in compiled.parameters()],
    }


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_under_ddp_a_compiled_module_trains_as_the_eager_one():
    from tests.helpers.dist import run_ranks

    ranks = run_ranks(_two_ranks, 2, timeout=170)
    for r in ranks:
        assert r["graphs"] > 0
        for a, b, c in zip(r["eager"], r["compiled"], ranks[0]["compiled"]):
            torch.testing.assert_close(a, b)  # the gradient all-reduce ran under the compiled steps
            assert torch.equal(b, c)  # and every rank holds the same weights


def test_a_compiled_step_without_batch_idx_gets_the_batch_alone():
    class BatchOnly(BoringModel):
        def training_step(self, batch):
            return super().training_step(batch, 0)

    trainer = fast_trainer(max_steps=2)
    trainer.fit(torch.compile(BatchOnly(), backend="eager"), regression_loader())
    assert trainer.global_step == 2
