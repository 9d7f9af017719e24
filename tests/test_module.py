"""TrainModule on its own: hyper-parameters, state outside a Trainer, defaults and their messages; its
API around the step: loggers, toggled optimizers, freeze, nested modules, step signatures; and
DataModule.from_datasets and on_exception.

Every expected value in the API part (from toggle_optimizer on) was first observed on Lightning 2.6.6
with the same classes.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch.utils.data import RandomSampler, SequentialSampler, TensorDataset

import ember
from ember.loggers import CSVLogger
from ember.module import takes_batch_idx
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


class HP(ember.TrainModule):
    def __init__(self, lr: float = 1e-3, layers: int = 2, *args, name: str = "m", **kwargs) -> None:
        super().__init__()
        self.save_hyperparameters()


class HPSubset(ember.TrainModule):
    def __init__(self, lr: float = 0.1, big: object = None, other: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters("lr", "other")


class HPIgnore(ember.TrainModule):
    def __init__(self, lr: float = 0.1, net: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore="net")


class HPBase(ember.TrainModule):
    def __init__(self, lr: float = 0.1, **kwargs) -> None:
        super().__init__()
        self.save_hyperparameters()


class HPChild(HPBase):
    def __init__(self, width: int = 8, lr: float = 0.5) -> None:
        super().__init__(lr=lr, width=width)


def test_save_hyperparameters_records_init_arguments():
    m = HP(0.5, 3, name="x", extra=True)
    assert dict(m.hparams) == {"lr": 0.5, "layers": 3, "name": "x", "extra": True}
    assert m.hparams.lr == 0.5


def test_save_hyperparameters_defaults():
    assert dict(HP().hparams) == {"lr": 1e-3, "layers": 2, "name": "m"}


def test_save_hyperparameters_subset_and_ignore():
    assert dict(HPSubset(0.2, big=object()).hparams) == {"lr": 0.2, "other": 3}
    assert dict(HPIgnore(net=torch.nn.Linear(1, 1)).hparams) == {"lr": 0.1}


def test_save_hyperparameters_in_a_base_class_sees_kwargs_passed_up():
    m = HPChild(width=16)
    assert m.hparams["lr"] == 0.5 and m.hparams["width"] == 16


def test_hparams_hold_the_arguments_and_hparams_initial_a_copy():
    """Checked against Lightning 2.6.6: ``hparams`` holds the objects passed (the same list), and
    ``hparams_initial`` a deep copy taken by save_hyperparameters, unchanged by later edits."""
    values = [1, 2]
    m = HP(lr=values)
    values.append(3)
    m.hparams.layers = 9
    assert m.hparams.lr is values
    assert dict(m.hparams_initial) == {"lr": [1, 2], "layers": 2, "name": "m"}
    m.hparams_initial["lr"] = 0  # a fresh copy each time: editing it changes nothing
    assert m.hparams_initial.lr == [1, 2]


def test_missing_hyperparameter_message():
    message = r"No hyper-parameter named 'momentum'; saved ones: \['layers', 'lr', 'name'\]"
    with pytest.raises(AttributeError, match=message):
        _ = HP().hparams.momentum


def test_hparams_attribute_assignment():
    m = HP()
    m.hparams.lr = 3.0
    assert m.hparams["lr"] == 3.0


def test_log_outside_a_trainer():
    with pytest.raises(
        RuntimeError,
        match=r"self.log\('x', ...\) was called outside of a Trainer run. Call it from "
        r"training_step",
    ):
        BoringModel().log("x", 1.0)


def test_trainer_and_optimizers_outside_a_trainer():
    m = BoringModel()
    with pytest.raises(RuntimeError, match="BoringModel is not attached to a Trainer"):
        _ = m.trainer
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        m.optimizers()


def test_device():
    assert BoringModel().device == torch.device("cpu")
    assert BoringModel().double().device == torch.device("cpu")

    class BufferOnly(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.zeros(1, device="meta"))

    assert BufferOnly().device == torch.device("meta")
    assert ember.TrainModule().device == torch.device("cpu")


def test_default_predict_step_calls_forward_on_the_input():
    m = BoringModel()
    x = torch.randn(3, 4)
    torch.testing.assert_close(m.predict_step((x, torch.zeros(3)), 0), m(x))
    torch.testing.assert_close(m.predict_step(x, 0), m(x))
    torch.testing.assert_close(m.predict_step([x], 0), m(x))


@pytest.mark.parametrize(
    "method,args,match",
    [
        ("training_step", (None, 0), r"TrainModule must define training_step\(self, batch, batch_idx\)"),
        ("validation_step", (None, 0), r"TrainModule has no validation_step; define it to validate"),
        ("test_step", (None, 0), r"TrainModule has no test_step; define it to test"),
        ("configure_optimizers", (), r"TrainModule must define configure_optimizers\(\) returning an optimizer"),
    ],
)
def test_defaults_explain_what_to_define(method, args, match):
    with pytest.raises(NotImplementedError, match=match):
        getattr(ember.TrainModule(), method)(*args)


def test_defaults():
    m = ember.TrainModule()
    assert m.automatic_optimization is True
    assert list(m.configure_callbacks()) == []
    assert dict(m.hparams) == {}
    assert m.on_train_batch_start(None, 0) is None


# ---------------------------------------------------------------------- toggle_optimizer
class TwoOptimizers(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = torch.nn.Linear(4, 1)
        self.b = torch.nn.Linear(4, 1)
        self.frozen = torch.nn.Linear(1, 1)
        self.frozen.weight.requires_grad_(False)
        self.seen: list[tuple[Any, ...]] = []

    def _flags(self, tag: str) -> None:
        self.seen.append(
            (
                tag,
                self.a.weight.requires_grad,
                self.b.weight.requires_grad,
                self.frozen.weight.requires_grad,
                self.frozen.bias.requires_grad,
            )
        )

    def training_step(self, batch: Any, batch_idx: int) -> None:
        o1, o2 = self.optimizers()
        self.toggle_optimizer(o1)
        self._flags("t1")
        self.untoggle_optimizer(o1)
        self._flags("u1")
        with self.toggled_optimizer(o2):
            self._flags("t2")
        self._flags("u2")

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.SGD([*self.a.parameters(), *self.frozen.parameters()], lr=0.1),
            torch.optim.SGD(self.b.parameters(), lr=0.1),
        ]


def test_toggle_and_untoggle_optimizer():
    """Lightning 2.6.6 (a.weight, b.weight, frozen.weight, frozen.bias): t1 (T, F, F, T), u1 (T, T, F, T),
    t2 (F, T, F, F), u2 (T, T, F, T): a parameter frozen beforehand stays frozen."""
    m = TwoOptimizers()
    fast_trainer(max_steps=1, limit_train_batches=1).fit(m, regression_loader())
    assert m.seen == [
        ("t1", True, False, False, True),
        ("u1", True, True, False, True),
        ("t2", False, True, False, False),
        ("u2", True, True, False, True),
    ]


def test_toggle_optimizer_outside_a_trainer_explains():
    """Lightning 2.6.6: RuntimeError, 'TwoOptimizers is not attached to a `Trainer`.'"""
    m = TwoOptimizers()
    with pytest.raises(RuntimeError, match="TwoOptimizers is not attached to a Trainer"):
        m.toggle_optimizer(torch.optim.SGD(m.a.parameters(), lr=0.1))


def test_freeze_and_unfreeze():
    """Lightning 2.6.6: both return the module; freeze: eval mode, no parameter requires grad; unfreeze:
    train mode, every parameter (the one frozen before too) requires grad."""
    m = TwoOptimizers()
    assert m.freeze() is m
    assert not m.training and not any(p.requires_grad for p in m.parameters())
    assert m.unfreeze() is m
    assert m.training and all(p.requires_grad for p in m.parameters())


# ---------------------------------------------------------------------- loggers, nested modules
class Deep(ember.TrainModule):
    pass


class Inner(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.deep = Deep()


class Outer(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.listed = torch.nn.ModuleList([Deep()])
        self.got: tuple[Any, ...] = ()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.got = (
            self.logger,
            list(self.loggers),
            self.inner.trainer is self.trainer,
            self.inner.deep.trainer is self.trainer,
        )
        return super().training_step(batch, batch_idx)


def test_logger_and_loggers(tmp_path):
    """Lightning 2.6.6: outside a Trainer None and []; inside, the Trainer's logger and loggers (None and []
    with logger=False)."""
    m = Outer()
    assert m.logger is None and m.loggers == []
    csv = CSVLogger(str(tmp_path))
    trainer = fast_trainer(max_steps=1, logger=csv)
    trainer.fit(m, regression_loader())
    assert m.got[0] is csv and m.got[1] == [csv]
    m2 = Outer()
    fast_trainer(max_steps=1).fit(m2, regression_loader())
    assert m2.got[:2] == (None, [])


def test_setting_the_trainer_reaches_nested_train_modules():
    """Lightning 2.6.6: children that are LightningModules (and theirs) get the Trainer; one inside a plain
    ModuleList does not (only direct children are visited)."""
    m = Outer()
    trainer = fast_trainer(max_steps=1)
    trainer.fit(m, regression_loader())
    assert m.got[2:] == (True, True)
    other = Outer()
    other.trainer = trainer
    assert other.inner.trainer is trainer and other.inner.deep.trainer is trainer
    assert other.listed[0]._trainer is None
    other.trainer = None
    assert other.inner._trainer is None and other.inner.deep._trainer is None


# ---------------------------------------------------------------------- step signatures
def _decorate(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


class Signatures:
    def batch_only(self, batch): ...
    def renamed(self, b, i): ...
    def varargs(self, b, *args): ...
    def kwargs_only(self, batch, **kwargs): ...
    def defaulted(self, batch, batch_idx=None): ...
    def named(self, batch, *, batch_idx): ...

    @_decorate
    def decorated(self, batch): ...

    @_decorate
    def decorated_two(self, batch, batch_idx): ...


@pytest.mark.parametrize(
    "name, expected",
    [
        ("batch_only", False),
        ("renamed", True),
        ("varargs", True),
        ("kwargs_only", False),
        ("defaulted", True),
        ("named", False),
        ("decorated", False),
        ("decorated_two", True),
    ],
)
def test_which_steps_take_batch_idx(name, expected):
    """Lightning 2.6.6 called training_step(batch) for ``(self, batch)``, ``(self, batch, **kwargs)`` (kwargs
    {}) and a functools.wraps-decorated ``(self, batch)``; (batch, 0) for ``(self, b, i)`` and
    ``(self, batch, batch_idx=None)``; validation_step(b, 0) for ``(self, b, *args)``. A keyword-only
    batch_idx is not positional, so getfullargspec's args (what Lightning reads) do not hold it."""
    assert takes_batch_idx(getattr(Signatures(), name)) is expected


# ---------------------------------------------------------------------- DataModule
def test_from_datasets():
    """Lightning 2.6.6: train RandomSampler, batch_size 4, num_workers 0; a list of val datasets gives a list
    of loaders (SequentialSampler, lengths [2, 1]); a dict a dict; stages without a dataset keep their
    default (predict_dataloader raises)."""
    ds, ds2 = TensorDataset(torch.arange(6.0)), TensorDataset(torch.arange(4.0))
    dm = ember.DataModule.from_datasets(train_dataset=ds, val_dataset=[ds, ds2], test_dataset={"a": ds2}, batch_size=4)
    train = dm.train_dataloader()
    assert isinstance(train.sampler, RandomSampler) and train.batch_size == 4 and train.num_workers == 0
    val = dm.val_dataloader()
    assert isinstance(val, list) and [type(v.sampler) for v in val] == [SequentialSampler] * 2
    assert [len(v) for v in val] == [2, 1]
    assert {k: len(v) for k, v in dm.test_dataloader().items()} == {"a": 1}
    with pytest.raises(NotImplementedError, match="defines no predict_dataloader"):
        dm.predict_dataloader()


class SizedData(ember.DataModule):
    def __init__(self, batch_size: int, extra: int = 0) -> None:
        super().__init__()
        self.batch_size, self.extra = batch_size, extra


class AnyData(ember.DataModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.kwargs = kwargs


def test_from_datasets_passes_what_init_takes():
    """Lightning 2.6.6: batch_size 3 and extra 5 reach __init__ (2 train batches of 6 samples); an __init__
    with **kwargs gets {'batch_size': 1, 'num_workers': 0}."""
    ds = TensorDataset(torch.arange(6.0))
    dm = SizedData.from_datasets(train_dataset=ds, batch_size=3, extra=5)
    assert (dm.batch_size, dm.extra, len(dm.train_dataloader())) == (3, 5, 2)
    assert AnyData.from_datasets(ds).kwargs == {"batch_size": 1, "num_workers": 0}
    with pytest.raises(TypeError, match="from_datasets got a int; pass a torch Dataset, or a list or dict"):
        ember.DataModule.from_datasets(train_dataset=3)


def test_a_fit_from_datasets():
    dm = ember.DataModule.from_datasets(train_dataset=regression_loader().dataset, batch_size=8)
    trainer = fast_trainer(max_epochs=1)
    trainer.fit(BoringModel(), datamodule=dm)
    assert trainer.global_step == 4


def test_datamodule_on_exception_is_a_no_op_hook():
    assert ember.DataModule().on_exception(RuntimeError("x")) is None


def test_print_goes_through_the_progress_bar_while_one_is_drawn(capsys):
    class Prints(BoringModel):
        def training_step(self, batch, batch_idx):
            self.print("step", batch_idx)
            return super().training_step(batch, batch_idx)

    bar = ember.callbacks.TQDMProgressBar()
    through_bar: list[tuple] = []
    bar.print = lambda *args, **kwargs: through_bar.append(args)  # type: ignore[method-assign]
    trainer = ember.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False,
                            enable_checkpointing=False, callbacks=[bar])  # fmt: skip
    trainer.fit(Prints(), regression_loader())
    assert through_bar == [("step", 0), ("step", 1)]
    # Without a bar (or without a Trainer) it is the builtin print.
    quiet = ember.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=0, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    capsys.readouterr()
    quiet.fit(Prints(), regression_loader())
    Prints().print("alone")
    assert capsys.readouterr().out.splitlines() == ["step 0", "alone"]
