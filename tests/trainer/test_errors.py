"""Bad input gets an error that says what was wrong and what to do."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ember
from tests.helpers.models import BoringModel, TrainOnlyModel, fast_trainer, regression_loader


def returning(value_fn, base=TrainOnlyModel):
    class M(base):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return value_fn(loss, batch_idx)

    return M()


# ---------------------------------------------------------------------- what training_step returns
def test_training_step_returning_none_skips_the_batch_with_a_warning():
    # As Lightning (checked against 2.6.6): the batch's backward is skipped, its optimizer step updates
    # nothing but counts in global_step (and steps a step-interval scheduler), and on_train_batch_end
    # gets {} as its outputs.
    module = returning(lambda loss, i: None if i == 1 else loss)
    seen: list = []

    class Outputs(ember.callbacks.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append((batch_idx, trainer.global_step, sorted(outputs), trainer.optimizers[0].param_groups[0]["lr"]))

    def configure_optimizers():
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), "interval": "step"}]

    module.configure_optimizers = configure_optimizers
    trainer = fast_trainer(limit_train_batches=3, callbacks=[Outputs()])
    after_first = {}

    class Snapshot(ember.callbacks.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            after_first.setdefault(batch_idx, module.layer.weight.detach().clone())

    trainer.callbacks.append(Snapshot())
    with pytest.warns(
        UserWarning,
        match=r"training_step returned None for batch 1: skipping its backward, and that of every batch that "
        r"returns None \(said once per fit\). As in Lightning, the optimizer step still counts in global_step",
    ):
        trainer.fit(module, regression_loader())
    assert trainer.global_step == 3
    assert seen == [(0, 1, ["loss"], 0.05), (1, 2, [], 0.025), (2, 3, ["loss"], 0.0125)]
    assert torch.equal(after_first[0], after_first[1])  # the None batch changed no weight
    assert not torch.equal(after_first[1], after_first[2])


def test_training_step_returning_none_everywhere_trains_nothing_and_warns_once_per_fit():
    module = returning(lambda loss, i: None)
    before = module.layer.weight.detach().clone()
    trainer = fast_trainer(max_epochs=2)
    for _ in range(2):  # each fit says it once, not once per batch (4 batches x 2 epochs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, regression_loader())
        assert [str(w.message) for w in caught if "returned None" in str(w.message)] == [
            "training_step returned None for batch 0: skipping its backward, and that of every batch that returns "
            "None (said once per fit). As in Lightning, the optimizer step still counts in global_step; it updates "
            "with the gradients of the accumulation window's other batches, if any."
        ]
    # Every batch's step counted (4 batches x 2 epochs), none updated a weight.
    assert trainer.global_step == 8 and torch.equal(before, module.layer.weight)


def test_none_inside_an_accumulation_window_skips_only_that_batch():
    module = returning(lambda loss, i: None if i == 0 else loss)
    trainer = fast_trainer(accumulate_grad_batches=2)
    with pytest.warns(UserWarning, match="returned None for batch 0"):
        trainer.fit(module, regression_loader())
    assert trainer.global_step == 2


def test_training_step_returning_a_non_scalar():
    module = returning(lambda loss, i: loss.expand(3))
    with pytest.raises(
        ValueError,
        match=r"training_step returned a loss of shape \(3,\); the loss must be a scalar. "
        r"Reduce it \(e.g. loss.mean\(\)\)",
    ):
        fast_trainer().fit(module, regression_loader())


@pytest.mark.parametrize(
    "value,name", [(lambda loss: loss.item(), "float"), (lambda loss: [loss], "list"), (lambda loss: "loss", "str")]
)
def test_training_step_returning_a_non_tensor(value, name):
    module = returning(lambda loss, i: value(loss))
    with pytest.raises(
        TypeError,
        match=rf"training_step must return a scalar loss tensor, a dict with 'loss', or None "
        rf"to skip the batch; it returned {name}",
    ):
        fast_trainer().fit(module, regression_loader())


def test_training_step_returning_a_dict_without_loss():
    module = returning(lambda loss, i: {"los": loss})
    with pytest.raises(ValueError, match=r"training_step returned a dict without a 'loss' key \(keys: \['los'\]\)"):
        fast_trainer().fit(module, regression_loader())


def test_training_step_returning_a_detached_loss():
    module = returning(lambda loss, i: loss.detach())
    with pytest.raises(ValueError, match=r"loss that does not require grad.*torch.no_grad\(\), or detached"):
        fast_trainer().fit(module, regression_loader())


def test_missing_training_step():
    class NoStep(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(NotImplementedError, match=r"NoStep must define training_step\(self, batch, batch_idx\)"):
        fast_trainer().fit(NoStep(), regression_loader())


def test_missing_configure_optimizers():
    class NoOpt(TrainOnlyModel):
        configure_optimizers = ember.TrainModule.configure_optimizers

    with pytest.raises(
        NotImplementedError,
        match=r"NoOpt must define configure_optimizers\(\) returning an optimizer, "
        r"a list of them",
    ):
        fast_trainer().fit(NoOpt(), regression_loader())


# ---------------------------------------------------------------------- strategy / accelerator / devices / precision
def test_unknown_strategy_lists_names_and_suggests_the_closest():
    with pytest.raises(ValueError) as info:
        fast_trainer(strategy="singel")
    msg = str(info.value)
    assert "Unknown strategy 'singel'. Did you mean 'single'?" in msg
    assert "Registered strategies: " in msg and all(n in msg for n in ("single", "dp", "ddp", "ddp_spawn"))
    assert "register_strategy" in msg


def test_unknown_strategy_without_a_close_name():
    with pytest.raises(ValueError) as info:
        fast_trainer(strategy="zzzzzz")
    assert "Did you mean" not in str(info.value) and "Registered strategies" in str(info.value)


def test_a_misspelt_strategy_with_swapped_or_doubled_letters_is_suggested():
    """Suggestions count a wrong, missing, extra or swapped letter as one slip, so "dpp" offers both names it
    is one slip from (difflib offered only "dp")."""
    with pytest.raises(ValueError, match=r"Unknown strategy 'dpp'\. Did you mean 'ddp' or 'dp'\?"):
        fast_trainer(strategy="dpp")
    with pytest.raises(ValueError, match=r"Unknown strategy 'sinlge'\. Did you mean 'single'\?"):
        fast_trainer(strategy="sinlge")
    with pytest.raises(ValueError, match=r"Unknown strategy 'DDP'\. Did you mean 'ddp'"):
        fast_trainer(strategy="DDP")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"default_root_dir": 5},
            TypeError,
            r"default_root_dir must be a directory path \(a str or a pathlib.Path\), got 5 \(int\)\. Pass where "
            r"logs and checkpoints go",
        ),
        (
            {"max_time": {"hourz": 2}},
            TypeError,
            r"max_time has the key 'hourz', which is not a unit of time \(did you mean 'hours'\?\)\. Its keys are "
            r"datetime.timedelta's arguments: weeks, days, hours, minutes, seconds",
        ),
        ({"max_time": {"hours": "2"}}, TypeError, r"max_time\['hours'\] is '2', not a number"),
        ({"max_time": "2h"}, ValueError, r"max_time is '2h': .*'DD:HH:MM:SS'.* It takes a datetime.timedelta"),
        ({"max_time": -5}, ValueError, r"max_time is -5, a negative duration"),
    ],
)
def test_bad_root_dir_and_max_time_name_the_argument_and_the_value(kwargs, error, match):
    with pytest.raises(error, match=match):
        fast_trainer(**kwargs)


def test_unknown_accelerator():
    with pytest.raises(ValueError, match=r"Unknown accelerator 'tpu'. Use one of auto, cpu, cuda, gpu"):
        fast_trainer(accelerator="tpu")


def test_cuda_requested_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for accelerator in ("cuda", "gpu"):
        with pytest.raises(
            RuntimeError,
            match=r"accelerator='cuda' was requested but CUDA is not available.*"
            r"Use accelerator='cpu'",
        ):
            fast_trainer(accelerator=accelerator)


@pytest.mark.parametrize("accelerator", ["cuda", "auto"])
def test_more_devices_than_available(monkeypatch, accelerator):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"devices=4 but only 2 CUDA device\(s\) are available. Ask for at most 2"):
        fast_trainer(accelerator=accelerator, devices=4)
    with pytest.raises(ValueError, match=r"devices=\[0, 2\] names CUDA device 2 but only 2 exist \(0..1\)"):
        fast_trainer(accelerator=accelerator, devices=[0, 2])


def test_unknown_precision():
    with pytest.raises(
        ValueError,
        match=r"Unknown precision 'half'. Use one of '32-true', '64-true', 'bf16-mixed', "
        r"'16-mixed'",
    ):
        fast_trainer(precision="half")


# ---------------------------------------------------------------------- loop limits
@pytest.mark.parametrize("bad", [-2, -10, 1.5, "3"])
def test_max_epochs_below_minus_one(bad):
    with pytest.raises(ValueError, match=rf"max_epochs must be a non-negative int \(or -1 for no limit\), got {bad!r}"):
        fast_trainer(max_epochs=bad)


def test_max_epochs_minus_one_is_allowed():
    assert fast_trainer(max_epochs=-1, max_steps=3).max_epochs == -1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_steps": -2}, r"max_steps must be a non-negative int \(or -1 for no limit\), got -2"),
        ({"min_epochs": -1}, r"min_epochs must be a non-negative int, got -1"),
        ({"accumulate_grad_batches": 0}, r"accumulate_grad_batches must be a positive int, got 0"),
        ({"gradient_clip_algorithm": "l2"}, r"gradient_clip_algorithm must be 'norm' or 'value', got 'l2'"),
        ({"gradient_clip_val": -1.0}, r"gradient_clip_val must be >= 0, got -1.0"),
    ],
)
def test_bad_loop_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fast_trainer(**kwargs)


# ---------------------------------------------------------------------- data
def test_empty_train_loader():
    empty = DataLoader(TensorDataset(torch.empty(0, 4), torch.empty(0, 1)), batch_size=4)
    with pytest.raises(
        ValueError,
        match=r"The train dataloader is empty \(0 batches after limit_train_batches\). "
        r"Check the dataset, batch_size with drop_last",
    ):
        fast_trainer().fit(BoringModel(), empty)


def test_train_loader_empty_after_drop_last():
    loader = DataLoader(TensorDataset(torch.randn(3, 4), torch.randn(3, 1)), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="The train dataloader is empty"):
        fast_trainer().fit(BoringModel(), loader)


def test_empty_train_stream_without_length_ends_its_epochs_with_a_warning():
    class Nothing(IterableDataset):
        def __iter__(self):
            return iter(())

    trainer = fast_trainer(max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:  # as Lightning, no error; unlike it, said (once)
        warnings.simplefilter("always")
        trainer.fit(BoringModel(), Nothing())
    said = [str(w.message) for w in caught if "yielded no batch" in str(w.message)]
    assert (
        len(said) == 1
        and said[0].startswith("The train dataloader yielded no batch. Check the dataset is not empty")
        and "(epoch 0; it has no length" in said[0]
    )
    assert trainer.current_epoch == 2 and trainer.global_step == 0


def test_fractional_limit_on_a_loader_without_length():
    from tests.helpers.models import UnsizedBatches

    message = r"A fractional limit_\*_batches needs a dataloader with a length; pass an int"
    with pytest.raises(ValueError, match=message):
        fast_trainer(limit_train_batches=0.5).fit(BoringModel(), UnsizedBatches())


def test_fractional_val_check_interval_on_a_train_loader_without_length():
    # Without a length there is no "half an epoch": it would silently never validate.
    from tests.helpers.models import UnsizedBatches

    with pytest.raises(
        ValueError,
        match=r"val_check_interval=0.5 is a fraction of an epoch, but the train dataloader "
        r"has no length.*int",
    ):
        fast_trainer(val_check_interval=0.5).fit(BoringModel(), UnsizedBatches(), regression_loader())


def test_fit_without_training_data():
    with pytest.raises(
        ValueError,
        match=r"fit needs training data: pass train_dataloaders, or a datamodule with "
        r"train_dataloader\(\)",
    ):
        fast_trainer().fit(BoringModel())


def test_val_loader_without_validation_step():
    with pytest.raises(
        ValueError,
        match=r"Validation data was given but TrainOnlyModel defines no validation_step. "
        r"Define validation_step or do not pass val_dataloaders",
    ):
        fast_trainer().fit(TrainOnlyModel(), regression_loader(), regression_loader())


@pytest.mark.parametrize("entry,hook", [("validate", "validation_step"), ("test", "test_step")])
def test_evaluating_without_the_step(entry, hook):
    with pytest.raises(ValueError, match=rf"TrainOnlyModel defines no {hook}; define it to {entry}"):
        getattr(fast_trainer(), entry)(TrainOnlyModel(), regression_loader())


@pytest.mark.parametrize("entry", ["validate", "test", "predict"])
def test_evaluating_without_data(entry):
    with pytest.raises(ValueError, match=rf"{entry} needs data: pass dataloaders or a datamodule"):
        getattr(fast_trainer(), entry)(BoringModel())


def test_eval_without_a_module_and_nothing_fitted():
    with pytest.raises(ValueError, match="No module given and none was fitted with this Trainer: pass the module"):
        fast_trainer().validate(dataloaders=regression_loader())


def test_fit_with_dataloaders_and_a_datamodule():
    with pytest.raises(ValueError, match="Pass either dataloaders or a datamodule to fit, not both"):
        fast_trainer().fit(BoringModel(), regression_loader(), datamodule=ember.DataModule())


# ---------------------------------------------------------------------- the module itself
def test_fit_a_plain_nn_module():
    with pytest.raises(TypeError, match=r"Expected an ember.TrainModule, got Linear. Subclass ember.TrainModule"):
        fast_trainer().fit(torch.nn.Linear(2, 2), regression_loader())


def test_module_that_did_not_call_super_init():
    class Forgot(BoringModel):
        def __init__(self):
            torch.nn.Module.__init__(self)

    with pytest.raises(RuntimeError, match=r"Forgot.__init__ did not call super\(\).__init__\(\); call it first"):
        fast_trainer().fit(Forgot(), regression_loader())


def test_errors_still_tear_down():
    calls = []

    class Boom(TrainOnlyModel):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

        def teardown(self, stage):
            calls.append(stage)

    trainer = fast_trainer()
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Boom(), regression_loader())
    assert calls == ["fit"] and trainer.state == "finished"


# ---------------------------------------------------------------------- dataloader_idx and several loaders
class _Eval(TrainOnlyModel):
    def validation_step(self, batch, batch_idx):
        return None


def test_several_loaders_need_a_step_that_takes_dataloader_idx():
    # As Lightning (a RuntimeError before any evaluation hook runs), in ember's words.
    trainer = fast_trainer()
    loaders = [regression_loader(), regression_loader()]
    with pytest.raises(
        RuntimeError,
        match=r"There are several val dataloaders, but _Eval.validation_step\(\) takes no dataloader_idx: add "
        r"`dataloader_idx=0` to its arguments",
    ):
        trainer.validate(_Eval(), loaders)

    class Hooked(_Eval):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            return None

        def on_validation_batch_end(self, outputs, batch, batch_idx):
            pass

    with pytest.raises(RuntimeError, match=r"Hooked.on_validation_batch_end\(\) takes no dataloader_idx"):
        trainer.validate(Hooked(), loaders)

    class Varargs(_Eval):
        def validation_step(self, batch, batch_idx, *args):
            self.seen = getattr(self, "seen", set()) | set(args)

    module = Varargs()
    trainer.validate(module, loaders)  # *args takes it, as in Lightning
    assert module.seen == {0, 1}


def test_one_loader_and_a_step_that_requires_dataloader_idx():
    class Requires(_Eval):
        def test_step(self, batch, batch_idx, dataloader_idx):
            return None

    with pytest.raises(
        RuntimeError,
        match=r"There is one test dataloader, but Requires.test_step\(\) requires dataloader_idx, which is given "
        r"only with several: give it a default \(`dataloader_idx=0`\) or remove it.",
    ):
        fast_trainer().test(Requires(), regression_loader())

    class Defaults(_Eval):
        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            return batch_idx

    assert fast_trainer().predict(Defaults(), regression_loader()) == [0, 1, 2, 3]
