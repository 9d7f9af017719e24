"""The names ``ember.cli`` holds besides EmberCLI, under Lightning's ``cli`` names: those that need no
jsonargparse (importable without it, in a process where it cannot be imported), ``ReduceLROnPlateau``,
``instantiate_class``, ``is_overridden`` and the re-exported namesakes; and, with jsonargparse, the parser
class and ``instantiate_module``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import ember
import ember.cli
import ember.utilities
from ember.cli import ReduceLROnPlateau, instantiate_class, is_overridden


class Net(ember.TrainModule):
    def __init__(self, hidden: int = 8, extras: dict | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, hidden)

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()


class Outer:
    class Inner:
        def __init__(self, first: int, second: int = 0) -> None:
            self.args = (first, second)


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_ember_cli_imports_without_jsonargparse_and_says_what_to_install_when_used():
    program = textwrap.dedent(
        """
        import sys
        sys.modules["jsonargparse"] = None  # not installed
        import torch
        import ember.cli as cli
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        assert cli.ReduceLROnPlateau(optimizer, monitor="x").monitor == "x"
        assert cli.instantiate_class(optimizer, {"class_path": "torch.optim.lr_scheduler.StepLR",
                                                 "init_args": {"step_size": 2}}).step_size == 2
        for build in (cli.EmberCLI, cli.LightningArgumentParser):
            try:
                build()
            except ImportError as err:
                assert "pip install 'ember[cli]'" in str(err), err
            else:
                raise AssertionError(f"{build} built without jsonargparse")
        try:
            cli.instantiate_module(torch.nn.Linear, {})
        except ImportError as err:
            assert "pip install 'ember[cli]'" in str(err), err
        else:
            raise AssertionError("instantiate_module ran without jsonargparse")
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_the_names_lightnings_cli_module_imports_are_embers_namesakes():
    assert ember.cli.Trainer is ember.Trainer and ember.cli.Callback is ember.Callback
    assert ember.cli.seed_everything is ember.seed_everything
    assert ember.cli.rank_zero_warn is ember.utilities.rank_zero_warn
    assert ember.cli.LightningArgumentParser is ember.cli.EmberArgumentParser


def test_is_overridden_takes_lightnings_arguments_and_finds_the_parent_itself():
    class Quiet(ember.Callback):
        def on_train_start(self, trainer, module) -> None:
            pass

    assert is_overridden("training_step", Net()) and not is_overridden("validation_step", Net())
    assert is_overridden("on_train_start", Quiet()) and not is_overridden("on_train_end", Quiet())
    assert is_overridden(method_name="training_step", instance=Net(), parent=ember.TrainModule)
    assert not is_overridden("training_step", None)
    with pytest.raises(ValueError, match="needs parent="):
        is_overridden("wait", Outer.Inner(1))


def test_reduce_lr_on_plateau_names_its_metric_and_steps_as_torchs():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = ReduceLROnPlateau(optimizer, "val/loss", mode="min", factor=0.5, patience=0)
    assert isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and scheduler.monitor == "val/loss"
    scheduler.step(1.0)
    scheduler.step(2.0)  # worse: halved
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_instantiate_class_builds_what_the_spec_names_with_the_given_arguments_first():
    layer = torch.nn.Linear(2, 1)
    optimizer = instantiate_class(layer.parameters(), {"class_path": "torch.optim.Adam", "init_args": {"lr": 0.2}})
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["lr"] == 0.2
    inner = instantiate_class((1, 2), {"class_path": f"{__name__}.Outer.Inner"})  # a tuple: several arguments
    assert inner.args == (1, 2)
    with pytest.raises(ValueError, match="class_path"):
        instantiate_class(1, {"init_args": {}})
    with pytest.raises(ValueError, match="names nothing that can be imported"):
        instantiate_class(1, {"class_path": "torch.optim.NoSuchOptimizer"})
    with pytest.raises(TypeError, match="cannot be called"):
        instantiate_class(1, {"class_path": "math.pi"})


# ---------------------------------------------------------------------- with jsonargparse
def test_instantiate_module_builds_from_a_config_section_as_the_cli_checks_one():
    pytest.importorskip("jsonargparse")
    from jsonargparse import ArgumentError

    from ember.cli import instantiate_module

    module = instantiate_module(Net, {"hidden": 3})
    assert type(module) is Net and module.hparams.hidden == 3
    module = instantiate_module(ember.TrainModule, {"_class_path": f"{__name__}.Net", "hidden": 2})
    assert type(module) is Net and module.hparams.hidden == 2
    with pytest.raises(ArgumentError, match="names no class to build"):
        instantiate_module(Net, {"extras": {"class_path": "os.system", "init_args": {"command": "true"}}})
    with pytest.raises(ArgumentError, match="hiden"):
        instantiate_module(Net, {"hiden": 3})


def test_the_parser_adds_ember_classes_and_optimizer_groups():
    pytest.importorskip("jsonargparse")
    from ember.cli import EmberArgumentParser, LRSchedulerTypeTuple

    parser = EmberArgumentParser()
    assert parser.env_prefix == "EMBER" and parser.callback_keys == []

    def make_net(width: int = 2) -> Net:
        return Net(hidden=width)

    assert parser.add_lightning_class_args(make_net, "model") == ["model.width"]
    parser.add_lightning_class_args(ember.callbacks.EarlyStopping, "stop")
    parser.add_optimizer_args()
    parser.add_lr_scheduler_args(torch.optim.lr_scheduler.StepLR, link_to="somewhere")
    assert parser.callback_keys == ["stop"]
    assert parser.optimizers == {"optimizer": ((torch.optim.Optimizer,), "AUTOMATIC")}
    assert parser.lr_schedulers == {"lr_scheduler": (torch.optim.lr_scheduler.StepLR, "somewhere")}
    assert LRSchedulerTypeTuple == (torch.optim.lr_scheduler.LRScheduler, ReduceLROnPlateau)
    config = parser.parse_args(
        ["--model.width=3", "--stop.monitor=val/loss", "--optimizer=Adam", "--lr_scheduler.step_size=4"]
    )
    built = parser.instantiate_classes(config)
    assert built.model.hparams.hidden == 3 and built.stop.monitor == "val/loss"
    assert built.optimizer.class_path == "torch.optim.Adam" and built.lr_scheduler.step_size == 4  # not built
    with pytest.raises(TypeError, match="add_lightning_class_args takes a subclass"):
        parser.add_lightning_class_args(torch.nn.Linear, "linear")
    with pytest.raises(TypeError, match="add_optimizer_args takes a subclass"):
        parser.add_optimizer_args(torch.nn.Linear, "other")
    with pytest.raises(TypeError, match="add_lr_scheduler_args takes a subclass"):
        parser.add_lr_scheduler_args(torch.optim.Adam, "other")
