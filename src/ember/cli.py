"""``EmberCLI``: run experiments from YAML, in the spirit of Lightning's ``LightningCLI``.

    # main.py
    from ember.cli import EmberCLI
    EmberCLI(MyModule, MyDataModule)

    python main.py fit --config experiment.yaml --trainer.max_epochs 5 --model.lr 0.01
    python main.py fit --print_config > experiment.yaml      # every setting, with its default

Subcommands ``fit``, ``validate``, ``test`` and ``predict`` take ``--trainer.*``, ``--model.*`` and
``--data.*`` from the classes' type hints (jsonargparse reads the ``__init__`` signatures, so a
misspelt key in a YAML file or on the command line is an error naming the keys there are),
``--config`` files (several, later ones overriding), ``--seed_everything`` and the entry point's
own arguments (``--ckpt_path``). ``add_arguments_to_parser`` is where a subclass adds arguments and
links them (``parser.link_arguments("data.num_classes", "model.num_classes")``).

The resolved configuration of each run is saved as ``config.yaml`` in the run's log folder
(``trainer.log_dir``) on global rank zero, so a run can be repeated with ``--config`` that file. A
file already there is not overwritten: the run stops before training and says what to do.

jsonargparse is an optional dependency: ``pip install 'ember[cli]'``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

from ember.callbacks.callback import Callback
from ember.data import DataModule
from ember.module import TrainModule
from ember.seed import seed_everything
from ember.trainer.trainer import Trainer

try:
    from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
except ImportError:  # the error is raised when EmberCLI is used, saying how to install it
    ArgumentParser = None  # type: ignore[assignment, misc]

__all__ = ["EmberCLI", "SaveConfigCallback"]

_SUBCOMMANDS = {
    "fit": "Train a model.",
    "validate": "Run validation once.",
    "test": "Run the test set once.",
    "predict": "Run prediction.",
}
#: Entry-point arguments filled by the CLI itself, not from the command line.
_FILLED = {"module", "model", "train_dataloaders", "val_dataloaders", "dataloaders", "datamodule"}


def _require_jsonargparse() -> None:
    if ArgumentParser is None:
        raise ImportError("EmberCLI needs jsonargparse: pip install 'ember[cli]' (or jsonargparse[signatures]).")


class SaveConfigCallback(Callback):
    """Saves the run's resolved configuration to ``<trainer.log_dir>/<config_filename>`` at setup, on
    global rank zero. An existing file stops the run (``overwrite=True`` replaces it instead).

    Args:
        parser: the parser that read the configuration (it writes it back in the same form).
        config: the resolved configuration.
        config_filename: the file's name in the log folder.
        overwrite: replace an existing file.
    """

    def __init__(self, parser: Any, config: Any, config_filename: str = "config.yaml", overwrite: bool = False) -> None:
        self.parser, self.config = parser, config
        self.config_filename, self.overwrite = config_filename, overwrite
        self.path: str | None = None

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        folder = trainer.log_dir or trainer.default_root_dir
        path = os.path.join(folder, self.config_filename)
        exists = os.path.exists(path) and not self.overwrite
        if trainer.world_size > 1:  # every rank stops, or none: rank zero decides
            exists = trainer.strategy.broadcast(exists, src=0)
        if exists:
            raise RuntimeError(
                f"{path} already exists, and EmberCLI does not overwrite a saved configuration. Use "
                "another log folder (--trainer.default_root_dir, or a logger with a new version), "
                "remove the file, or pass save_config_kwargs={'overwrite': True}."
            )
        if trainer.is_global_zero:
            os.makedirs(folder, exist_ok=True)
            self.parser.save(self.config, path, skip_none=False, overwrite=self.overwrite, skip_validation=True)
            self.path = path


class EmberCLI:
    """Builds the module, the datamodule and the Trainer from the command line and config files, and
    runs the subcommand.

    Args:
        model_class: the TrainModule class (with ``subclass_mode_model``, a base class: the config
            names the class with ``class_path`` and its arguments with ``init_args``).
        datamodule_class: the DataModule class, or None when the module provides its loaders.
        trainer_class: the Trainer class.
        trainer_defaults: defaults for ``--trainer.*`` (the command line and configs override them).
        seed_everything_default: the ``--seed_everything`` default: an int, True (a random seed,
            written into the saved config so the run can be repeated) or False (no seeding).
        save_config_callback: saves the resolved config beside the run's logs (None: not saved).
        save_config_kwargs: arguments of ``save_config_callback`` (``config_filename``, ``overwrite``).
        parser_kwargs: arguments for the parsers (``default_config_files``, ``env_prefix``...).
        subclass_mode_model, subclass_mode_data: accept any subclass of the given class.
        args: the arguments to parse (default: ``sys.argv[1:]``); a list, or a dict like a config.
        run: parse a subcommand and run it; False: no subcommands, only build the objects.
    """

    def __init__(
        self,
        model_class: type[TrainModule] | Callable[..., TrainModule] | None = None,
        datamodule_class: type[DataModule] | Callable[..., DataModule] | None = None,
        trainer_class: type[Trainer] = Trainer,
        trainer_defaults: dict[str, Any] | None = None,
        seed_everything_default: bool | int = True,
        save_config_callback: type[SaveConfigCallback] | None = SaveConfigCallback,
        save_config_kwargs: dict[str, Any] | None = None,
        parser_kwargs: dict[str, Any] | None = None,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: list[str] | dict[str, Any] | None = None,
        run: bool = True,
    ) -> None:
        _require_jsonargparse()
        self.model_class, self.datamodule_class, self.trainer_class = model_class, datamodule_class, trainer_class
        self.trainer_defaults = dict(trainer_defaults or {})
        self.seed_everything_default = seed_everything_default
        self.save_config_callback, self.save_config_kwargs = save_config_callback, dict(save_config_kwargs or {})
        self.parser_kwargs = dict(parser_kwargs or {})
        self.subclass_mode_model, self.subclass_mode_data = subclass_mode_model, subclass_mode_data

        self.parser = self._build_parser(run)
        self.config = self.parser.parse_args(args) if not isinstance(args, dict) else self.parser.parse_object(args)
        self.subcommand: str | None = self.config["subcommand"] if run else None
        self._instantiate()
        if self.subcommand is not None:
            self._run(self.subcommand)

    # ------------------------------------------------------------------ the parser
    def _build_parser(self, run: bool) -> Any:
        main = ArgumentParser(**self.parser_kwargs)
        self.subparsers: dict[str, Any] = {}
        if not run:
            self._add_arguments(main, None)
            return main
        subcommands = main.add_subcommands(required=True, dest="subcommand")
        for name, help_text in _SUBCOMMANDS.items():
            sub = ArgumentParser(description=help_text, **self.parser_kwargs)
            self._add_arguments(sub, name)
            subcommands.add_subcommand(name, sub, help=help_text)
            self.subparsers[name] = sub
        return main

    def _add_arguments(self, parser: Any, subcommand: str | None) -> None:
        parser.add_argument("-c", "--config", action=ActionConfigFile, help="A YAML config file (may repeat).")
        parser.add_argument(
            "--seed_everything",
            type=bool | int,
            default=self.seed_everything_default,
            help="A seed for every RNG; true: a random one (saved in the config); false: none.",
        )
        parser.add_class_arguments(
            self.trainer_class, "trainer", instantiate=False, fail_untyped=False, sub_configs=True
        )
        if self.trainer_defaults:
            parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items()})
        for key, cls, subclass in (
            ("model", self.model_class, self.subclass_mode_model),
            ("data", self.datamodule_class, self.subclass_mode_data),
        ):
            if cls is None:
                continue
            if subclass:
                parser.add_subclass_arguments(cls, key, required=True, fail_untyped=False)
            else:
                parser.add_class_arguments(cls, key, fail_untyped=False, sub_configs=True)
        if subcommand is not None:
            parser.add_method_arguments(self.trainer_class, subcommand, skip=_FILLED)
        self.add_arguments_to_parser(parser)

    def add_arguments_to_parser(self, parser: Any) -> None:
        """Override to add arguments or links (``parser.link_arguments(source, target)``)."""

    # ------------------------------------------------------------------ objects and the run
    def _section(self) -> Any:
        return self.config[self.subcommand] if self.subcommand is not None else self.config

    def _instantiate(self) -> None:
        section = self._section()
        seed = section["seed_everything"]
        if seed is True:
            seed = random.randint(0, 2**31 - 1)
            section["seed_everything"] = seed  # saved in the config: the run can be repeated exactly
        if seed is not False:
            seed_everything(int(seed))
        init = self.parser.instantiate_classes(self.config)
        self.config_init = init
        part = init[self.subcommand] if self.subcommand is not None else init
        self.model: TrainModule | None = part.get("model")
        self.datamodule: DataModule | None = part.get("data")
        self.trainer = self.instantiate_trainer(part["trainer"])

    def instantiate_trainer(self, kwargs: Any) -> Trainer:
        """The Trainer from its parsed arguments (callbacks, loggers and other objects already built),
        with the config-saving callback added."""
        if isinstance(kwargs, Namespace):
            kwargs = {k: kwargs[k] for k in kwargs.keys() if "." not in k}  # (the top-level arguments)
        kwargs = dict(kwargs)
        callbacks = kwargs.get("callbacks") or []
        callbacks = [callbacks] if isinstance(callbacks, Callback) else list(callbacks)
        if self.save_config_callback is not None and self.subcommand is not None:
            callbacks.append(
                self.save_config_callback(
                    self.subparsers[self.subcommand], self.config[self.subcommand], **self.save_config_kwargs
                )
            )
        kwargs["callbacks"] = callbacks
        return self.trainer_class(**kwargs)

    def _run(self, subcommand: str) -> None:
        section = self.config_init[subcommand]
        skip = {"config", "seed_everything", "trainer", "model", "data", "subcommand"}
        method_kwargs = {k: v for k, v in section.items() if k not in skip and "." not in k}
        if self.model is None:
            raise ValueError("EmberCLI was given no model_class: pass the TrainModule class to run a subcommand.")
        getattr(self, f"before_{subcommand}", lambda: None)()
        result = getattr(self.trainer, subcommand)(self.model, datamodule=self.datamodule, **method_kwargs)
        self.result = result
        if subcommand in ("validate", "test") and self.trainer.is_global_zero:  # a CLI user wants to see them
            for i, metrics in enumerate(result or []):
                prefix = f"dataloader {i}: " if len(result) > 1 else ""
                print(prefix + ", ".join(f"{k} {float(v):.4f}" for k, v in metrics.items()), flush=True)
        getattr(self, f"after_{subcommand}", lambda: None)()
