"""Where a run's batches come from: the loaders requested from the module or datamodule, how many
batches of each run, and the per-batch transfer to the device (with the module's transfer hooks)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, SequentialSampler

from ember.batches import move_to_device, sized_len
from ember.data import DataModule
from ember.data.resumable import SkipFirstBatches, rebuild_with_sampler, shutdown_workers, why_not_swappable
from ember.module import TrainModule
from ember.overrides import defines_hook, is_overridden
from ember.trainer.loader_checks import check_loaders
from ember.user_frames import user_stacklevel
from ember.utilities.combined_loader import CombinedLoader

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer
    from ember.types import Stage


def num_batches(loader: Any, limit: int | float) -> float:
    """How many batches of ``loader`` to run under ``limit`` (int count or float fraction)."""
    sized = sized_len(loader)
    n: float = math.inf if sized is None else sized
    if isinstance(limit, float):
        if n == math.inf:
            if limit != 1.0:
                raise ValueError("A fractional limit_*_batches needs a dataloader with a length; pass an int instead.")
            return n
        return max(1, int(n * limit)) if limit > 0 and n > 0 else 0
    return min(n, limit)


def as_list(loaders: Any) -> list[Any]:
    """Evaluation's loaders as a list (None: empty): one loader, a list, tuple or dict of them (in order), or a
    ``CombinedLoader``: in ``sequential`` mode its loaders one after the other (each its own
    ``dataloader_idx``, as a list), in the other modes one loader of combined batches. An empty list, tuple
    or dict is one loader without batches, as in Lightning (``num_val_batches == [0]``)."""
    if loaders is None:
        return []
    if isinstance(loaders, CombinedLoader):
        return loaders.flattened if loaders.mode == "sequential" else [loaders]
    if isinstance(loaders, Mapping) and loaders:
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) and loaders else [loaders]


def warn_empty(trainer: Trainer, loaders: list[Any], kind: str) -> None:
    """As Lightning (rank zero): say that an evaluation loader has length 0, so it runs no step."""
    if not trainer.is_global_zero:
        return
    for i, loader in enumerate(loaders):
        if sized_len(loader) == 0:
            which = f" {i}" if len(loaders) > 1 else ""
            warnings.warn(
                f"The {kind} dataloader{which} ({type(loader).__name__}) has length 0, so no batch of it runs. "
                "Make sure this was your intention: check its dataset, and batch_size with drop_last=True.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )


class CombinedBatches:
    """What the loops iterate for a ``CombinedLoader``: its batches, without the ``(batch_idx,
    dataloader_idx)`` it yields beside them (the loops count those themselves). Its length, epoch and
    resumable state are the combined loader's."""

    def __init__(self, combined: CombinedLoader) -> None:
        self.combined = combined

    def __iter__(self) -> Iterator[Any]:
        return (batch for batch, _, _ in self.combined)

    def __len__(self) -> int:
        return len(self.combined)

    def set_epoch(self, epoch: int) -> None:
        self.combined.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.combined.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.combined.load_state_dict(state)


def close_loaders(loaders: Iterable[Any]) -> None:
    """Stop the worker processes that ``loaders`` (as the loops run them) keep between epochs
    (``persistent_workers=True``): a stage's loaders when it ends, as Lightning, and a loader a reload replaces.
    Each loader of a ``CombinedLoader``; loaders that are not DataLoaders have nothing to stop."""
    for loader in loaders:
        if isinstance(loader, SkipFirstBatches):  # (a mid-epoch resume of a loader without a resumable sampler)
            loader = loader.loader
        if isinstance(loader, CombinedBatches):
            loader = loader.combined
        for inner in loader.flattened if isinstance(loader, CombinedLoader) else [loader]:
            shutdown_workers(inner)


def process(trainer: Trainer, loader: Any, stage: Stage) -> Any:
    """``loader`` as the strategy runs it for ``stage``; a CombinedLoader's inner loaders each (every one
    sharded under ddp and, for fit, resumable, as Lightning processes each). An empty evaluation loader
    is kept as it is: it has nothing to shard."""
    if stage != "fit" and sized_len(loader) == 0:
        return loader
    if isinstance(loader, CombinedLoader):
        loader.flattened = [trainer.strategy.process_dataloader(d, stage) for d in loader.flattened]
        return CombinedBatches(loader)
    return trainer.strategy.process_dataloader(loader, stage)


def _holds_tensors(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_holds_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensors(v) for v in obj)
    return False


def combined_train(loader: Any) -> Any:
    """fit's loader: a dict, list or tuple of loaders is combined as Lightning does (``max_size_cycle``).
    A list of batches (tensors in it: ready-made batches, not loaders) is the loader itself, as before."""
    if isinstance(loader, (Mapping, list, tuple)) and not _holds_tensors(loader):
        return CombinedLoader(loader, "max_size_cycle")
    if isinstance(loader, CombinedLoader) and loader.mode == "sequential":
        raise ValueError(
            "fit does not support CombinedLoader(mode='sequential') for training: each step trains on "
            "one batch of each loader. Use 'max_size_cycle', 'min_size' or 'max_size'."
        )
    return loader


def request(trainer: Trainer, given: Any, attr: str, argument: str = "") -> Any:
    """``given`` if not None, else what the datamodule's (or, without one, the module's) ``attr()`` returns;
    checked (``loader_checks.check_loaders``); ``argument`` names where ``given`` was passed, for its errors."""
    if given is not None:
        check_loaders(given, argument)
        return given
    dm = trainer.datamodule
    if dm is not None:
        source: Any = dm
        if not is_overridden(attr, dm, DataModule):
            fn = getattr(dm, attr, None)  # DataModule's own: None for validation, an explanatory error otherwise
            return fn() if callable(fn) else None
    elif is_overridden(attr, trainer.module, TrainModule):
        source = trainer.module
    else:
        return None  # TrainModule's defaults only say it is missing; the callers say what to pass instead
    loaders = getattr(source, attr)()
    if loaders is None:  # as Lightning: a defined hook must return loaders
        raise TypeError(
            f"{type(source).__name__}.{attr}() returned None; it must return a DataLoader (or any iterable of "
            f"batches), or a list or dict of them. To go without, do not define {attr}()"
            + (", or set limit_val_batches=0." if attr == "val_dataloader" else ".")
        )
    check_loaders(loaders, f"what {type(source).__name__}.{attr}() returned")
    return loaders


def eval_loaders(
    trainer: Trainer, given: Any, stage: Stage, attr: str, limit: int | float
) -> tuple[list[Any], list[float]]:
    """validate / test / predict: the loaders (processed by the strategy) and the batches to run of each."""
    if stage == "validate":  # trainer.val_dataloaders / num_val_batches: validate's from now on
        trainer.fit_state.data.superseded_by_validate = True
    loaders = as_list(request(trainer, given, attr, f"{stage}'s dataloaders"))
    if not loaders:
        raise ValueError(f"{stage} needs data: pass dataloaders or a datamodule.")
    warn_empty(trainer, loaders, {"validate": "validation"}.get(stage, stage))
    loaders = [process(trainer, d, stage) for d in loaders]
    for d in loaders:  # as Lightning: the epoch of the last fit (0 for a new Trainer)
        set_loader_epoch(d, trainer.current_epoch)
    return loaders, [num_batches(d, limit) for d in loaders]


def set_loader_epoch(loader: Any, epoch: int) -> None:
    """Tell the loader's samplers which epoch starts, for per-epoch shuffling: as Lightning, the sampler and
    the batch sampler's sampler (once each when they are one object), and also a batch sampler of
    its own that has ``set_epoch``. Called for the train loader every epoch and for validation loaders
    each time they run (some shuffle validation by the training epoch)."""
    if isinstance(loader, CombinedBatches):
        loader.set_epoch(epoch)
        return
    batch_sampler = getattr(loader, "batch_sampler", None)
    seen: dict[int, Any] = {}
    for obj in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None), batch_sampler):
        if obj is not None:
            seen.setdefault(id(obj), obj)
    for obj in seen.values():
        set_epoch = getattr(obj, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


def batch_transfer(trainer: Trainer, dataloader_idx: int, input_dtype: Any) -> Callable[[Any], Any] | None:
    """The batch transfer for loader ``dataloader_idx``: the strategy's (casting under 64-true), wrapped in
    the module's ``on_before_batch_transfer`` / ``transfer_batch_to_device`` / ``on_after_batch_transfer``
    where it (or the datamodule) overrides them; otherwise nothing extra runs per batch. None when there is
    nothing to do (no hook, no cast, and a strategy no batch can need moving for)."""
    strategy = trainer.strategy
    device = strategy.root_device
    base: Callable[[Any], Any] = strategy.batch_to_device
    if input_dtype is not None:

        def base(batch: Any) -> Any:
            return move_to_device(batch, device, input_dtype)

    def owner(name: str) -> Any:
        """Whose hook ``name`` runs: the datamodule's where it overrides it, else the module's, or None."""
        dm = trainer.datamodule
        if dm is not None and is_overridden(name, dm, DataModule):
            return getattr(dm, name)
        if defines_hook(name, trainer.module, TrainModule):
            return getattr(trainer.module, name)
        return None

    before = owner("on_before_batch_transfer")
    custom = owner("transfer_batch_to_device")
    after = owner("on_after_batch_transfer")
    if before is None and custom is None and after is None:
        return base if input_dtype is not None or strategy.moves_batches() else None

    def transfer(batch: Any) -> Any:
        if before is not None:
            batch = before(batch, dataloader_idx)
        batch = custom(batch, device, dataloader_idx) if custom is not None else base(batch)
        if after is not None:
            batch = after(batch, dataloader_idx)
        return batch

    return transfer


def unshuffled(loader: Any, kind: str) -> Any:
    """``overfit_batches``: ``loader`` with any sampler but a sequential one (a shuffling or a custom one)
    replaced by a ``SequentialSampler`` (warned, as Lightning), so every epoch sees the same first batches."""
    sampler = getattr(loader, "sampler", None)
    if sampler is None or isinstance(sampler, SequentialSampler) or isinstance(loader.dataset, IterableDataset):
        return loader  # (an iterable dataset has no sampler order to change)
    reason = why_not_swappable(loader)
    # Only the sampler is in the way (custom, or drawing with replacement): a copy with a sequential one is exact.
    if reason is not None and not reason.startswith(("it has a custom sampler", "its RandomSampler")):
        warnings.warn(
            f"overfit_batches: the {kind} dataloader's sampler ({type(sampler).__name__}) cannot be made "
            f"sequential ({reason}), so its batches may differ between epochs. Pass a loader with "
            "shuffle=False.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return loader
    warnings.warn(
        f"You requested to overfit but enabled {kind} dataloader shuffling. We are turning off the {kind} "
        "dataloader shuffling for you.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
    return rebuild_with_sampler(loader, SequentialSampler(loader.dataset))


class FitData:
    """fit's loaders: requested from the module or datamodule in Lightning's order, counted, reloaded.

    The validation loader is requested when the sanity check starts, or else at the start of the first
    epoch that validates (as Lightning: a fit whose first epochs do not validate requests it only then), the
    train loader after the sanity check, both only once per fit unless ``reload_dataloaders_every_n_epochs``
    asks again: the train loader at the start of an epoch, the validation loader when a validation runs (an
    epoch that does not validate requests none). A sanity check's request counts as the epoch's load only
    when that epoch validates; otherwise the first validation requests the loaders again, when reloading.

    Args:
        trainer: the run's Trainer (its strategy, limits, module and datamodule).
        train, val: loaders passed to ``fit`` directly (None: request them).
    """

    def __init__(self, trainer: Trainer, train: Any, val: Any) -> None:
        self._trainer = trainer
        self._given = (train, val)
        self.train_loader: Any = None  # what the loop iterates (process()ed: resumable, sharded)
        self.train_given: Any = None  # the loader as given or requested (see _set_train)
        self.val_loaders: list[Any] = []
        self.num_training_batches: float = 0
        self.num_val_batches: list[float] = []
        self._val_requested = False
        #: A ``validate`` ran after this fit: ``trainer.val_dataloaders`` and ``num_val_batches`` are its.
        self.superseded_by_validate = False
        # The epoch whose validation loaders are in use; None: loaded for a sanity check of an epoch that
        # does not validate, so the first validation reloads them (when reloading at all).
        self._val_loaded_at: int | None = 0

    @property
    def validates(self) -> bool:
        """Whether this fit validates at all, decided as Lightning does before any loader is requested:
        a validation loader is given or defined (``val_dataloader`` of the datamodule, or else of the
        module), the module has a ``validation_step`` (``= None`` switches it off) and
        ``limit_val_batches`` is not 0."""
        t = self._trainer
        if getattr(t.module, "validation_step", None) is None or t.limit_val_batches == 0:
            return False
        return self.val_source_defined()

    @property
    def plans_validation(self) -> bool:
        """Whether this fit runs ``validation_step`` on validation data (``validates``, with the module's
        own ``validation_step``): what ``trainer.enable_validation`` says."""
        return self.validates and is_overridden("validation_step", self._trainer.module, TrainModule)

    def epoch_validates(self, epoch: int) -> bool:
        """Whether ``epoch`` validates by ``check_val_every_n_epoch`` (every epoch may when it is None: the
        interval then counts batches across epochs)."""
        every = self._trainer.check_val_every_n_epoch
        return every is None or (epoch + 1) % every == 0

    def val_source_defined(self) -> bool:
        """Whether validation data is given to fit or defined (``val_dataloader`` of the datamodule, or else
        of the module)."""
        if self._given[1] is not None:
            return True
        dm = self._trainer.datamodule
        if dm is not None:
            return is_overridden("val_dataloader", dm, DataModule)
        return is_overridden("val_dataloader", self._trainer.module, TrainModule)

    def warn_validation_step_without_data(self) -> None:
        """As Lightning, once at the start of a fit (rank zero): a ``validation_step`` with no validation data
        to run it on is skipped, and the user is told so."""
        t = self._trainer
        if (
            is_overridden("validation_step", t.module, TrainModule)
            and not self.val_source_defined()
            and t.is_global_zero
        ):
            warnings.warn(
                f"{type(t.module).__name__} defines validation_step, but this fit has no validation data "
                "(no val_dataloaders passed to fit and no val_dataloader() on the module or datamodule), "
                "so validation is skipped. Pass val_dataloaders to validate.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    def request_val_for_epoch(self, epoch: int) -> None:
        """At the fit's start and each epoch's: request the validation loaders (``request_val``) if not yet
        done and ``epoch`` validates, as Lightning. Without a ``validation_step`` they are requested at once:
        validation data without a step to run on is an error to report before training."""
        if self._val_requested or not self.validates:
            return
        if self.epoch_validates(epoch) or not is_overridden("validation_step", self._trainer.module, TrainModule):
            self.request_val()

    def request_val(self) -> None:
        """Request the validation loaders (once per fit) and count their batches."""
        if self._val_requested:
            return
        self._val_requested = True
        t = self._trainer
        sanity_only = t.sanity_checking and not self.epoch_validates(t.current_epoch)
        self._val_loaded_at = None if sanity_only else t.current_epoch
        if not self.validates:
            return
        loaders = as_list(request(t, self._given[1], "val_dataloader", "fit's val_dataloaders"))
        if not is_overridden("validation_step", t.module, TrainModule):
            if any(sized_len(d) != 0 for d in loaders):
                raise ValueError(
                    f"Validation data was given but {type(t.module).__name__} defines no validation_step. "
                    "Define validation_step or do not pass val_dataloaders."
                )
            return  # no step and no data (an empty list): nothing to validate, nothing to say
        self._set_val(loaders)

    def request_train(self) -> None:
        """Request the train loader (once per fit) and count its batches."""
        if self.train_loader is not None:
            return
        train = request(self._trainer, self._given[0], "train_dataloader", "fit's train_dataloaders")
        if train is None:
            raise ValueError(
                "fit needs training data: pass train_dataloaders, or a datamodule with train_dataloader()."
            )
        self._set_train(train)
        if self.num_training_batches == 0:
            raise ValueError(
                "The train dataloader is empty (0 batches after limit_train_batches). Check the "
                "dataset, batch_size with drop_last, and limit_train_batches."
            )

    def reload(self) -> None:
        """``reload_dataloaders_every_n_epochs``: request a fresh train loader (one passed to ``fit`` is kept)."""
        if self._given[0] is None:
            loader = request(self._trainer, None, "train_dataloader")
            if loader is not None:
                self._set_train(loader)

    def reload_val_if_due(self) -> None:
        """Before a validation inside fit: request fresh validation loaders when the ones in use were
        requested ``reload_dataloaders_every_n_epochs`` or more epochs ago, or only for the sanity check of an
        epoch that does not validate (one passed to ``fit`` is kept)."""
        t = self._trainer
        every = t.reload_dataloaders_every_n_epochs
        loaded_at = self._val_loaded_at
        if not every or (loaded_at is not None and t.current_epoch - loaded_at < every):
            return
        self._val_loaded_at = t.current_epoch
        if self._given[1] is None and self.val_loaders:
            self._set_val(as_list(request(t, None, "val_dataloader")))

    def close(self) -> None:
        """The fit ends: stop the worker processes its loaders keep between epochs (``close_loaders``)."""
        close_loaders([self.train_loader, *self.val_loaders])

    def _set_train(self, loader: Any) -> None:
        t = self._trainer
        close_loaders([self.train_loader])  # a reload replaces it
        loader = combined_train(loader)
        if t.overfit_batches:
            if isinstance(loader, CombinedLoader):
                loader.flattened = [unshuffled(d, "train") for d in loader.flattened]
            else:
                loader = unshuffled(loader, "train")
        # What trainer.train_dataloader shows (as Lightning: the loaders in the structure given, a
        # CombinedLoader's too), taken before process() swaps in the resumable or sharded ones.
        self.train_given = loader.iterables if isinstance(loader, CombinedLoader) else loader
        self.train_loader = process(t, loader, "fit")
        self.num_training_batches = num_batches(self.train_loader, t.limit_train_batches)

    def _set_val(self, loaders: list[Any]) -> None:
        t = self._trainer
        close_loaders(self.val_loaders)  # a reload replaces them
        warn_empty(t, loaders, "validation")
        if t.overfit_batches:
            loaders = [unshuffled(v, "val") for v in loaders]
        self.val_loaders = [process(t, v, "validate") for v in loaders]
        self.num_val_batches = [num_batches(v, t.limit_val_batches) for v in self.val_loaders]

    @property
    def will_validate(self) -> bool:
        """Whether there is validation to run (loaders requested and at least one batch)."""
        return bool(self.val_loaders and any(self.num_val_batches))
