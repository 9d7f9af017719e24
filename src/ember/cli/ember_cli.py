"""``EmberCLI``: builds the module, the datamodule and the Trainer from the command line and config files,
and runs the subcommand (the package docstring, ``ember/cli/__init__.py``, shows its use).

What happens, in order, each step a method a subclass may override (Lightning's ``LightningCLI`` order):
``setup_parser`` (``init_parser`` for the main parser and one per entry of ``subcommands()``, each given
``add_default_arguments_to_parser``, ``add_core_arguments_to_parser``, ``add_arguments_to_parser`` and the
optimizer groups, linked by ``link_optimizers_and_lr_schedulers``), ``parse_arguments``, the seed,
``before_instantiate_classes``, ``instantiate_classes`` (the module and datamodule, the optimizer the
config chose given to the module, ``instantiate_trainer``), ``after_instantiate_classes``, then the
subcommand: ``before_<subcommand>``, the CLI's own ``<subcommand>`` method if a subclass defines one (else
the Trainer's), called with ``model=``, ``datamodule=`` and the subcommand's options, and ``after_<subcommand>``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import random
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Optional, Union

from torch.optim import Optimizer

from ember.callbacks.callback import Callback
from ember.checkpoint.reading import load
from ember.cli.optimizers import (
    AUTOMATIC,
    LRSchedulerTypeTuple,
    LRSchedulerTypeUnion,
    ReduceLROnPlateau,
    automatic_keys,
    class_spec,
    give_module,
)
from ember.cli.save_config import RESUME_KEYS, SaveConfigCallback
from ember.data import DataModule
from ember.module import TrainModule
from ember.rng import seed_everything
from ember.trainer.trainer import Trainer
from ember.user_frames import user_stacklevel
from ember.utilities.rank_zero import rank_zero_warn
from ember.version import __version__

_UNUSABLE: ImportError | None = None  # why EmberCLI cannot run here, raised when it is used
try:
    from jsonargparse import ActionConfigFile, Namespace, class_from_function

    from ember.cli.parser import EmberArgumentParser
except ImportError as err:
    _UNUSABLE = err
    if not TYPE_CHECKING:
        Namespace = argparse.Namespace  # (jsonargparse's is one: ``ArgsType`` reads the same without it)

        class EmberArgumentParser:
            """Stands for the parser where jsonargparse is not installed: building one says what to install."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                _require_jsonargparse()


__all__ = ["ArgsType", "EmberCLI"]

#: What ``args=`` takes: command-line words, or a config as a dict or a jsonargparse ``Namespace``.
ArgsType = Optional[Union[list[str], dict[str, Any], Namespace]]  # noqa: UP007, UP045  (Lightning's alias)

#: ``--help`` lines of the Trainer's entry points (a subcommand a subclass adds: its method's first line).
_DESCRIPTIONS = {
    "fit": "Train a model.",
    "validate": "Run validation once.",
    "test": "Run the test set once.",
    "predict": "Run prediction.",
}


def _require_jsonargparse() -> None:
    if isinstance(_UNUSABLE, ModuleNotFoundError) and (_UNUSABLE.name or "").startswith("jsonargparse"):
        raise ImportError("EmberCLI needs jsonargparse: pip install 'ember[cli]' (or jsonargparse[signatures]).")
    if _UNUSABLE is not None:
        raise _UNUSABLE


class EmberCLI:
    """Builds the module, the datamodule and the Trainer from the command line and config files, and
    runs the subcommand.

    Args:
        model_class: the TrainModule class, or a function returning one (its parameters are the options;
            its return annotation names the class). None: any TrainModule, named by ``--model``.
        datamodule_class: the DataModule class or a function returning one. None: any DataModule, named by
            ``--data``, or none (the module provides its loaders).
        save_config_callback: saves the resolved config beside the run's logs (None: not saved).
        save_config_kwargs: arguments of ``save_config_callback`` (``config_filename``, ``overwrite``,
            ``multifile``, ``save_to_log_dir``).
        trainer_class: the Trainer class, or a function returning a Trainer.
        trainer_defaults: defaults for ``--trainer.*`` (the command line and configs override them);
            ``callbacks`` here are always added, and are not options.
        seed_everything_default: the ``--seed_everything`` default: an int, True or False (no seeding). True
            takes the seed in ``EMBER_GLOBAL_SEED`` (``seed_everything`` sets it, and a launcher passes it to the
            ranks it starts), or else draws one; either is written into the saved config, so the run can be
            repeated.
        parser_kwargs: arguments of the main parser (``env_prefix``, ``default_env``...); under a
            subcommand's name (``{"fit": {"default_config_files": [...]}}``), of that subcommand's parser.
        parser_class: the parser class (a subclass of ``EmberArgumentParser``).
        subclass_mode_model, subclass_mode_data: accept any subclass of the given class, named in the config.
        args: what to parse instead of ``sys.argv[1:]``: command-line words, or a config as a dict or Namespace.
        run: parse a subcommand and run it; False: no subcommands, only build the objects.
        auto_configure_optimizers: add ``--optimizer`` and ``--lr_scheduler`` (unless ``add_arguments_to_parser``
            added such groups); when the config names an optimizer, the module's ``configure_optimizers``
            returns it (see ``configure_optimizers``).
        load_from_checkpoint_support: accepted for Lightning's signature. ember's checkpoints hold the module's
            constructor arguments, from which ``load_from_checkpoint`` rebuilds it; this flag changes nothing.
    """

    def __init__(
        self,
        model_class: type[TrainModule] | Callable[..., TrainModule] | None = None,
        datamodule_class: type[DataModule] | Callable[..., DataModule] | None = None,
        save_config_callback: type[SaveConfigCallback] | None = SaveConfigCallback,
        save_config_kwargs: dict[str, Any] | None = None,
        trainer_class: type[Trainer] | Callable[..., Trainer] = Trainer,
        trainer_defaults: dict[str, Any] | None = None,
        seed_everything_default: bool | int = True,
        parser_kwargs: dict[str, Any] | None = None,
        parser_class: type[EmberArgumentParser] = EmberArgumentParser,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: ArgsType = None,
        run: bool = True,
        auto_configure_optimizers: bool = True,
        load_from_checkpoint_support: bool = True,
    ) -> None:
        _require_jsonargparse()
        self.model_class, self.datamodule_class, self.trainer_class = model_class, datamodule_class, trainer_class
        self.save_config_callback, self.save_config_kwargs = save_config_callback, dict(save_config_kwargs or {})
        self.trainer_defaults = dict(trainer_defaults or {})
        self.seed_everything_default = seed_everything_default
        self.parser_kwargs, self.parser_class = dict(parser_kwargs or {}), parser_class
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data
        self.auto_configure_optimizers = auto_configure_optimizers
        self.load_from_checkpoint_support = load_from_checkpoint_support
        self._seed_drawn = False

        names = self.subcommands()
        main_kwargs = {k: v for k, v in self.parser_kwargs.items() if k not in names}
        subcommand_kwargs = {k: v for k, v in self.parser_kwargs.items() if k in names}
        self.setup_parser(run, main_kwargs, subcommand_kwargs)
        self.parse_arguments(self.parser, args)
        self._parse_ckpt_path()
        self.subcommand: str | None = self.config["subcommand"] if run else None
        self._set_seed()
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    # ------------------------------------------------------------------ the parsers
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The subcommands, each a Trainer method, with the method's arguments the CLI fills itself (the
        module and the data), which are therefore not options. Override to add or remove subcommands."""
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
            "test": {"model", "dataloaders", "datamodule"},
            "predict": {"model", "dataloaders", "datamodule"},
        }

    def init_parser(self, **kwargs: Any) -> EmberArgumentParser:
        """A new parser of ``parser_class`` (with ``kwargs``), taking ``--config``; called for the main parser
        and for each subcommand's."""
        kwargs.setdefault("dump_header", [f"ember=={__version__}"])
        parser = self.parser_class(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile, help="A YAML config file (may repeat).")
        return parser

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        """Build ``self.parser``: with ``add_subcommands``, one parser per subcommand under it (in
        ``self.subparsers``), else the arguments on the main parser itself."""
        self.parser = self.init_parser(**main_kwargs)
        self.subparsers: dict[str, EmberArgumentParser] = {}
        self._method_arguments: dict[str, list[str]] = {}
        if not add_subcommands:
            self._add_arguments(self.parser)
            return
        subcommands = self.parser.add_subcommands(required=True, dest="subcommand")
        trainer_class: Any = self.trainer_class
        if not isinstance(trainer_class, type):
            trainer_class = class_from_function(trainer_class)
        for name, filled in self.subcommands().items():
            kwargs = dict(subparser_kwargs.get(name, {}))
            description = _DESCRIPTIONS.get(name) or _first_line(getattr(trainer_class, name))
            kwargs.setdefault("description", description)
            parser = self.init_parser(**kwargs)
            self._add_arguments(parser)
            # (``module`` is ember's keyword-only alias of ``model``: filled too, never an option)
            added = parser.add_method_arguments(trainer_class, name, skip=set(filled) | {"module"})
            self._method_arguments[name] = added
            subcommands.add_subcommand(name, parser, help=description)
            self.subparsers[name] = parser

    def _add_arguments(self, parser: EmberArgumentParser) -> None:
        self.add_default_arguments_to_parser(parser)
        self.add_core_arguments_to_parser(parser)
        self.add_arguments_to_parser(parser)
        if self.auto_configure_optimizers:
            if not parser.optimizers:  # (add_arguments_to_parser may have added its own)
                parser.add_optimizer_args((Optimizer,))
            if not parser.lr_schedulers:
                parser.add_lr_scheduler_args(LRSchedulerTypeTuple)
        self.link_optimizers_and_lr_schedulers(parser)

    def add_default_arguments_to_parser(self, parser: EmberArgumentParser) -> None:
        """Add the arguments of the CLI itself: ``--seed_everything``."""
        parser.add_argument(
            "--seed_everything",
            type=bool | int,
            default=self.seed_everything_default,
            help="A seed for every RNG; true: a random one (saved in the config); false: none.",
        )

    def add_core_arguments_to_parser(self, parser: EmberArgumentParser) -> None:
        """Add the arguments of the Trainer (``--trainer.*``, with ``trainer_defaults``), the module
        (``--model``) and the datamodule (``--data``)."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        defaults = {f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"}
        if defaults:
            parser.set_defaults(defaults)
        parser.add_lightning_class_args(
            self.model_class or TrainModule, "model", subclass_mode=self.subclass_mode_model
        )
        parser.add_lightning_class_args(
            self.datamodule_class or DataModule,
            "data",
            subclass_mode=self.subclass_mode_data,
            required=self.datamodule_class is not None,  # (without one, the module may provide its loaders)
        )

    def add_arguments_to_parser(self, parser: EmberArgumentParser) -> None:
        """Override to add arguments or links (``parser.link_arguments("data.num_classes", "model.num_classes")``)."""

    @staticmethod
    def link_optimizers_and_lr_schedulers(parser: EmberArgumentParser) -> None:
        """Link each optimizer and scheduler group added with a ``link_to`` key to that key: it receives the
        group's class and arguments (type the target parameter ``OptimizerCallable`` / ``LRSchedulerCallable``)."""
        for key, (classes, link_to) in {**parser.optimizers, **parser.lr_schedulers}.items():
            if link_to == AUTOMATIC:
                continue
            if isinstance(classes, tuple):  # (the group's value names its class already)
                parser.link_arguments(key, link_to)
            else:
                parser.link_arguments(key, link_to, compute_fn=functools.partial(class_spec, classes))

    def parse_arguments(self, parser: EmberArgumentParser, args: ArgsType) -> None:
        """Parse ``args`` (``sys.argv[1:]`` when None) into ``self.config``."""
        if args is not None and len(sys.argv) > 1:
            rank_zero_warn(
                f"{type(self).__name__} was given both args= and command-line arguments ({sys.argv[1:]}), and parses "
                "only args. Pass one or the other.",
                stacklevel=user_stacklevel() + 3,
            )
        if isinstance(args, (dict, Namespace)):
            self.config = parser.parse_object(args)
        else:
            self.config = parser.parse_args(args)

    def _parse_ckpt_path(self) -> None:
        """As Lightning: a subcommand's ``--ckpt_path`` file gives the model's arguments, from the hyper-parameters
        saved in it (they win over the config's; ``--ckpt_path last`` and other names are not files: nothing)."""
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not path or not os.path.isfile(path):
            return
        hparams = dict(load(path, map_location="cpu", lightning=True).get("hyper_parameters") or {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        model: dict[str, Any] = hparams
        current = self.config[subcommand].get("model")
        if self.subclass_mode_model and current is not None and current.get("class_path"):
            model = {"class_path": current["class_path"], "init_args": hparams}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": model}}, self.config)
        except SystemExit:
            sys.stderr.write(
                f"The hyper-parameters saved in --ckpt_path {path} do not fit the model's arguments (above); "
                "pass a checkpoint of this model.\n"
            )
            raise

    # ------------------------------------------------------------------ the objects
    def _set_seed(self) -> None:
        section = self._section(self.config)
        seed = section.get("seed_everything")
        if seed is False:
            return
        if seed is True:
            # The process's seed if one was set: in a rank that ember's launcher started, the job's.
            passed_on = os.environ.get("EMBER_GLOBAL_SEED")
            seed = int(passed_on) if passed_on is not None else random.randint(0, 2**31 - 1)
            self._seed_drawn = True
        # Saved in the config: the run can be repeated exactly.
        section["seed_everything"] = seed_everything(seed, workers=True)

    def before_instantiate_classes(self) -> None:
        """Override to act on ``self.config`` before anything is built."""

    def instantiate_classes(self) -> None:
        """Build the classes of ``self.config`` (``self.config_init``): ``self.model``, ``self.datamodule`` and
        ``self.trainer``; the optimizer the config chose (if any) goes to the module."""
        self.config_init = self.parser.instantiate_classes(self.config)
        self.datamodule: DataModule | None = self._get(self.config_init, "data")
        self.model: TrainModule = self._get(self.config_init, "model")
        self._add_configure_optimizers_method_to_model(self.subcommand)
        self.trainer = self.instantiate_trainer()

    def after_instantiate_classes(self) -> None:
        """Override to act on the objects built, before the subcommand runs."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer from its parsed arguments (callbacks and loggers built), ``kwargs`` overriding them, with
        the callbacks of ``add_lightning_class_args``, of ``trainer_defaults`` and the config-saving one added."""
        parser = self._parser(self.subcommand)
        callbacks = [self._get(self.config_init, key) for key in parser.callback_keys]
        section = self._get(self.config_init, "trainer", default={})
        config = {**(vars(section) if isinstance(section, argparse.Namespace) else dict(section)), **kwargs}
        return self._instantiate_trainer(config, callbacks)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        if "callbacks" not in config:
            rank_zero_warn(
                f"{getattr(self.trainer_class, '__qualname__', self.trainer_class)} takes no `callbacks` argument: "
                "the CLI's callbacks (the config-saving one included) are left out.",
                stacklevel=user_stacklevel() + 3,
            )
            return self.trainer_class(**config)
        given = config["callbacks"]
        every = [] if given is None else [given] if isinstance(given, Callback) else list(given)
        every.extend(callbacks)
        always = self.trainer_defaults.get("callbacks")
        if always is not None:
            every.extend(always if isinstance(always, list) else [always])
        if self.save_config_callback is not None and not config.get("fast_dev_run", False):
            every.append(self._config_callback())
        config["callbacks"] = every
        return self.trainer_class(**config)

    def _config_callback(self) -> SaveConfigCallback:
        assert self.save_config_callback is not None  # (checked by the caller)
        kwargs = dict(self.save_config_kwargs)
        takes = inspect.signature(self.save_config_callback).parameters
        if self._seed_drawn and ("ignore_on_resume" in takes or any(p.kind is p.VAR_KEYWORD for p in takes.values())):
            # A seed drawn for this process does not make a resumed fit another run.
            kwargs.setdefault("ignore_on_resume", (*RESUME_KEYS, "seed_everything"))
        return self.save_config_callback(self._parser(self.subcommand), self._section(self.config), **kwargs)

    @staticmethod
    def configure_optimizers(
        lightning_module: TrainModule, optimizer: Optimizer, lr_scheduler: LRSchedulerTypeUnion | None = None
    ) -> Any:
        """What the module's ``configure_optimizers`` returns when the config chose its optimizer (and scheduler).
        Override to return another form.

        Args:
            lightning_module: the module.
            optimizer: the optimizer built on its parameters.
            lr_scheduler: the scheduler built on the optimizer, or None.
        """
        if lr_scheduler is None:
            return optimizer
        if isinstance(lr_scheduler, ReduceLROnPlateau):
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": lr_scheduler, "monitor": lr_scheduler.monitor},
            }
        return [optimizer], [lr_scheduler]

    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        if not self.auto_configure_optimizers:
            return
        parser = self._parser(subcommand)
        optimizer_keys = automatic_keys(parser.optimizers, Optimizer)
        scheduler_keys = automatic_keys(parser.lr_schedulers, LRSchedulerTypeTuple)
        if not optimizer_keys:
            return
        if len(optimizer_keys) > 1 or len(scheduler_keys) > 1:
            raise ValueError(
                f"{type(self).__name__} hands the module one optimizer and one scheduler, but these groups are "
                f"'AUTOMATIC': {optimizer_keys + scheduler_keys}. Give the others a link_to (a module parameter "
                "typed OptimizerCallable / LRSchedulerCallable) and build them in the module's configure_optimizers."
            )
        optimizer = class_spec(parser.optimizers[optimizer_keys[0]][0], self._get(self.config_init, optimizer_keys[0]))
        if optimizer is None:
            return  # (the config chose none: the module's own configure_optimizers stays)
        scheduler = None
        if scheduler_keys:
            classes = parser.lr_schedulers[scheduler_keys[0]][0]
            scheduler = class_spec(classes, self._get(self.config_init, scheduler_keys[0]))
        give_module(type(self).__name__, self.model, optimizer, scheduler, self.configure_optimizers)

    # ------------------------------------------------------------------ the run
    def _run_subcommand(self, subcommand: str) -> None:
        before = getattr(self, f"before_{subcommand}", None)
        if callable(before):
            before()
        # A subclass's own method of the subcommand's name runs instead of the Trainer's.
        method = getattr(self, subcommand, None) or getattr(self.trainer, subcommand)
        section = self.config_init[subcommand]
        kwargs = {k: section[k] for k in self._method_arguments[subcommand] if k in section}
        kwargs["model"] = self.model
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        #: What the subcommand returned (``validate`` / ``test``: one metric dict per loader).
        self.result = method(**kwargs)
        after = getattr(self, f"after_{subcommand}", None)
        if callable(after):
            after()

    # ------------------------------------------------------------------ helpers
    def _parser(self, subcommand: str | None) -> EmberArgumentParser:
        return self.parser if subcommand is None else self.subparsers[subcommand]

    def _section(self, config: Any) -> Any:
        return config if self.subcommand is None else config[self.subcommand]

    def _get(self, config: Any, key: str, default: Any = None) -> Any:
        """``key`` of the running subcommand's part of ``config`` (of ``config`` itself without subcommands)."""
        section = self._section(config)
        return section.get(key, default) if isinstance(section, (argparse.Namespace, Mapping)) else default


def _first_line(method: Any) -> str | None:
    doc = inspect.getdoc(method)
    return doc.split("\n\n")[0].replace("\n", " ").strip() if doc else None
