"""save_hyperparameters, hparams and hparams_initial on TrainModule and DataModule; load_from_checkpoint.

Every expected value here was first observed on Lightning 2.6.6 with the same classes (written as
LightningModule / LightningDataModule), unless a test says that ember deliberately differs.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from argparse import Namespace
from typing import Any

import pytest
import torch

import ember
from ember.checkpoint import CheckpointError
from ember.hparams import drop_unpicklable
from tests.helpers.models import BoringModel, fast_trainer, regression_loader


# ---------------------------------------------------------------------- the __init__ chain
class Base(ember.TrainModule):
    def __init__(self, a: int = 1, b: int = 2, **kwargs: Any) -> None:
        super().__init__()
        self.save_hyperparameters()


class Sub(Base):
    def __init__(self, c: int = 3, *args: Any, d: int = 4, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


class SubPositional(Base):
    def __init__(self, x: int, y: int = 7) -> None:
        super().__init__(a=x)


def test_a_base_class_call_collects_every_init_of_the_chain():
    """Lightning 2.6.6: {'a': 10, 'b': 2, 'extra': 5, 'c': 30, 'd': 4} and {'a': 100, 'b': 2, 'x': 100, 'y': 7}:
    the base class's arguments first, then the subclass's (which win), ``**kwargs`` items spread, ``*args`` not."""
    m = Sub(c=30, a=10, extra=5)
    assert list(m.hparams.items()) == [("a", 10), ("b", 2), ("extra", 5), ("c", 30), ("d", 4)]
    assert list(SubPositional(100).hparams.items()) == [("a", 100), ("b", 2), ("x", 100), ("y", 7)]


class Mixin:
    def __init__(self, mix: int = 11, **kwargs: Any) -> None:
        super().__init__(**kwargs)


class WithMixin(Mixin, ember.TrainModule):
    def __init__(self, own: int = 5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()


class SavingMixin:
    def __init__(self, mix: int = 11, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()  # type: ignore[attr-defined]


class WithSavingMixin(SavingMixin, ember.TrainModule):
    def __init__(self, own: int = 5) -> None:
        super().__init__(mix=13)


def test_mixins_in_the_chain():
    """Lightning 2.6.6: {'own': 6, 'mix': 12} and {'mix': 13, 'own': 7}."""
    assert list(WithMixin(own=6, mix=12).hparams.items()) == [("own", 6), ("mix", 12)]
    assert list(WithSavingMixin(own=7).hparams.items()) == [("mix", 13), ("own", 7)]


@dataclasses.dataclass(eq=False)
class DataclassModule(ember.TrainModule):
    lr: float = 0.1
    width: int = 8
    extra: int = dataclasses.field(default=0, init=False)

    def __post_init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()


class NotNamedSelf(ember.TrainModule):
    def __init__(obj, p: int = 1, q: str = "x") -> None:  # noqa: N805
        super().__init__()
        obj.save_hyperparameters()


def test_a_dataclass_module_and_an_init_whose_first_argument_is_not_self():
    """Lightning 2.6.6: {'lr': 0.5, 'width': 8} (the init fields only) and {'p': 2, 'q': 'x'}."""
    assert dict(DataclassModule(lr=0.5).hparams) == {"lr": 0.5, "width": 8}
    assert dict(NotNamedSelf(p=2).hparams) == {"p": 2, "q": "x"}


class Reassigned(ember.TrainModule):
    def __init__(self, lr: float = 0.1) -> None:
        lr = lr * 2
        super().__init__()
        self._later()

    def _later(self) -> None:
        self.save_hyperparameters()


class CalledLater(ember.TrainModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()


def test_value_at_the_call_through_a_helper_and_outside_init():
    """Lightning 2.6.6: a reassigned argument is saved with its value at the call ({'lr': 0.2}), a helper
    method called from __init__ still finds it, and a call outside __init__ saves nothing ({})."""
    assert dict(Reassigned().hparams) == {"lr": 0.2}
    m = CalledLater()
    m.save_hyperparameters()
    assert dict(m.hparams) == {}


class Child(ember.TrainModule):
    def __init__(self, c: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()


class Parent(ember.TrainModule):
    def __init__(self, p: int = 2) -> None:
        super().__init__()
        self.child = Child(c=5)
        self.save_hyperparameters()


class ExplicitBase(ember.TrainModule):
    def __init__(self, a: int = 1) -> None:
        ember.TrainModule.__init__(self)
        self.save_hyperparameters()


class ExplicitSub(ExplicitBase):
    def __init__(self, s: int = 1) -> None:
        ExplicitBase.__init__(self, a=7)


def test_where_ember_deliberately_differs_from_lightning():
    """Lightning 2.6.6 finds __init__ frames by their ``super()`` call: a module built inside another's
    __init__ gets its parent's arguments too ({'c': 5, 'p': 3}), and an __init__ calling
    ``Base.__init__(self)`` is skipped ({} and {'a': 7}). ember follows the object being built."""
    m = Parent(p=3)
    assert dict(m.child.hparams) == {"c": 5}
    assert dict(m.hparams) == {"p": 3}
    assert dict(ExplicitBase(a=2).hparams) == {"a": 2}
    assert dict(ExplicitSub(s=9).hparams) == {"a": 7, "s": 9}


# ---------------------------------------------------------------------- a second call, names, dicts
class IgnoringSub(Base):
    def __init__(self, net: torch.nn.Module | None = None, c: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters(ignore="net")


class NamingSub(Base):
    def __init__(self, c: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters("c")


def test_a_second_call_updates_and_its_ignore_removes_what_the_first_saved():
    """Lightning 2.6.6: {'a': 9, 'b': 2, 'c': 3} in both cases; the base class's call warned about the
    nn.Module it saw, the subclass's ignore= removed it."""
    with pytest.warns(UserWarning, match=r"'net' is an nn.Module.*ignore=\['net'\]"):
        m = IgnoringSub(net=torch.nn.Linear(1, 1), a=9)
    assert dict(m.hparams) == {"a": 9, "b": 2, "c": 3}
    assert dict(m.hparams_initial) == {"a": 9, "b": 2, "c": 3}
    assert dict(NamingSub(a=9).hparams) == {"a": 9, "b": 2, "c": 3}


class FromConfig(ember.TrainModule):
    def __init__(self, cfg: Any, other: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters(cfg)


class LiteralDict(ember.TrainModule):
    def __init__(self, a: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters({"k": 1})


class EmptyDict(ember.TrainModule):
    def __init__(self, a: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters({})


def test_a_dict_or_namespace_argument():
    """Lightning 2.6.6: {'lr': 0.1, 'n': 3} for a dict and for a Namespace (an AttributeDict either way);
    a dict literal is saved as given; an empty one saves nothing."""
    assert dict(FromConfig({"lr": 0.1, "n": 3}).hparams) == {"lr": 0.1, "n": 3}
    m = FromConfig(Namespace(lr=0.2, n=4))
    assert dict(m.hparams) == {"lr": 0.2, "n": 4} and m.hparams.lr == 0.2
    assert dict(LiteralDict().hparams) == {"k": 1}
    assert dict(EmptyDict().hparams) == {}


class Saves(ember.TrainModule):
    def __init__(self, a: int = 1, what: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters(what) if not isinstance(what, tuple) else self.save_hyperparameters(*what)


@pytest.mark.parametrize(
    "what, error, match",
    [
        (5, ValueError, r"got the value 5: pass argument names as strings, or one dict / Namespace"),
        (("zz",), KeyError, r"\['zz'\] are not arguments of Saves.__init__ \(its arguments: \['a', 'what'\]\)"),
        (({"a": 1}, {"b": 2}), ValueError, r"argument names or one dict / Namespace; got 2 objects"),
        (([1],), ValueError, r"cannot save a list: pass argument names, or one dict"),
    ],
)
def test_wrong_arguments_say_what_to_pass(what, error, match):
    """Lightning 2.6.6 raises ValueError for a primitive and KeyError('zz') for an unknown name."""
    with pytest.raises(error, match=match):
        Saves(what=what)


class Locked(ember.TrainModule):
    def __init__(self, lock: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_a_value_that_cannot_be_copied_names_itself():
    """Lightning 2.6.6 raises ``TypeError: cannot pickle '_thread.lock' object`` from save_hyperparameters."""
    with pytest.raises(
        TypeError,
        match=r"could not copy the hyper-parameter\(s\) \['lock'\] of Locked.*"
        r"save_hyperparameters\(ignore=\['lock'\]\)",
    ):
        Locked(lock=threading.Lock())


class WithFunction(ember.TrainModule):
    def __init__(self, lr: float = 0.1, fn: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_unpicklable_values_are_dropped_with_a_warning():
    """Lightning 2.6.6, at the start of a fit: ``Attribute 'fn' removed from hparams because it cannot be
    pickled``; hparams is then ['lr'] while hparams_initial keeps ['fn', 'lr']."""
    m = WithFunction(fn=lambda x: x)
    with pytest.warns(
        UserWarning,
        match=r"'fn' was removed from hparams because it cannot be pickled.*"
        r"ignore=\['fn'\]",
    ):
        assert drop_unpicklable(m.hparams) == ["fn"]
    assert sorted(m.hparams) == ["lr"]
    assert sorted(m.hparams_initial) == ["fn", "lr"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert drop_unpicklable(m.hparams) == []


# ---------------------------------------------------------------------- DataModule
class HPData(ember.DataModule):
    def __init__(self, bs: int = 4, root: str = "x") -> None:
        super().__init__()
        self.save_hyperparameters()


class NoSuperData(ember.DataModule):
    def __init__(self, bs: int = 4) -> None:  # no super().__init__(): hparams still work
        self.save_hyperparameters()


def test_datamodule_hparams():
    """Lightning 2.6.6: {'bs': 8, 'root': 'x'}."""
    dm = HPData(bs=8)
    assert dict(dm.hparams) == {"bs": 8, "root": "x"} and dm.hparams.bs == 8
    dm.hparams.bs = 1
    assert dict(dm.hparams_initial) == {"bs": 8, "root": "x"}
    assert dict(NoSuperData(bs=2).hparams) == {"bs": 2}
    assert dict(ember.DataModule().hparams) == {} and dict(ember.DataModule().hparams_initial) == {}


# ---------------------------------------------------------------------- load_from_checkpoint
class Saved(BoringModel):
    def __init__(self, lr: float = 0.1, width: int = 3) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


class SavedKwargs(BoringModel):
    def __init__(self, lr: float = 0.1, **kwargs: Any) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


class SavedConfig(BoringModel):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(lr=cfg["lr"])
        self.save_hyperparameters(cfg)


def _checkpoint(module: ember.TrainModule, path: Any) -> str:
    trainer = fast_trainer(max_steps=1)
    trainer.fit(module, regression_loader())
    trainer.save_checkpoint(str(path))
    return str(path)


def test_load_from_checkpoint_overrides_and_unknown_keys(tmp_path):
    """Lightning 2.6.6: {'lr': 0.5, 'width': 3}; width=7 overrides; unknown=1 is not passed to __init__ and
    not in hparams; a value set in hparams after __init__ (newkey) is saved but not passed back."""
    m = Saved(lr=0.5)
    m.hparams.newkey = 4
    path = _checkpoint(m, tmp_path / "a.ckpt")
    loaded = Saved.load_from_checkpoint(path)
    assert isinstance(loaded, Saved) and dict(loaded.hparams) == {"lr": 0.5, "width": 3}
    assert torch.equal(loaded.layer.weight, m.layer.weight)
    assert dict(Saved.load_from_checkpoint(path, width=7).hparams) == {"lr": 0.5, "width": 7}
    with pytest.warns(
        UserWarning,
        match=r"Saved.__init__ takes no argument named \['unknown'\] "
        r"\(its arguments: \['lr', 'width'\]\); ignored",
    ):
        loaded = Saved.load_from_checkpoint(path, unknown=1)
    assert dict(loaded.hparams) == {"lr": 0.5, "width": 3}


def test_load_from_checkpoint_with_kwargs_passes_everything(tmp_path):
    """Lightning 2.6.6: {'lr': 0.5, 'z': 1, 'unknown': 2} for an __init__ that takes **kwargs."""
    path = _checkpoint(SavedKwargs(lr=0.5, z=1), tmp_path / "b.ckpt")
    assert dict(SavedKwargs.load_from_checkpoint(path, unknown=2).hparams) == {"lr": 0.5, "z": 1, "unknown": 2}


def test_load_from_checkpoint_without_saved_arguments_explains(tmp_path):
    """Lightning 2.6.6 raises TypeError (missing 'n'); passing n=3 works."""

    class NoSave(BoringModel):
        def __init__(self, n: int) -> None:
            super().__init__()

    path = _checkpoint(NoSave(3), tmp_path / "d.ckpt")
    with pytest.raises(
        CheckpointError,
        match=r"Could not build NoSave.*missing 1 required positional argument: "
        r"'n'.*Pass the missing arguments as keyword overrides",
    ):
        NoSave.load_from_checkpoint(path)
    assert isinstance(NoSave.load_from_checkpoint(path, n=3), NoSave)


def test_load_from_checkpoint_runs_configure_model_and_on_load_checkpoint_first(tmp_path):
    """As Lightning's _load_state: configure_model (layers made there), then on_load_checkpoint, which may
    rewrite the state_dict, then the weights."""

    class Lazy(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            del self.layer
            self.calls: list[str] = []

        def configure_model(self) -> None:
            self.calls.append("configure_model")
            if not hasattr(self, "lazy"):
                self.lazy = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lazy(x)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.calls.append("on_load_checkpoint")
            checkpoint["state_dict"] = {k.replace("renamed.", "lazy."): v for k, v in checkpoint["state_dict"].items()}

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["state_dict"] = {k.replace("lazy.", "renamed."): v for k, v in checkpoint["state_dict"].items()}

    m = Lazy()
    path = _checkpoint(m, tmp_path / "e.ckpt")
    loaded = Lazy.load_from_checkpoint(path)
    assert loaded.calls == ["configure_model", "on_load_checkpoint"]
    assert torch.equal(loaded.lazy.weight, m.lazy.weight)


def test_load_from_checkpoint_passes_a_saved_dict_as_its_argument(tmp_path):
    """Lightning 2.6.6 records ``hparams_name: 'cfg'`` for ``save_hyperparameters(cfg)`` and loads with
    cfg={'lr': 0.3}; an override lr=0.9 goes into cfg ({'lr': 0.9})."""
    m = SavedConfig({"lr": 0.3})
    assert m._hparams_name == "cfg"
    path = _checkpoint(m, tmp_path / "c.ckpt")
    assert torch.load(path, weights_only=True)["hparams_name"] == "cfg"  # written by the Trainer's checkpoint
    assert dict(SavedConfig.load_from_checkpoint(path).hparams) == {"lr": 0.3}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # lr is not an argument of __init__, but it went into cfg
        loaded = SavedConfig.load_from_checkpoint(path, lr=0.9)
    assert dict(loaded.hparams) == {"lr": 0.9} and loaded.lr == 0.9


class _HparamsLogger(ember.loggers.Logger):
    def __init__(self) -> None:
        super().__init__()
        self.params: list[dict[str, Any]] = []

    def log_hyperparams(self, params: Any = None, metrics: Any = None, step: Any = None) -> None:
        self.params.append(dict(params or {}))


class _Tunable(ember.TrainModule):
    def __init__(self, lr: float = 0.1, log_them: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters(logger=log_them)
        self.hparams.lr = 0.5  # changed after __init__: the loggers still get the value given (hparams_initial)
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class _DataWithLr(ember.DataModule):
    def __init__(self, lr: float = 0.3) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        return regression_loader()


def _fit_with_logger(module: ember.TrainModule, datamodule: Any = None) -> _HparamsLogger:
    logger = _HparamsLogger()
    trainer = ember.Trainer(
        max_steps=1,
        logger=logger,
        enable_progress_bar=False,
        enable_checkpointing=False,
        accelerator="cpu",
        log_every_n_steps=1,
    )
    if datamodule is None:
        trainer.fit(module, regression_loader())
    else:
        trainer.fit(module, datamodule=datamodule)
    return logger


def test_loggers_get_the_initial_hyperparameters_of_sources_that_ask():
    """Lightning 2.6.6 (CSVLogger): hparams.yaml holds lr: 0.1 although hparams.lr was changed to 0.5 in
    __init__; with save_hyperparameters(logger=False) nothing is logged; a key the module and the datamodule
    save with different values raises 'Error while merging hparams'."""
    assert _fit_with_logger(_Tunable()).params == [{"lr": 0.1, "log_them": True}]
    assert _fit_with_logger(_Tunable(log_them=False)).params == []
    with pytest.raises(RuntimeError, match=r"\['lr'\] are saved by both _Tunable and _DataWithLr"):
        _fit_with_logger(_Tunable(), _DataWithLr())


def test_a_fit_drops_unpicklable_hyperparameters_when_it_starts():
    class Fits(WithFunction):
        def __init__(self, lr: float = 0.1, fn: Any = None) -> None:
            super().__init__(lr, fn)
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    m = Fits(fn=lambda x: x)
    assert sorted(m.hparams) == ["fn", "lr"]
    with pytest.warns(UserWarning, match="'fn' was removed from hparams"):
        fast_trainer(max_steps=1).fit(m, regression_loader())
    assert sorted(m.hparams) == ["lr"] and sorted(m.hparams_initial) == ["fn", "lr"]


class _ConfigData(ember.DataModule):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.save_hyperparameters(cfg)
        self.restored: Any = None

    def train_dataloader(self):
        return regression_loader()

    def state_dict(self):
        return {"seen": 3}

    def load_state_dict(self, state):
        self.restored = state


class _PlainData(HPData):
    def train_dataloader(self):
        return regression_loader()


@pytest.mark.parametrize("data_cls, args", [("_PlainData", {"bs": 8}), ("_ConfigData", {"cfg": {"bs": 8}})])
def test_a_datamodule_rebuilds_from_the_checkpoint_of_its_fit(tmp_path, data_cls, args):
    """As Lightning: the checkpoint holds the datamodule's saved hyper-parameters, which
    DataModule.load_from_checkpoint passes back (overrides win), and its state_dict."""
    cls = globals()[data_cls]
    dm = cls(**args)
    trainer = fast_trainer(max_steps=1)
    trainer.fit(BoringModel(), datamodule=dm)
    trainer.save_checkpoint(str(tmp_path / "dm.ckpt"))
    ckpt = torch.load(tmp_path / "dm.ckpt", weights_only=True)
    assert ckpt["datamodule_hyper_parameters"]["bs"] == 8 and "hyper_parameters" in ckpt
    loaded = cls.load_from_checkpoint(str(tmp_path / "dm.ckpt"), weights_only=True)
    assert isinstance(loaded, cls) and loaded.hparams.bs == 8
    assert cls.load_from_checkpoint(str(tmp_path / "dm.ckpt"), bs=2).hparams.bs == 2
    if cls is _ConfigData:
        assert loaded.restored == {"seen": 3}


def test_load_from_checkpoint_takes_weights_only_as_its_own_argument(tmp_path):
    """Lightning's weights_only is load_from_checkpoint's argument, never a constructor override."""
    path = _checkpoint(SavedKwargs(lr=0.5), tmp_path / "w.ckpt")
    for weights_only in (None, True, False):
        assert dict(SavedKwargs.load_from_checkpoint(path, weights_only=weights_only).hparams) == {"lr": 0.5}
