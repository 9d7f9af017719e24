"""``Tuner``: choose a learning rate (``lr_find``) and a batch size (``scale_batch_size``) before a fit,
with Lightning's ``Tuner`` API: ``Tuner(trainer).lr_find(model)``, ``.scale_batch_size(model)``.

Both run short fits on the user's own Trainer (``settings.borrowed``), so they see the same
strategy, devices, precision and accumulation as the real fit, and run in every rank under ddp
(each rank calls the tuner, as each rank calls ``fit``). Afterwards the module's weights and the
Trainer's settings, counters and metrics are as they were (after ``lr_find``, the optimizer and LR
schedulers too, as ``configure_optimizers`` built them); only the chosen value is written to the
module's (or datamodule's) attribute, as Lightning does.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

from ember.data import DataModule
from ember.tuner import batch_size as bs
from ember.tuner.lr_finder import LRFinder, LRSweep, schedule
from ember.tuner.settings import borrowed, get_attr, holders, set_attr
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.module import TrainModule
    from ember.trainer.trainer import Trainer

log = logging.getLogger(__name__)

_METHODS = ("fit", "validate", "test", "predict")


class Tuner:
    """Tunes a Trainer's run before it starts.

    Args:
        trainer: the Trainer the real fit will use (its strategy, devices and precision are used).
    """

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def lr_find(
        self,
        model: TrainModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        method: str = "fit",
        min_lr: float = 1e-8,
        max_lr: float = 1.0,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> LRFinder | None:
        """Sweep the learning rate from ``min_lr`` to ``max_lr`` over ``num_training`` optimizer steps and
        suggest the rate where the loss falls fastest (see ``lr_finder.py``).

        Args:
            model: the module to tune; its weights are put back after the sweep. Its LR schedulers do
                not step during the sweep (the sweep sets every rate), and are given back unchanged.
            train_dataloaders, val_dataloaders, datamodule: as for ``trainer.fit`` (validation is skipped).
            dataloaders: not for lr_find (it trains); an error names ``train_dataloaders``.
            method: "fit" only.
            min_lr, max_lr: the sweep's bounds (0 < min_lr < max_lr).
            num_training: optimizer steps to sweep (fewer when the epochs run out first).
            mode: "exponential" (evenly in log space) or "linear".
            early_stop_threshold: stop when the smoothed loss exceeds this multiple of the best (None: never).
            update_attr: set the suggestion on ``model.lr`` / ``model.learning_rate`` (or ``attr_name``),
                in the module, its ``hparams`` or the datamodule, wherever it is found.
            attr_name: the attribute holding the learning rate, when it is neither ``lr`` nor ``learning_rate``.

        Returns:
            An ``LRFinder`` with ``results``, ``suggestion()`` and ``plot()``; None with ``fast_dev_run``.
        """
        if method != "fit":
            raise ValueError(f"lr_find runs with method='fit' only (it trains), got method={method!r}.")
        if dataloaders is not None:
            raise ValueError(
                "lr_find trains: pass the training loaders as train_dataloaders, not dataloaders "
                "(which is for validate, test and predict)."
            )
        if mode not in ("exponential", "linear"):
            raise ValueError(f"mode must be 'exponential' or 'linear', got {mode!r}.")
        if not 0 < min_lr < max_lr:
            raise ValueError(f"lr_find needs 0 < min_lr < max_lr, got min_lr={min_lr}, max_lr={max_lr}.")
        if isinstance(num_training, bool) or not isinstance(num_training, int) or num_training < 1:
            raise ValueError(f"num_training must be a positive int, got {num_training!r}.")
        trainer = self._trainer
        if trainer.fast_dev_run:
            warnings.warn(
                "Skipping the learning rate finder: fast_dev_run is on.", UserWarning, stacklevel=user_stacklevel()
            )
            return None
        train_dataloaders, datamodule = _split_datamodule(train_dataloaders, datamodule)
        places: list[Any] = []
        name = attr_name
        if update_attr:
            places, name = _lr_holders(model, datamodule, attr_name)
        finder = LRFinder(mode, min_lr, max_lr, num_training)
        sweep = LRSweep(schedule(mode, min_lr, max_lr, num_training), early_stop_threshold)
        with borrowed(
            trainer,
            model,
            sweep,
            max_steps=num_training,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            should_stop=False,
        ):
            try:
                trainer.fit(model, train_dataloaders, val_dataloaders, datamodule)
            finally:
                sweep.give_back()  # the user's LR schedulers, and the optimizer's state
        finder.results = {"lr": sweep.lrs, "loss": sweep.losses}
        if len(sweep.lrs) < num_training:
            log.info(
                "The learning rate finder stopped after %d of %d steps (the loss diverged, or the training "
                "batches ran out).",
                len(sweep.lrs),
                num_training,
            )
        if update_attr:
            lr = finder.suggestion()
            if lr is not None:
                set_attr(places, name, lr)
                log.info("Learning rate set to %s", lr)
        return finder

    def scale_batch_size(
        self,
        model: TrainModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        method: str = "fit",
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> int | None:
        """Find the largest batch size that fits in memory (see ``batch_size.py``), and set it on the
        module's or datamodule's ``batch_arg_name``.

        The module (or datamodule) must build its loaders from that attribute (``train_dataloader()``
        and the others): loaders passed in ready-made cannot change their batch size.

        Args:
            model: the module; its weights are put back after the trials.
            datamodule: a DataModule whose loaders use ``batch_arg_name``.
            train_dataloaders, val_dataloaders, dataloaders: only a DataModule may be passed here.
            method: which run to size: "fit", "validate", "test" or "predict".
            mode: "power" (double until it fails) or "binsearch" (then bisect).
            steps_per_trial: batches per trial.
            init_val: the first size tried.
            max_trials: trials at most.
            batch_arg_name: the attribute (or hparams key) holding the batch size.
            margin: "binsearch" takes this fraction off the size found, for headroom (0 <= margin < 1).
            max_val: the largest size tried.

        Returns:
            The batch size found (also set on ``batch_arg_name``), or None with ``fast_dev_run``.
        """
        if method not in _METHODS:
            raise ValueError(f"method must be one of {', '.join(map(repr, _METHODS))}, got {method!r}.")
        if mode not in ("power", "binsearch"):
            raise ValueError(f"mode must be 'power' or 'binsearch', got {mode!r}.")
        for arg, value in (
            ("steps_per_trial", steps_per_trial),
            ("init_val", init_val),
            ("max_trials", max_trials),
            ("max_val", max_val),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive int, got {value!r}.")
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}.")
        trainer = self._trainer
        if trainer.fast_dev_run:
            warnings.warn(
                "Skipping the batch size finder: fast_dev_run is on.", UserWarning, stacklevel=user_stacklevel()
            )
            return None
        train_dataloaders, datamodule = _split_datamodule(train_dataloaders, datamodule)
        dataloaders, datamodule = _split_datamodule(dataloaders, datamodule)
        if any(x is not None for x in (train_dataloaders, val_dataloaders, dataloaders)):
            raise ValueError(
                "scale_batch_size changes the batch size the module or datamodule builds its loaders "
                f"with ({batch_arg_name!r}); loaders passed in ready-made cannot change it. Build them "
                "in train_dataloader() (and the others) from that attribute, or pass a datamodule."
            )
        places = holders(model, datamodule, batch_arg_name)
        if not places:
            raise AttributeError(
                f"scale_batch_size found no {batch_arg_name!r} in the module, the datamodule or "
                "their hparams. Add the attribute the loaders are built from, or name it with "
                "batch_arg_name=."
            )
        start = get_attr(places, batch_arg_name)
        limit = {
            "fit": "limit_train_batches",
            "validate": "limit_val_batches",
            "test": "limit_test_batches",
            "predict": "limit_predict_batches",
        }[method]
        settings: dict[str, Any] = {limit: steps_per_trial, "should_stop": False, "num_sanity_val_steps": 0}
        if method == "fit":  # the trial's training batches, and as many validation batches (as Lightning)
            settings.update(max_steps=steps_per_trial, limit_train_batches=1.0, limit_val_batches=steps_per_trial)

        def trial(size: int) -> int | None:
            set_attr(places, batch_arg_name, size)
            trainer.should_stop = False
            if method == "fit":
                trainer.fit(model, datamodule=datamodule)
                return bs.dataset_length(trainer.train_dataloader)
            getattr(trainer, method)(model, datamodule=datamodule)
            return None

        found = None
        try:
            with borrowed(trainer, model, None, **settings):
                found = bs.search(trial, mode, init_val, max_trials, margin, max_val)
        finally:
            set_attr(places, batch_arg_name, found if found is not None else start)
        log.info("Batch size finder: using batch size %d.", found)
        return found


def _split_datamodule(loaders: Any, datamodule: DataModule | None) -> tuple[Any, DataModule | None]:
    """Lightning's ``fit(model, datamodule)``: a DataModule passed where the loaders go."""
    if isinstance(loaders, DataModule) and datamodule is None:
        return None, loaders
    return loaders, datamodule


def _lr_holders(model: TrainModule, datamodule: DataModule | None, attr_name: str) -> tuple[list[Any], str]:
    if attr_name:
        places = holders(model, datamodule, attr_name)
        if not places:
            raise AttributeError(
                f"lr_find was told the learning rate is in {attr_name!r}, but neither the module, "
                "the datamodule nor their hparams have it. Check the name, or pass update_attr=False."
            )
        return places, attr_name
    for name in ("lr", "learning_rate"):
        places = holders(model, datamodule, name)
        if places:
            return places, name
    raise AttributeError(
        "lr_find sets the suggested rate on the module's 'lr' or 'learning_rate' (an attribute or "
        "an hparams key), and found neither. Add one and read it in configure_optimizers, name "
        "yours with attr_name=, or pass update_attr=False."
    )
