"""The forms ``configure_optimizers`` may return, normalised into optimizers + scheduler configs."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ember.checkpoint import validation
from ember.checkpoint.optimizers import CLASS_KEY, class_name
from ember.module import TrainModule
from ember.names import closest
from ember.overrides import defines_hook, is_overridden
from ember.types import SchedulerConfig
from ember.user_frames import user_stacklevel

# torch's warning for a scheduler stepped before its optimizer (``LRScheduler.step``), a regex of its start.
_ORDER_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"

if TYPE_CHECKING:
    from ember.strategies.strategy import Strategy
    from ember.trainer.hooks import Hooks
    from ember.trainer.precision import Precision

_FORMS = (
    "an optimizer, a list/tuple of optimizers, ([optimizers], [schedulers]), "
    "{'optimizer': opt, 'lr_scheduler': sched or {'scheduler': sched, 'interval': 'step'|'epoch', "
    "'frequency': n, 'monitor': key}}, or a list of such dicts"
)


class NoOptimizer(torch.optim.Optimizer):
    """Stands in when ``configure_optimizers`` returns None, as Lightning's mock optimizer: ``step`` runs
    the closure (training_step and backward still run, ``global_step`` counts), nothing is updated."""

    def __init__(self) -> None:
        super().__init__([torch.zeros(1)], {})

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def __repr__(self) -> str:
        return "No Optimizer"


NO_OPTIMIZER_WARNING = "configure_optimizers returned None, this fit will run with no optimizer"


_CONFIG_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name", "reduce_on_plateau")
#: Keys manual optimization ignores (the user steps the scheduler), with Lightning's warning.
_MANUAL_IGNORED = ("reduce_on_plateau", "monitor", "strict")


def _scheduler_config(obj: Any, automatic: bool = True) -> SchedulerConfig:
    if isinstance(obj, SchedulerConfig):
        cfg = obj
    elif isinstance(obj, dict):
        if "scheduler" not in obj:
            raise ValueError(f"An lr_scheduler dict needs a 'scheduler' key; got keys {sorted(obj)}.")
        unknown = set(obj) - set(_CONFIG_KEYS)
        if unknown:
            raise ValueError(f"Unknown lr_scheduler config keys {sorted(unknown)}; allowed: {', '.join(_CONFIG_KEYS)}.")
        if not automatic:
            ignored = [k for k in obj if k in _MANUAL_IGNORED]
            if ignored:
                warnings.warn(
                    f"The lr scheduler dict contains the key(s) {ignored}, but the keys will be ignored. "
                    "You need to call lr_scheduler.step() yourself in manual optimization.",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
                obj = {k: v for k, v in obj.items() if k not in _MANUAL_IGNORED}
        cfg = SchedulerConfig(**obj)
    else:
        cfg = SchedulerConfig(scheduler=obj)
    if cfg.interval not in ("step", "epoch"):
        raise ValueError(f"lr_scheduler interval must be 'step' or 'epoch', got {cfg.interval!r}.")
    if not isinstance(cfg.frequency, int) or cfg.frequency < 1:
        raise ValueError(f"lr_scheduler frequency must be a positive int, got {cfg.frequency!r}.")
    if automatic and cfg.is_plateau and not cfg.monitor:
        raise ValueError(
            f"{type(cfg.scheduler).__name__} needs a metric: return {{'optimizer': opt, 'lr_scheduler': "
            "{'scheduler': sched, 'monitor': 'val/loss'}} from configure_optimizers."
        )
    if automatic and isinstance(cfg.scheduler, torch.optim.lr_scheduler.OneCycleLR) and cfg.interval == "epoch":
        warnings.warn(
            "A OneCycleLR scheduler is using 'interval': 'epoch'. Did you mean 'interval': 'step'?",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
    # step() is not required: in manual optimization the user steps it their own way, and in automatic
    # optimization check_scheduler_api asks for lr_scheduler_step when it is not one of torch's (as Lightning).
    if not all(callable(getattr(cfg.scheduler, a, None)) for a in ("state_dict", "load_state_dict")):
        raise TypeError(
            f"{type(cfg.scheduler).__name__} is not an LR scheduler: it needs state_dict() and "
            "load_state_dict(), which save and restore it with checkpoints."
        )
    return cfg


def check_scheduler_api(schedulers: list[SchedulerConfig], module: TrainModule) -> None:
    """As Lightning: in automatic optimization, a scheduler that is not one of torch's (its ``step`` may
    take other arguments) needs the module's ``lr_scheduler_step`` to say how to step it."""
    if not module.automatic_optimization or is_overridden("lr_scheduler_step", module, TrainModule):
        return
    for cfg in schedulers:
        if not isinstance(
            cfg.scheduler, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        ):
            raise TypeError(
                f"The LR scheduler {type(cfg.scheduler).__name__} is not a torch.optim.lr_scheduler "
                "scheduler, so ember does not know how to call its step(). Override "
                f"{type(module).__name__}.lr_scheduler_step(self, scheduler, metric) to step it."
            )


def _check_optimizer(opt: Any) -> torch.optim.Optimizer:
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"configure_optimizers returned a {type(opt).__name__} where an optimizer was expected. "
            f"It may return {_FORMS}."
        )
    return opt


_DICT_KEYS = ("optimizer", "lr_scheduler", "monitor")


def _check_dict_keys(conf: dict[str, Any]) -> None:
    """Refuse a key ``configure_optimizers``' dict does not take: a misspelt ``"scheduler"`` would otherwise
    train without the scheduler (Lightning warns and drops it; ember refuses, as for a scheduler config)."""
    unknown = sorted(str(k) for k in conf if k not in _DICT_KEYS)
    if unknown:
        hints = [
            f"{k!r} (did you mean {hint!r}?)" if (hint := closest(k, list(_DICT_KEYS))) else repr(k) for k in unknown
        ]
        raise ValueError(
            f"configure_optimizers returned a dict with the unknown key(s) {', '.join(hints)}; it takes "
            f"{', '.join(map(repr, _DICT_KEYS))}, and a scheduler goes under 'lr_scheduler'. Rename "
            "or remove the key: it would otherwise be ignored."
        )


def parse_optimizers(result: Any, automatic: bool = True) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """Normalise what ``configure_optimizers`` returned (``automatic``: the module's optimization mode)."""
    if result is None:
        return [], []
    if isinstance(result, torch.optim.Optimizer):
        return [result], []
    if isinstance(result, dict):
        result = [result]
    if isinstance(result, (list, tuple)):
        if len(result) == 2 and all(isinstance(r, (list, tuple)) for r in result):
            opts = [_check_optimizer(o) for o in result[0]]
            return opts, [_scheduler_config(s, automatic) for s in result[1]]
        if result and all(isinstance(r, dict) for r in result):
            opts, scheds = [], []
            for d in result:
                if "optimizer" not in d:
                    raise ValueError(
                        f"configure_optimizers returned a dict without 'optimizer' (keys: {sorted(d)}). "
                        f"It may return {_FORMS}."
                    )
                _check_dict_keys(d)
                opts.append(_check_optimizer(d["optimizer"]))
                sched = d.get("lr_scheduler")
                if sched is not None:
                    if d.get("monitor") is not None and not isinstance(sched, (dict, SchedulerConfig)):
                        sched = {"scheduler": sched, "monitor": d["monitor"]}  # Lightning's top-level "monitor"
                    scheds.append(_scheduler_config(sched, automatic))
            return opts, scheds
        return [_check_optimizer(o) for o in result], []
    raise TypeError(f"configure_optimizers returned {type(result).__name__}; it may return {_FORMS}.")


class TrainerOptimizer:
    """An optimizer as the Trainer hands it to the module, as Lightning's ``LightningOptimizer``: the
    ``optimizer`` that ``optimizer_step`` receives in automatic optimization, and what ``self.optimizers()``
    returns in manual optimization.

    ``step(closure, **kwargs)`` goes through the Trainer: ``stepper`` runs the closure and the hooks
    and steps through the precision plugin (GradScaler) and the strategy; the keyword arguments go on to
    the optimizer's own ``step``. ``zero_grad`` and every other attribute read through to the optimizer,
    which ``.optimizer`` is.

    Args:
        optimizer: an optimizer ``configure_optimizers`` returned.
        stepper: ``stepper(optimizer, closure, kwargs)`` does the step: the automatic one
            (``TrainingStep.step_optimizer``) or the manual one (``OptimizerState.manual_step``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stepper: Callable[[torch.optim.Optimizer, Callable[[], Any] | None, dict[str, Any]], Any],
    ) -> None:
        self.optimizer = optimizer
        self._stepper = stepper

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Step the optimizer through the Trainer; ``closure`` (optional) computes the loss, and the keyword
        arguments go on to the optimizer's ``step``, as in Lightning. Returns what the optimizer's step returns."""
        if closure is not None and not callable(closure):
            raise TypeError(
                f"optimizer.step(closure) got a {type(closure).__name__} as closure; it must be a function that "
                "computes the loss (and runs backward), or None. Pass other arguments by keyword."
            )
        return self._stepper(self.optimizer, closure, kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        if name in ("optimizer", "_stepper"):  # not set yet (a copy being built by copy/pickle): no endless lookup
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    # As Lightning's wrapper, which is a subclass made on the fly: ``isinstance(opt, torch.optim.Adam)`` holds
    # (isinstance consults ``__class__``), and it prints as the optimizer, its class name prefixed.
    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self.optimizer)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Copies and pickles are of this wrapper (``__class__`` above would make them of the optimizer's class).
        return (TrainerOptimizer, (self.optimizer, self._stepper))

    def __repr__(self) -> str:
        return f"Trainer{self.optimizer!r}"


def _then_hook(closure: Callable[[], Any], hooks: Hooks, optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    def run() -> Any:
        out = closure()
        hooks.call("on_before_optimizer_step", optimizer)
        return out

    return run


class OptimizerState:
    """The fit's optimizers, schedulers and the wrappers manual optimization steps them through.

    Args:
        optimizers, schedulers: what ``configure_optimizers`` returned, normalised.
        module: steps the schedulers itself when it overrides ``lr_scheduler_step``.
        precision, strategy, hooks: what a manual ``opt.step()`` goes through.
    """

    def __init__(
        self,
        optimizers: list[torch.optim.Optimizer],
        schedulers: list[SchedulerConfig],
        *,
        module: TrainModule | None = None,
        precision: Precision | None = None,
        strategy: Strategy | None = None,
        hooks: Hooks | None = None,
    ) -> None:
        self.optimizers = optimizers
        self.schedulers = schedulers
        self.module, self.precision, self.strategy, self.hooks = module, precision, strategy, hooks
        #: ``opt.step()`` calls made through the manual-optimization wrappers.
        self.steps_taken = 0
        self.wrapped_optimizers = [TrainerOptimizer(o, self.manual_step) for o in optimizers]
        # Set by a resume whose optimizers had stepped: the first scheduler step of this run may come
        # before any optimizer step (a resumed epoch end), where torch would warn of a wrong call order.
        self._resumed_unstepped = False

    def manual_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None, kwargs: dict[str, Any]
    ) -> Any:
        """``opt.step(closure, **kwargs)`` in manual optimization: runs ``on_before_optimizer_step`` (after the
        closure, as Lightning) and steps through the precision plugin and the strategy; the fit loop counts
        the calls into ``global_step``."""
        self.steps_taken += 1
        hooks = self.hooks
        if hooks is not None and hooks.get("on_before_optimizer_step"):
            if closure is None:
                hooks.call("on_before_optimizer_step", optimizer)
            else:  # as Lightning: the hook runs after the closure (its backward), inside the optimizer's step
                closure = _then_hook(closure, hooks, optimizer)
        assert self.precision is not None and self.strategy is not None  # set for every fit
        return self.precision.optimizer_step(optimizer, self.strategy, closure, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The optimizers' and LR schedulers' states, under the checkpoint's keys; each optimizer's with its
        class beside it (``ember.checkpoint.optimizers.CLASS_KEY``), which a resume checks."""
        return {
            "optimizer_states": [{**opt.state_dict(), CLASS_KEY: class_name(opt)} for opt in self.optimizers],
            "lr_schedulers": [cfg.scheduler.state_dict() for cfg in self.schedulers],
        }

    def check(self, checkpoint: dict[str, Any], source: str) -> None:
        """Raise ``ember.checkpoint.validation.Invalid`` unless the checkpoint's optimizer and scheduler states
        fit this fit's optimizers and schedulers (``ember.checkpoint.validation.optimizers``)."""
        module_name = type(self.module).__name__
        saved, saved_schedulers = checkpoint.get("optimizer_states"), checkpoint.get("lr_schedulers")
        opts, n = self.optimizers, len(self.schedulers)
        validation.check("optimizer_states", validation.optimizers, saved, saved_schedulers, opts, n, module_name)
        validation.check("lr_schedulers", validation.schedulers, saved_schedulers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()``'s entries into this fit's optimizers and schedulers, in order (checked
        beforehand by :meth:`check`). ``state`` is a whole checkpoint on a resume: its ``progress`` says
        whether the optimizers had stepped in the run that saved them."""
        for opt, saved in zip(self.optimizers, state["optimizer_states"]):
            opt.load_state_dict(saved)
        self._resumed_unstepped = (state.get("progress") or {}).get("global_step", 0) > 0
        for cfg, saved in zip(self.schedulers, state["lr_schedulers"]):
            cfg.scheduler.load_state_dict(saved)

    def step_schedulers(self, interval: str, count: int, metrics: dict[str, Any], plateau: bool | None = None) -> None:
        """Step schedulers of ``interval`` whose frequency divides ``count``: for ``"step"``, the epoch's batches
        done (``batch_idx + 1``, called only on a batch where the optimizer stepped, as Lightning); for
        ``"epoch"``, the epochs done.

        ``plateau``: only ReduceLROnPlateau-like schedulers (True), only the others (False), or all.
        A module overriding ``lr_scheduler_step`` steps them itself.
        """
        if self._resumed_unstepped and self.schedulers:
            # The first scheduler step after a resume of stepped optimizers: torch's "lr_scheduler.step()
            # before optimizer.step()" warning is wrong here (they stepped before the checkpoint); only it is quieted.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_ORDER_WARNING, category=UserWarning)
                self._resumed_unstepped = not self._step_schedulers(interval, count, metrics, plateau)
            return
        self._step_schedulers(interval, count, metrics, plateau)

    def _step_schedulers(self, interval: str, count: int, metrics: dict[str, Any], plateau: bool | None) -> bool:
        """``step_schedulers``; returns whether a scheduler was stepped."""
        stepped = False
        module = self.module
        custom = defines_hook("lr_scheduler_step", module, TrainModule)
        for cfg in self.schedulers:
            if cfg.interval != interval or count % cfg.frequency:
                continue
            if plateau is not None and cfg.is_plateau != plateau:
                continue
            value = None
            if cfg.is_plateau and cfg.monitor is not None:  # as Lightning: only these read their monitor
                value = metrics.get(cfg.monitor)
                if value is None:
                    if cfg.strict:
                        raise KeyError(
                            f"The LR scheduler monitors {cfg.monitor!r}, which was not logged. Logged keys: "
                            f"{sorted(metrics)}. Log it with self.log({cfg.monitor!r}, ...) or change 'monitor'."
                        )
                    warnings.warn(
                        f"The LR scheduler monitors {cfg.monitor!r}, which is not available, and strict is "
                        "False: skipping this learning rate update.",
                        RuntimeWarning,
                        stacklevel=user_stacklevel(),
                    )
                    continue
            stepped = True
            if custom:
                assert module is not None
                module.lr_scheduler_step(cfg.scheduler, value)
            elif value is not None:
                cfg.scheduler.step(float(value))
            else:
                cfg.scheduler.step()
        return stepped
