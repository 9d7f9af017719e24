"""``EmberCLI``: builds the module, the datamodule and the Trainer from the command line and config
files, and runs the subcommand (the package docstring, ``ember/cli/__init__.py``, shows its use)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from ember.callbacks.callback import Callback
from ember.cli.save_config import RESUME_KEYS, SaveConfigCallback
from ember.data import DataModule
from ember.module import TrainModule
from ember.rng import seed_everything
from ember.trainer.trainer import Trainer

_UNUSABLE: ImportError | None = None  # why EmberCLI cannot run here, raised when it is used
try:
    from jsonargparse import ActionConfigFile, Namespace

    from ember.cli.confined import ConfinedParser
except ImportError as err:
    _UNUSABLE = err

__all__ = ["EmberCLI"]

_SUBCOMMANDS = {
    "fit": "Train a model.",
    "validate": "Run validation once.",
    "test": "Run the test set once.",
    "predict": "Run prediction.",
}
#: Entry-point arguments filled by the CLI itself, not from the command line.
_FILLED = {"module", "model", "train_dataloaders", "val_dataloaders", "dataloaders", "datamodule"}


def _require_jsonargparse() -> None:
    if isinstance(_UNUSABLE, ModuleNotFoundError) and (_UNUSABLE.name or "").startswith("jsonargparse"):
        raise ImportError("EmberCLI needs jsonargparse: pip install 'ember[cli]' (or jsonargparse[signatures]).")
    if _UNUSABLE is not None:
        raise _UNUSABLE


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
        self._seed_drawn = False

        self.parser = self._build_parser(run)
        self.config = self.parser.parse_args(args) if not isinstance(args, dict) else self.parser.parse_object(args)
        self.subcommand: str | None = self.config["subcommand"] if run else None
        self._instantiate()
        if self.subcommand is not None:
            self._run(self.subcommand)

    # ------------------------------------------------------------------ the parser
    def _build_parser(self, run: bool) -> Any:
        # ConfinedParser: a class_path is built only where a parameter's type names its base (confined.py).
        main = ConfinedParser(**self.parser_kwargs)
        self.subparsers: dict[str, Any] = {}
        if not run:
            self._add_arguments(main, None)
            return main
        subcommands = main.add_subcommands(required=True, dest="subcommand")
        for name, help_text in _SUBCOMMANDS.items():
            sub = ConfinedParser(description=help_text, **self.parser_kwargs)
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
            self._seed_drawn = True
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
            save_kwargs = dict(self.save_config_kwargs)
            if self._seed_drawn:  # a seed drawn for this process does not make a resumed fit another run
                save_kwargs.setdefault("ignore_on_resume", (*RESUME_KEYS, "seed_everything"))
            callbacks.append(
                self.save_config_callback(self.subparsers[self.subcommand], self.config[self.subcommand], **save_kwargs)
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
