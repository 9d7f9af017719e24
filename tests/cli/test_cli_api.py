"""EmberCLI's steps as Lightning's ``LightningCLI`` has them, each overridden in a subclass: the parsers
(``subcommands``, ``init_parser``, ``setup_parser``, the argument groups, ``parse_arguments``), the
objects (``before_instantiate_classes``, ``instantiate_classes``, ``after_instantiate_classes``,
``instantiate_trainer``), the optimizer a config chooses (``configure_optimizers``,
``link_optimizers_and_lr_schedulers``, ``auto_configure_optimizers``) and the run (a subclass's own
``fit``); and what ``args=``, ``--config``, ``parser_kwargs``, the environment, callables and
``seed_everything`` do."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers.models import regression_loader

pytest.importorskip("jsonargparse")
yaml = pytest.importorskip("yaml")

from jsonargparse import Namespace  # noqa: E402

from ember.cli import EmberCLI, LRSchedulerCallable, OptimizerCallable, ReduceLROnPlateau, SaveConfigCallback  # noqa: E402


class Net(ember.TrainModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Bare(Net):
    """No optimizer of its own: the config chooses it."""

    configure_optimizers = ember.TrainModule.configure_optimizers


class Data(ember.DataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return regression_loader(batch_size=self.batch_size)


class Counter(ember.Callback):
    def __init__(self, every: int = 1) -> None:
        self.every, self.batches = every, 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.batches += 1


def fit_args(root, epochs: int = 1) -> list[str]:
    return [
        "fit",
        f"--trainer.default_root_dir={root}",
        f"--trainer.max_epochs={epochs}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
    ]


# ---------------------------------------------------------------------- the parsers
def test_subcommands_names_the_subcommands_and_the_method_arguments_that_are_not_options(tmp_path, capsys):
    assert EmberCLI.subcommands() == {
        "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
        "validate": {"model", "dataloaders", "datamodule"},
        "test": {"model", "dataloaders", "datamodule"},
        "predict": {"model", "dataloaders", "datamodule"},
    }
    cli = EmberCLI(Net, Data, args=[*fit_args(tmp_path), "--ckpt_path=null"])
    assert set(cli.subparsers) == {"fit", "validate", "test", "predict"} and cli.trainer.global_step == 4

    class FitOnly(EmberCLI):
        @staticmethod
        def subcommands():
            return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule", "ckpt_path"}}

    cli = FitOnly(Net, Data, save_config_callback=None, args=fit_args(tmp_path))
    assert set(cli.subparsers) == {"fit"} and cli.trainer.global_step == 4
    for args in (["validate"], [*fit_args(tmp_path), "--ckpt_path=null"]):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            FitOnly(Net, Data, save_config_callback=None, args=args)
        assert ("validate" if args == ["validate"] else "ckpt_path") in capsys.readouterr().err
    # ember's keyword alias of ``model`` on the Trainer's methods is never an option.
    with pytest.raises(SystemExit):
        EmberCLI(Net, Data, args=["fit", f"--module={__name__}.Net"])


def test_init_parser_builds_every_parser_with_config_and_the_ember_version_in_saved_configs(tmp_path):
    built = []

    class Recording(EmberCLI):
        def init_parser(self, **kwargs):
            parser = super().init_parser(**kwargs)
            parser.add_argument("--run_name", type=str, default="none")
            built.append((kwargs.get("description"), parser))
            return parser

    cli = Recording(Net, Data, args=[*fit_args(tmp_path), "--run_name=first"])
    assert [d for d, _ in built] == [
        None,
        "Train a model.",
        "Run validation once.",
        "Run the test set once.",
        "Run prediction.",
    ]
    assert built[0][1] is cli.parser and [p for _, p in built[1:]] == list(cli.subparsers.values())
    assert cli.config.fit.run_name == "first"
    saved = (tmp_path / "config.yaml").read_text()
    assert saved.startswith(f"# ember=={ember.__version__}\n") and yaml.safe_load(saved)["run_name"] == "first"


def test_setup_parser_gives_parser_kwargs_to_the_main_parser_or_the_subcommand_they_name(tmp_path):
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text("model:\n  hidden: 11\n")
    calls = []

    class Recording(EmberCLI):
        def setup_parser(self, add_subcommands, main_kwargs, subparser_kwargs):
            calls.append((add_subcommands, main_kwargs, subparser_kwargs))
            super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)

    fit_kwargs = {"default_config_files": [str(defaults)]}
    cli = Recording(Net, Data, parser_kwargs={"fit": fit_kwargs, "default_env": False}, args=fit_args(tmp_path / "run"))
    assert calls == [(True, {"default_env": False}, {"fit": fit_kwargs})]
    assert cli.model.hparams.hidden == 11  # fit's parser read the file
    assert cli.subparsers["validate"].get_defaults().model.hidden == 8  # validate's did not
    Recording(Net, run=False, args=[])
    assert calls[-1] == (False, {}, {}) and not hasattr(cli, "nothing")


def test_environment_variables_with_default_env_and_the_ember_prefix(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_FIT__TRAINER__MAX_EPOCHS", "2")
    monkeypatch.setenv("EMBER_FIT__MODEL__HIDDEN", "3")
    monkeypatch.setenv("EMBER_MODEL__HIDDEN", "4")
    assert EmberCLI(Net, run=False, args=[]).model.hparams.hidden == 8  # not read unless asked
    assert EmberCLI(Net, run=False, parser_kwargs={"default_env": True}, args=[]).model.hparams.hidden == 4
    args = ["fit", f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"]
    cli = EmberCLI(Net, Data, save_config_callback=None, parser_kwargs={"default_env": True}, args=args)
    assert cli.model.hparams.hidden == 3 and cli.trainer.current_epoch == 2
    monkeypatch.setenv("MINE_MODEL__HIDDEN", "5")
    cli = EmberCLI(Net, run=False, parser_kwargs={"default_env": True, "env_prefix": "MINE"}, args=[])
    assert cli.model.hparams.hidden == 5


def test_the_default_and_core_argument_groups_can_be_extended(tmp_path):
    class Extended(EmberCLI):
        def add_default_arguments_to_parser(self, parser):
            super().add_default_arguments_to_parser(parser)
            parser.add_argument("--notes", type=str, default="")

        def add_core_arguments_to_parser(self, parser):
            super().add_core_arguments_to_parser(parser)
            parser.add_lightning_class_args(Counter, "counter")  # a callback: the Trainer is given it

    cli = Extended(Net, Data, args=[*fit_args(tmp_path), "--notes=hello", "--counter.every=2", "--seed_everything=5"])
    assert cli.config.fit.notes == "hello" and cli.config.fit.seed_everything == 5
    assert cli.subparsers["fit"].callback_keys == ["counter"]
    (counter,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, Counter)]
    assert counter.every == 2 and counter.batches == 4
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["counter"] == {"every": 2}


def test_parse_arguments_takes_words_a_dict_or_a_namespace_and_warns_about_argv_beside_them(monkeypatch):
    parsed = []

    class Recording(EmberCLI):
        def parse_arguments(self, parser, args):
            parsed.append(args)
            super().parse_arguments(parser, args)

    for args, hidden in (
        (["--model.hidden=4"], 4),
        ({"model": {"hidden": 5}}, 5),
        (Namespace(model=Namespace(hidden=6)), 6),
    ):
        cli = Recording(Net, run=False, args=args)
        assert parsed[-1] is args and cli.model.hparams.hidden == hidden
    monkeypatch.setattr(sys, "argv", ["main.py", "--model.hidden=9"])
    with pytest.warns(UserWarning, match=r"both args= and command-line arguments \(\['--model.hidden=9'\]\)"):
        cli = EmberCLI(Net, run=False, args=["--model.hidden=2"])
    assert cli.model.hparams.hidden == 2


def test_a_config_file_given_before_the_subcommand_holds_each_subcommand_as_a_section(tmp_path):
    main = tmp_path / "main.yaml"
    main.write_text(yaml.safe_dump({"fit": {"model": {"hidden": 3}, "trainer": {"max_epochs": 2}}}))
    root = fit_args(tmp_path)
    cli = EmberCLI(Net, Data, args=["--config", str(main), "fit", root[1], *root[3:]])
    assert cli.model.hparams.hidden == 3 and cli.trainer.current_epoch == 2


# ---------------------------------------------------------------------- the objects
def test_the_instantiation_hooks_run_in_order_and_see_the_config_before_anything_is_built(tmp_path):
    events = []

    class Hooked(EmberCLI):
        def before_instantiate_classes(self):
            events.append(("before", hasattr(self, "model"), self.config.fit.model.hidden))
            self.config.fit.model.hidden = 7  # what it changes is what gets built (and saved)

        def instantiate_classes(self):
            events.append("instantiate")
            super().instantiate_classes()

        def after_instantiate_classes(self):
            events.append(("after", self.model.hparams.hidden, self.trainer.global_step))

        def before_fit(self):
            events.append("before_fit")

        def after_fit(self):
            events.append(("after_fit", self.trainer.global_step))

    cli = Hooked(Net, Data, args=[*fit_args(tmp_path), "--model.hidden=3"])
    assert events == [("before", False, 3), "instantiate", ("after", 7, 0), "before_fit", ("after_fit", 4)]
    assert cli.config_init.fit.model is cli.model and cli.config_init.fit.data is cli.datamodule
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]["hidden"] == 7


def test_instantiate_trainer_takes_overrides_and_adds_the_default_callbacks(tmp_path):
    always = Counter()

    class Longer(EmberCLI):
        def instantiate_trainer(self, **kwargs):
            return super().instantiate_trainer(max_epochs=2, **kwargs)

    cli = Longer(Net, Data, trainer_defaults={"callbacks": [always]}, args=fit_args(tmp_path))
    assert cli.trainer.current_epoch == 2 and always in cli.trainer.callbacks and always.batches == 8
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]["callbacks"] is None  # not an option
    # A fast_dev_run is no run to repeat: its config is not saved.
    cli = EmberCLI(Net, Data, args=[*fit_args(tmp_path / "dev"), "--trainer.fast_dev_run=true"])
    assert cli.trainer.global_step == 1 and not any(isinstance(c, SaveConfigCallback) for c in cli.trainer.callbacks)
    assert not (tmp_path / "dev").exists()


def test_callables_build_the_module_and_the_trainer(tmp_path):
    def make_net(width: int = 6) -> Net:
        return Net(hidden=width)

    def make_trainer(
        max_epochs: int = 1, default_root_dir: str | None = None, callbacks: list[ember.Callback] | None = None
    ) -> ember.Trainer:
        return ember.Trainer(
            max_epochs=max_epochs,
            default_root_dir=default_root_dir,
            callbacks=callbacks,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
        )

    args = ["fit", "--model.width=4", f"--trainer.default_root_dir={tmp_path}", "--trainer.max_epochs=2"]
    cli = EmberCLI(make_net, Data, trainer_class=make_trainer, args=args)
    assert isinstance(cli.model, Net) and cli.model.hparams.hidden == 4 and cli.trainer.current_epoch == 2
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["model"] == {"width": 4}

    def bare_trainer(max_epochs: int = 1) -> ember.Trainer:
        return ember.Trainer(max_epochs=max_epochs, logger=False, enable_progress_bar=False)

    with pytest.warns(UserWarning, match="takes no `callbacks` argument"):
        cli = EmberCLI(make_net, trainer_class=bare_trainer, run=False, args=[])
    assert not any(isinstance(c, SaveConfigCallback) for c in cli.trainer.callbacks)


def test_without_a_model_class_the_config_names_any_module(tmp_path):
    cli = EmberCLI(run=False, args=[f"--model={__name__}.Net", "--model.hidden=4"])
    assert type(cli.model) is Net and cli.model.hparams.hidden == 4 and cli.datamodule is None
    cli = EmberCLI(Net, run=False, args=[f"--data={__name__}.Data", "--data.batch_size=2"])
    assert type(cli.datamodule) is Data and cli.datamodule.batch_size == 2
    with pytest.raises(SystemExit):  # a module is required
        EmberCLI(run=False, args=[])


def test_seed_everything_true_draws_a_seed_or_takes_the_jobs_and_saves_it(tmp_path, monkeypatch):
    monkeypatch.delenv("EMBER_GLOBAL_SEED", raising=False)
    cli = EmberCLI(Net, run=False, args=[])
    seed = cli.config.seed_everything
    assert isinstance(seed, int) and not isinstance(seed, bool)
    assert os.environ["EMBER_GLOBAL_SEED"] == str(seed) and os.environ["EMBER_SEED_WORKERS"] == "1"
    monkeypatch.setenv("EMBER_GLOBAL_SEED", "1234")  # a rank the job's launcher started: the job's seed
    assert EmberCLI(Net, run=False, args=[]).config.seed_everything == 1234
    assert EmberCLI(Net, run=False, args=["--seed_everything=7"]).config.seed_everything == 7
    monkeypatch.delenv("EMBER_GLOBAL_SEED")
    assert EmberCLI(Net, run=False, args=["--seed_everything=false"]).config.seed_everything is False
    assert "EMBER_GLOBAL_SEED" not in os.environ


# ---------------------------------------------------------------------- the optimizer a config chooses
def test_the_config_chooses_the_optimizer_and_scheduler_of_a_module(tmp_path):
    args = [
        *fit_args(tmp_path, epochs=2),
        "--optimizer=torch.optim.Adam",
        "--optimizer.lr=0.05",
        "--lr_scheduler=torch.optim.lr_scheduler.StepLR",
        "--lr_scheduler.step_size=1",
        "--lr_scheduler.gamma=0.5",
    ]
    cli = EmberCLI(Bare, Data, args=args)
    (optimizer,) = cli.trainer.optimizers
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.param_groups[0]["lr"] == pytest.approx(0.0125)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["optimizer"]["class_path"] == "torch.optim.Adam" and saved["lr_scheduler"]["init_args"]["gamma"] == 0.5

    # ember.cli.ReduceLROnPlateau names its metric; the module returns it with the monitor.
    args = ["--optimizer=SGD", "--lr_scheduler=ember.cli.ReduceLROnPlateau", "--lr_scheduler.monitor=train/loss"]
    with pytest.warns(UserWarning, match="Net.configure_optimizers is replaced by EmberCLI.configure_optimizers"):
        cli = EmberCLI(Net, run=False, args=args)
    returned = cli.model.configure_optimizers()
    assert isinstance(returned["optimizer"], torch.optim.SGD)
    assert isinstance(returned["lr_scheduler"]["scheduler"], ReduceLROnPlateau)
    assert returned["lr_scheduler"]["monitor"] == "train/loss"
    assert returned["lr_scheduler"]["scheduler"].optimizer is returned["optimizer"]
    assert {id(p) for p in returned["optimizer"].param_groups[0]["params"]} == {id(p) for p in cli.model.parameters()}
    # None chosen: the module's own stays.
    cli = EmberCLI(Net, run=False, args=[])
    assert cli.model.configure_optimizers.__func__ is Net.configure_optimizers


def test_auto_configure_optimizers_false_adds_no_optimizer_options(capsys):
    cli = EmberCLI(Net, run=False, auto_configure_optimizers=False, load_from_checkpoint_support=False, args=[])
    assert "optimizer" not in cli.config and cli.model.configure_optimizers.__func__ is Net.configure_optimizers
    with pytest.raises(SystemExit):
        EmberCLI(Net, run=False, auto_configure_optimizers=False, args=["--optimizer=Adam"])
    assert "optimizer" in capsys.readouterr().err


def test_configure_optimizers_shapes_what_the_module_returns_and_a_subclass_reshapes_it(tmp_path):
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    assert EmberCLI.configure_optimizers(None, optimizer) is optimizer
    step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    assert EmberCLI.configure_optimizers(None, optimizer, step) == ([optimizer], [step])
    plateau = ReduceLROnPlateau(optimizer, monitor="val/loss")
    assert EmberCLI.configure_optimizers(None, optimizer, plateau) == {
        "optimizer": optimizer,
        "lr_scheduler": {"scheduler": plateau, "monitor": "val/loss"},
    }

    class PerStep(EmberCLI):
        @staticmethod
        def configure_optimizers(lightning_module, optimizer, lr_scheduler=None):
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "interval": "step"}}

    args = [*fit_args(tmp_path), "--optimizer=SGD", "--optimizer.lr=0.8", "--lr_scheduler=StepLR"]
    cli = PerStep(Bare, Data, args=[*args, "--lr_scheduler.step_size=1", "--lr_scheduler.gamma=0.5"])
    assert cli.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.8 * 0.5**4)  # stepped per batch


class Injected(Bare):
    def __init__(self, optimizer: OptimizerCallable = torch.optim.SGD, scheduler: LRSchedulerCallable | None = None):
        super().__init__()
        self.optimizer, self.scheduler = optimizer, scheduler

    def configure_optimizers(self):
        optimizer = self.optimizer(self.parameters())
        return [optimizer], [self.scheduler(optimizer)]


def test_link_optimizers_and_lr_schedulers_links_groups_to_the_module_parameters_they_name(tmp_path):
    class Linked(EmberCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_optimizer_args(torch.optim.Adam, link_to="model.optimizer")
            parser.add_lr_scheduler_args((torch.optim.lr_scheduler.LRScheduler,), link_to="model.scheduler")

    args = ["--optimizer.lr=0.3", "--lr_scheduler=StepLR", "--lr_scheduler.step_size=1", "--lr_scheduler.gamma=0.1"]
    cli = Linked(Injected, Data, args=[*fit_args(tmp_path), *args])
    (optimizer,) = cli.trainer.optimizers
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.param_groups[0]["lr"] == pytest.approx(0.3 * 0.1)
    parser = cli.subparsers["fit"]
    assert parser.optimizers == {"optimizer": (torch.optim.Adam, "model.optimizer")}  # no automatic group beside it
    assert cli.model.configure_optimizers.__func__ is Injected.configure_optimizers  # the module's own

    class Unlinked(Linked):
        @staticmethod
        def link_optimizers_and_lr_schedulers(parser):
            pass  # no links: the module keeps its defaults

    cli = Unlinked(Injected, run=False, args=args)
    optimizer = cli.model.optimizer(cli.model.parameters())
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["lr"] == 1e-3 and cli.model.scheduler is None


# ---------------------------------------------------------------------- the run
def test_a_subclass_method_named_after_the_subcommand_runs_instead_of_the_trainers(tmp_path):
    calls = []

    class OwnFit(EmberCLI):
        def fit(self, model, **kwargs):
            calls.append((model, kwargs))

    cli = OwnFit(Net, Data, save_config_callback=None, args=[*fit_args(tmp_path), "--ckpt_path=last"])
    assert calls == [(cli.model, {"datamodule": cli.datamodule, "ckpt_path": "last", "weights_only": None})]
    assert cli.trainer.global_step == 0  # the Trainer's fit did not run


class Validated(Net):
    def validation_step(self, batch, batch_idx):
        self.log("val/loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def val_dataloader(self):
        return regression_loader()


def test_the_hyper_parameters_saved_in_ckpt_path_give_the_models_arguments(tmp_path):
    trained = Validated(hidden=5, lr=0.05)
    trainer = ember.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, default_root_dir=str(tmp_path))
    trainer.fit(trained, regression_loader())
    path = str(tmp_path / "net.ckpt")
    trainer.save_checkpoint(path)
    # The config says hidden=8 (the default) and lr=0.3: the checkpoint's hidden=5 and lr=0.05 win, so the weights fit.
    args = ["validate", "--model.lr=0.3", f"--ckpt_path={path}", "--trainer.logger=false"]
    cli = EmberCLI(Validated, args=args + ["--trainer.enable_progress_bar=false"], save_config_callback=None)
    assert (cli.model.hparams.hidden, cli.model.hparams.lr) == (5, 0.05)
    cli = EmberCLI(args=[args[0], f"--model={__name__}.Validated", *args[1:]], save_config_callback=None)
    assert type(cli.model) is Validated and cli.model.hparams.hidden == 5  # a module named by the config too
    # Without --ckpt_path the config's arguments stay.
    cli = EmberCLI(
        Validated, args=["validate", "--model.hidden=3", "--trainer.logger=false"], save_config_callback=None
    )
    assert cli.model.hparams.hidden == 3
