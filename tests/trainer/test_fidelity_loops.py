"""Loops, hooks and optimization behaving as Lightning 2.6.6 does (each behaviour checked there first):
the module's loader hooks, when evaluation loaders are requested, resuming an epoch ``max_steps`` cut
short, when step-interval ReduceLROnPlateau schedulers step, what ``optimizer.step`` receives, LBFGS
with accumulation, and schedulers in manual optimization."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ember
from ember.callbacks import ModelCheckpoint
from tests.helpers.models import BoringModel, TrainOnlyModel, fast_trainer, regression_data, regression_loader


# ---------------------------------------------------------------------- the module's loader hooks
class LoaderModel(BoringModel):
    """Its loaders come from its own hooks, which count their calls."""

    def __init__(self) -> None:
        super().__init__()
        self.requested: list[str] = []

    def train_dataloader(self) -> Any:
        self.requested.append("train")
        return regression_loader(16)

    def val_dataloader(self) -> Any:
        self.requested.append("val")
        return regression_loader(16, seed=1)

    def test_dataloader(self) -> Any:
        self.requested.append("test")
        return regression_loader(16, seed=2)

    def predict_dataloader(self) -> Any:
        self.requested.append("predict")
        return regression_loader(16, seed=3)


def test_train_module_defines_the_loader_hooks_and_explains_a_missing_one():
    module = BoringModel()
    for name, passed in (
        ("train_dataloader", "train_dataloaders to fit"),
        ("val_dataloader", "val_dataloaders to fit"),
        ("test_dataloader", "dataloaders to test"),
        ("predict_dataloader", "dataloaders to predict"),
    ):
        assert callable(getattr(ember.TrainModule, name))
        message = f"BoringModel defines no {name}\\(\\); define it, or pass {passed}"
        with pytest.raises(NotImplementedError, match=message):
            getattr(module, name)()


def test_a_module_without_loader_hooks_fits_on_the_loaders_given():
    module = BoringModel()
    trainer = fast_trainer(num_sanity_val_steps=0)
    trainer.fit(module, regression_loader(16))
    assert trainer.global_step == 2
    assert trainer.enable_validation is False  # no val_dataloader defined, none given


def test_the_modules_loader_hooks_are_requested_in_lightnings_order():
    module = LoaderModel()
    fast_trainer().fit(module)
    assert module.requested == ["val", "train"]  # validation's when the sanity check starts
    module.requested.clear()
    fast_trainer().validate(module)
    fast_trainer().test(module)
    fast_trainer().predict(module)
    assert module.requested == ["val", "test", "predict"]


@pytest.mark.parametrize("entry", ["validate", "test", "predict"])
def test_a_limit_of_zero_batches_requests_no_loader_and_runs_nothing(entry):
    module = LoaderModel()
    trainer = fast_trainer(limit_val_batches=0, limit_test_batches=0, limit_predict_batches=0)
    result = getattr(trainer, entry)(module)
    assert module.requested == []
    assert result == (None if entry == "predict" else [])  # Lightning returns these


@pytest.mark.parametrize("entry", ["fit", "validate"])
def test_a_val_dataloader_returning_none_is_refused(entry):
    class NoneVal(LoaderModel):
        def val_dataloader(self) -> Any:
            return None

    with pytest.raises(TypeError, match=r"NoneVal.val_dataloader\(\) returned None; it must return a DataLoader"):
        getattr(fast_trainer(), entry)(NoneVal())


EMPTY = "The {} dataloader \\(list\\) has length 0, so no batch of it runs. Make sure this was your intention"


class EmptyVal(LoaderModel):
    """val_dataloader() returns [] and every hook is recorded."""

    def val_dataloader(self) -> Any:
        self.requested.append("val")
        return []

    def on_validation_start(self) -> None:
        self.requested.append("on_validation_start")

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.requested.append("validation_step")


def test_a_val_dataloader_returning_an_empty_list_is_one_loader_without_batches():
    # As Lightning 2.6.6: [] is one loader of length 0 (num_val_batches == [0], val_dataloaders == []), with a
    # warning; the sanity check's hooks run but no validation does, then or during training.
    seen = []

    class Sanity(ember.callbacks.Callback):
        def on_sanity_check_end(self, trainer, module):
            seen.append((trainer.num_val_batches, trainer.num_sanity_val_batches))

    module = EmptyVal()
    trainer = fast_trainer(max_epochs=2, num_sanity_val_steps=2, callbacks=[Sanity()])
    with pytest.warns(UserWarning, match=EMPTY.format("validation")) as caught:
        trainer.fit(module)
    assert len([w for w in caught if "has length 0" in str(w.message)]) == 1
    assert module.requested == ["val", "train"]
    assert seen == [([0], [0])]
    assert trainer.num_val_batches == [0] and trainer.val_dataloaders == []
    assert trainer.global_step == 4 and trainer.enable_validation is True


@pytest.mark.parametrize("empty", [[], "loader"], ids=["list", "DataLoader"])
@pytest.mark.parametrize("entry", ["validate", "test", "predict"])
def test_evaluating_an_empty_list_runs_nothing_and_warns(entry, empty):
    # As Lightning 2.6.6: one loader without batches, no hook runs; validate and test return [], predict None.
    # So for a DataLoader of length 0.
    module = EmptyVal()
    trainer = fast_trainer()
    kind = {"validate": "validation"}.get(entry, entry)
    if empty == "loader":
        empty = DataLoader(regression_data(0), batch_size=4)
    with pytest.warns(UserWarning, match=EMPTY.format(kind).replace("list", type(empty).__name__)):
        result = getattr(trainer, entry)(module, dataloaders=empty)
    assert result == (None if entry == "predict" else [])
    assert "on_validation_start" not in module.requested
    if entry != "validate":
        assert getattr(trainer, f"num_{entry}_batches") == [0]


def test_an_empty_list_for_a_module_without_validation_step_is_nothing_to_validate():
    # Data for a module without validation_step is refused (ember; Lightning warns and skips), but an empty
    # list holds none: the fit goes on, as Lightning's, and says nothing of a loader nothing would run.
    trainer = fast_trainer()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="The validation dataloader")
        trainer.fit(TrainOnlyModel(), regression_loader(16), [])
    assert trainer.num_val_batches == [] and trainer.global_step == 2
    with pytest.raises(ValueError, match="Validation data was given but TrainOnlyModel defines no validation_step"):
        fast_trainer().fit(TrainOnlyModel(), regression_loader(16), regression_loader(8))


def test_a_datamodule_without_val_dataloader_fits_without_validation():
    class Data(ember.DataModule):
        def train_dataloader(self) -> Any:
            return regression_loader(16)

    trainer = fast_trainer()
    trainer.fit(BoringModel(), datamodule=Data())
    assert trainer.global_step == 2 and trainer.enable_validation is False


def test_train_dataloader_is_the_loader_given_to_fit():
    loader = regression_loader(16)
    trainer = fast_trainer()
    trainer.fit(BoringModel(), loader)
    assert trainer.train_dataloader is loader

    class Combined(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(batch["a"], batch_idx)  # a dict of loaders gives dicts of batches

    loaders = {"a": regression_loader(16), "b": regression_loader(8)}
    trainer = fast_trainer()
    trainer.fit(Combined(), loaders)
    assert trainer.train_dataloader == loaders
    assert all(trainer.train_dataloader[k] is loaders[k] for k in loaders)


# ---------------------------------------------------------------------- resuming a cut epoch
class StepRecorder(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[Any] = []

    def on_train_epoch_start(self) -> None:
        self.events.append(("epoch_start", self.current_epoch))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.events.append((self.current_epoch, batch_idx))
        return super().training_step(batch, batch_idx)


def test_resuming_after_max_steps_cut_an_epoch_continues_that_epoch(tmp_path):
    ember.seed_everything(0)
    first = StepRecorder()
    uninterrupted = copy.deepcopy(first)
    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    fast_trainer(max_steps=1, max_epochs=-1, enable_checkpointing=True, callbacks=[checkpoint]).fit(
        first, regression_loader()
    )
    assert first.events == [("epoch_start", 0), (0, 0)]

    resumed = StepRecorder()
    trainer = fast_trainer(max_steps=3, max_epochs=-1)
    trainer.fit(resumed, regression_loader(), ckpt_path=checkpoint.best_model_path)
    assert resumed.events == [(0, 1), (0, 2)]  # the same epoch, no second on_train_epoch_start
    assert trainer.global_step == 3 and trainer.current_epoch == 1  # (the cut epoch counts as run, as Lightning)

    fast_trainer(max_steps=3, max_epochs=-1).fit(uninterrupted, regression_loader())
    for a, b in zip(resumed.parameters(), uninterrupted.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_resuming_after_should_stop_ended_an_epoch_starts_the_next(tmp_path):
    class Stops(StepRecorder):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1 and not self.events[0] == ("resumed",):
                self.trainer.should_stop = True

    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    fast_trainer(max_epochs=2, enable_checkpointing=True, callbacks=[checkpoint]).fit(Stops(), regression_loader())
    resumed = Stops()
    resumed.events.append(("resumed",))
    fast_trainer(max_epochs=2).fit(resumed, regression_loader(), ckpt_path=checkpoint.best_model_path)
    assert resumed.events[1:] == [("epoch_start", 1), (1, 0), (1, 1), (1, 2), (1, 3)]


# ---------------------------------------------------------------------- schedulers
def test_a_step_interval_plateau_scheduler_steps_after_the_validation_it_monitors():
    seen: list[float] = []

    class Plateau(BoringModel):
        validations = 0

        def on_validation_epoch_end(self) -> None:
            self.validations += 1
            self.log("val_count", float(self.validations))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            return [opt], [{"scheduler": sched, "interval": "step", "monitor": "val_count", "strict": False}]

        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            seen.append(float(metric))
            scheduler.step(metric)

    trainer = fast_trainer(val_check_interval=2, num_sanity_val_steps=0)
    with pytest.warns(RuntimeWarning, match="'val_count', which is not available"):  # batch 0: none yet
        trainer.fit(Plateau(), regression_loader(), regression_loader(8, seed=1))
    # Batches 1 and 3 validate: their steps see that validation's value, not the one before it.
    assert seen == [1.0, 1.0, 2.0]


def test_a_scheduler_without_step_is_accepted_in_manual_optimization():
    class NoStep:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer
            self.advanced = 0

        def advance(self) -> None:  # the user's own way to step it
            self.advanced += 1

        def state_dict(self) -> dict[str, Any]:
            return {"advanced": self.advanced}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.advanced = state["advanced"]

    class Manual(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()
            x, y = batch
            self.manual_backward(F.mse_loss(self(x), y))
            opt.step()
            self.lr_schedulers().advance()

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [NoStep(opt)]

    module = Manual()
    fast_trainer().fit(module, regression_loader())
    assert module.lr_schedulers().advanced == 4


# ---------------------------------------------------------------------- what optimizer.step receives
class RecordingSGD(torch.optim.SGD):
    """Records how its ``step`` was called (positional arguments, keyword names)."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.calls: list[tuple[int, list[str]]] = []

    def step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.calls.append((len(args), sorted(kwargs)))
        kwargs.pop("tag", None)
        return super().step(*args, **kwargs)


def test_manual_optimization_passes_the_closure_to_step_by_keyword():
    class Manual(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()

            def closure() -> None:
                x, y = batch
                self.manual_backward(F.mse_loss(self(x), y))

            opt.step(closure=closure, tag="gen") if batch_idx % 2 else opt.step(closure=closure)
            opt.zero_grad()

        def configure_optimizers(self) -> Any:
            self.sgd = RecordingSGD(self.parameters(), lr=0.1)
            return self.sgd

    module = Manual()
    fast_trainer().fit(module, regression_loader())
    assert module.sgd.calls == [(0, ["closure"]), (0, ["closure", "tag"])] * 2  # as Lightning: step(closure=...)


def test_one_optimizer_zero_grad_per_step():
    class Counting(BoringModel):
        def configure_optimizers(self) -> Any:
            self.opt = torch.optim.SGD(self.parameters(), lr=0.1)
            self.zero_grads = 0
            zero_grad = self.opt.zero_grad

            def counted(set_to_none: bool = True) -> None:
                self.zero_grads += 1
                zero_grad(set_to_none)

            self.opt.zero_grad = counted  # type: ignore[method-assign]
            return self.opt

    for k, steps in ((1, 10), (2, 6)):  # 5 batches an epoch, 2 epochs (Lightning: the same counts)
        module = Counting()
        trainer = fast_trainer(max_epochs=2, accumulate_grad_batches=k)
        trainer.fit(module, regression_loader(40), regression_loader(16, seed=1))
        assert (module.zero_grads, trainer.global_step) == (steps, steps)


# ---------------------------------------------------------------------- LBFGS with accumulation
class LBFGSModel(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.closure_calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.closure_calls += 1
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=5)


def test_lbfgs_with_accumulation_equals_a_hand_written_loop():
    """Each closure call at a window's last batch sees the window's earlier gradients plus its own."""
    ember.seed_everything(1)
    module = LBFGSModel()
    reference = copy.deepcopy(module)
    loader = regression_loader(32, batch_size=8)

    opt = reference.configure_optimizers()
    params = list(reference.parameters())
    batches = list(loader)
    for first, last in zip(batches[0::2], batches[1::2]):
        opt.zero_grad()
        (F.mse_loss(reference.layer(first[0]), first[1]) / 2).backward()
        window = [p.grad.clone() for p in params]

        def closure(
            x: torch.Tensor = last[0], y: torch.Tensor = last[1], window: list[torch.Tensor] = window
        ) -> torch.Tensor:
            for p, g in zip(params, window):
                p.grad = g.clone()
            loss = F.mse_loss(reference.layer(x), y)
            (loss / 2).backward()
            return loss

        opt.step(closure)

    trainer = fast_trainer(accumulate_grad_batches=2, num_sanity_val_steps=0)
    trainer.fit(module, loader)
    assert trainer.global_step == 2
    assert module.closure_calls > 4  # the line search evaluated the last batches more than once
    for a, b in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_lbfgs_with_accumulation_runs_one_backward_per_batch_when_it_converges_at_once():
    """With zero gradients LBFGS stops after one evaluation: one training_step per batch (Lightning's count)."""

    class Flat(LBFGSModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.closure_calls += 1
            return self.layer(batch[0]).sum() * 0.0

    module = Flat()
    trainer = fast_trainer(max_steps=5, max_epochs=-1, accumulate_grad_batches=2)
    trainer.fit(module, DataLoader(regression_loader(64, batch_size=4).dataset, batch_size=4))
    assert (trainer.global_step, module.closure_calls) == (5, 10)
