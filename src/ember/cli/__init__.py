"""``EmberCLI``: run experiments from YAML, in the spirit of Lightning's ``LightningCLI``.

    # main.py
    from ember.cli import EmberCLI
    EmberCLI(MyModule, MyDataModule)

    python main.py fit --config experiment.yaml --trainer.max_epochs 5 --model.lr 0.01
    python main.py fit --print_config > experiment.yaml      # every setting, with its default
    python main.py fit --config experiment.yaml --ckpt_path last   # continue a stopped run
    python main.py fit --optimizer AdamW --optimizer.lr 0.01       # the optimizer, for a module without one

Subcommands ``fit``, ``validate``, ``test`` and ``predict`` take ``--trainer.*``, ``--model.*`` and
``--data.*`` from the classes' type hints (jsonargparse reads the ``__init__`` signatures, so a
misspelt key in a YAML file or on the command line is an error naming the keys there are),
``--config`` files (several, later ones overriding; before the subcommand, a file holds ``fit:`` and
the others as sections), ``--seed_everything``, ``--optimizer`` and ``--lr_scheduler``, and the entry
point's own arguments (``--ckpt_path``). ``add_arguments_to_parser`` is where a subclass adds arguments
and links them (``parser.link_arguments("data.num_classes", "model.num_classes")``); each step of the
CLI is a method a subclass may override, as Lightning's (``ember_cli.py`` lists them).

A config builds only what the types ask for (``confined.py``): ``{class_path: ..., init_args: ...}``
is built only where a parameter's type is a class (or a union, list or Callable of classes) and the
path names a subclass of it. Given to a parameter typed ``Any``, ``object``, ``dict`` or left
unannotated, it is an error naming the key, and nothing is imported or run. A module takes an optimizer
the config chooses as ``optimizer: OptimizerCallable`` (and calls it on its parameters), not as a dict.

The resolved configuration of each run is saved as ``config.yaml`` in the run's log folder
(``trainer.log_dir``) on global rank zero, so a run can be repeated with ``--config`` that file
(``save_config.py``). A fit resuming a run (``--ckpt_path last``, or a torchrun / SLURM restart)
continues in the run's own folder: it keeps the saved file when its configuration is the same, and
saves a changed one beside it (``config-1.yaml``, ``config-2.yaml``...). Any other run never
overwrites a file already there: it stops before training and says what to do.

jsonargparse is an optional dependency: ``pip install 'ember[cli]'``. Without it this package imports,
and building EmberCLI or its parser says what to install.

Files: ``ember_cli.py`` (EmberCLI), ``parser.py`` (its parser class), ``confined.py`` (what a config
may build), ``save_config.py`` (SaveConfigCallback), ``optimizers.py`` (optimizers and schedulers a
config chooses), ``instantiate.py`` (building from a class spec), ``lightning_names.py`` (names
Lightning's cli module imports).
"""

from ember.cli.ember_cli import ArgsType, EmberArgumentParser, EmberCLI
from ember.cli.instantiate import instantiate_class, instantiate_module
from ember.cli.lightning_names import Callback, Trainer, is_overridden, rank_zero_warn, seed_everything
from ember.cli.optimizers import (
    LRSchedulerCallable,
    LRSchedulerType,
    LRSchedulerTypeTuple,
    LRSchedulerTypeUnion,
    OptimizerCallable,
    ReduceLROnPlateau,
)
from ember.cli.save_config import SaveConfigCallback

#: Lightning's name for the parser class.
LightningArgumentParser = EmberArgumentParser

__all__ = [
    "ArgsType",
    "Callback",
    "EmberArgumentParser",
    "EmberCLI",
    "LRSchedulerCallable",
    "LRSchedulerType",
    "LRSchedulerTypeTuple",
    "LRSchedulerTypeUnion",
    "LightningArgumentParser",
    "OptimizerCallable",
    "ReduceLROnPlateau",
    "SaveConfigCallback",
    "Trainer",
    "instantiate_class",
    "instantiate_module",
    "is_overridden",
    "rank_zero_warn",
    "seed_everything",
]
