"""TrainModule on its own: hyper-parameters, state outside a Trainer, defaults and their messages."""

from __future__ import annotations

import pytest
import torch

import ember
from tests.helpers.models import BoringModel


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
