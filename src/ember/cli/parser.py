"""``EmberArgumentParser`` (also importable as ``LightningArgumentParser``): the parser EmberCLI builds and
hands to ``add_arguments_to_parser``.

It is the confined parser (``confined.py``: a config builds only what the types ask for) with the helpers
a CLI uses to add its parts: ``add_lightning_class_args`` for a module, datamodule, Trainer or callback
class (a callback added this way is given to the Trainer), ``add_optimizer_args`` and
``add_lr_scheduler_args`` for an optimizer or scheduler group, which the CLI either hands to the module
itself (``link_to="AUTOMATIC"``) or links to a module parameter typed with the class it builds
(``link_to="model.optimizer"`` with ``optimizer: OptimizerCallable``).

Environment variables are read with ``default_env=True``: ``EMBER_FIT__TRAINER__MAX_EPOCHS=3`` (the prefix
is ``env_prefix``; the subcommand's name comes first) and ``EMBER_CONFIG`` for a whole config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jsonargparse import ArgumentParser, Namespace, class_from_function
from torch.optim import Optimizer

from ember.callbacks.callback import Callback
from ember.cli.confined import ConfinedParser
from ember.cli.optimizers import AUTOMATIC, LRSchedulerTypeTuple
from ember.data import DataModule
from ember.module import TrainModule
from ember.trainer.trainer import Trainer

__all__ = ["EmberArgumentParser", "LightningArgumentParser"]

#: ``{key: (class or tuple of classes, link_to)}``: an optimizer or scheduler group the parser holds.
Groups = dict[str, tuple[Any, str]]


class EmberArgumentParser(ConfinedParser):
    """The parser of EmberCLI (jsonargparse's ``ArgumentParser``, confined: ``confined.py``).

    Args:
        description: shown by ``--help``.
        env_prefix: the prefix of the environment variables read with ``default_env=True``.
        default_env: read arguments from environment variables (``EMBER_TRAINER__MAX_EPOCHS``).
        *args, **kwargs: jsonargparse's ``ArgumentParser`` arguments.
    """

    def __init__(
        self,
        *args: Any,
        description: str = "ember Trainer command line tool",
        env_prefix: str = "EMBER",
        default_env: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, description=description, env_prefix=env_prefix, default_env=default_env, **kwargs)
        #: The keys of the callbacks added with ``add_lightning_class_args``: the CLI gives them to the Trainer.
        self.callback_keys: list[str] = []
        #: The optimizer and scheduler groups added (``{key: (classes, link_to)}``), in the order added.
        self.optimizers: Groups = {}
        self.lr_schedulers: Groups = {}

    def add_lightning_class_args(
        self,
        lightning_class: type | Callable[..., Any],
        nested_key: str,
        subclass_mode: bool = False,
        required: bool = True,
    ) -> list[str]:
        """Add the constructor arguments of a module, datamodule, Trainer or callback class under ``nested_key``.

        Args:
            lightning_class: a subclass of ``TrainModule``, ``DataModule``, ``Trainer`` or ``Callback``, or a
                function returning one (its parameters are the arguments; its return annotation names the class).
            nested_key: where the arguments go (``--<nested_key>.<name>``).
            subclass_mode: the config names the class (``class_path``), any subclass of this one.
            required: with ``subclass_mode``, whether the config must name one.

        Returns:
            The keys of the arguments added.
        """
        cls: Any = lightning_class
        if callable(cls) and not isinstance(cls, type):
            cls = class_from_function(cls)
        if not (isinstance(cls, type) and issubclass(cls, (Trainer, TrainModule, DataModule, Callback))):
            raise TypeError(
                f"add_lightning_class_args takes a subclass of Trainer, TrainModule, DataModule or Callback, or a "
                f"function returning one (with that return annotation); got {lightning_class!r}."
            )
        if issubclass(cls, Callback):
            self.callback_keys.append(nested_key)
        if subclass_mode:
            return self.add_subclass_arguments(cls, nested_key, fail_untyped=False, required=required)
        # The Trainer's arguments stay a section: the CLI adds its own callbacks before building it.
        instantiate = not issubclass(cls, Trainer)
        return self.add_class_arguments(cls, nested_key, fail_untyped=False, instantiate=instantiate, sub_configs=True)

    def add_optimizer_args(
        self,
        optimizer_class: type[Optimizer] | tuple[type[Optimizer], ...] = (Optimizer,),
        nested_key: str = "optimizer",
        link_to: str = AUTOMATIC,
    ) -> None:
        """Add an optimizer group: one class's arguments, or (a tuple) any subclass the config names.

        Args:
            optimizer_class: an optimizer class, or a tuple of base classes to choose a subclass of.
            nested_key: where the arguments go (``--optimizer``, ``--optimizer.lr``).
            link_to: ``"AUTOMATIC"``: the CLI builds it on the module's parameters and the module's
                ``configure_optimizers`` returns it; or a parser key to link it to (a module parameter typed
                ``OptimizerCallable``).
        """
        _check_classes(optimizer_class, (Optimizer,), "add_optimizer_args", "torch.optim.Optimizer")
        self._add_group(optimizer_class, nested_key, skip={"params"})
        self.optimizers[nested_key] = (optimizer_class, link_to)

    def add_lr_scheduler_args(
        self,
        lr_scheduler_class: type | tuple[type, ...] = LRSchedulerTypeTuple,
        nested_key: str = "lr_scheduler",
        link_to: str = AUTOMATIC,
    ) -> None:
        """Add a learning-rate scheduler group: one class's arguments, or (a tuple) any subclass the config names.

        Args:
            lr_scheduler_class: a subclass of torch's ``LRScheduler`` or of ``ember.cli.ReduceLROnPlateau``, or a
                tuple of base classes to choose a subclass of.
            nested_key: where the arguments go (``--lr_scheduler``, ``--lr_scheduler.gamma``).
            link_to: ``"AUTOMATIC"`` (built on the optimizer the CLI built) or a parser key to link it to.
        """
        _check_classes(
            lr_scheduler_class,
            LRSchedulerTypeTuple,
            "add_lr_scheduler_args",
            "LRScheduler or ember.cli.ReduceLROnPlateau",
        )
        self._add_group(lr_scheduler_class, nested_key, skip={"optimizer"})
        self.lr_schedulers[nested_key] = (lr_scheduler_class, link_to)

    def _add_group(self, classes: type | tuple[type, ...], nested_key: str, skip: set[str]) -> None:
        # Not built while parsing: the CLI builds it on what it needs (the parameters, the optimizer).
        if isinstance(classes, tuple):
            self.add_subclass_arguments(classes, nested_key, instantiate=False, fail_untyped=False, skip=skip)
        else:
            self.add_class_arguments(
                classes, nested_key, instantiate=False, fail_untyped=False, skip=skip, sub_configs=True
            )

    def instantiate_classes(self, cfg: Any, **kwargs: Any) -> Any:
        """Build the classes of a parsed config (jsonargparse's ``instantiate`` where the release has it)."""
        instantiate = getattr(ArgumentParser, "instantiate", None)  # (jsonargparse 4.49 renamed it)
        if instantiate is None or not isinstance(cfg, Namespace):
            return super().instantiate_classes(cfg, **kwargs)
        return instantiate(self, cfg, **kwargs)


#: Lightning's name for the CLI's parser class.
LightningArgumentParser = EmberArgumentParser


def _check_classes(given: Any, bases: tuple[type, ...], method: str, what: str) -> None:
    classes = given if isinstance(given, tuple) else (given,)
    if not classes or not all(isinstance(c, type) and issubclass(c, bases) for c in classes):
        raise TypeError(f"{method} takes a subclass of {what} or a tuple of them, got {given!r}.")
