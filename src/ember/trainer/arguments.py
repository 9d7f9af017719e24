"""The Trainer's arguments: checked, and turned into things (devices, the strategy, callbacks, loggers)."""

from __future__ import annotations

import difflib
import inspect
import logging
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

import ember.callbacks as cbs
from ember.callbacks.callback import Callback
from ember.callbacks.checkpoint_base import Checkpoint
from ember.callbacks.timer import parse_duration
from ember.loggers.logger import Logger
from ember.loggers.tensorboard import default_logger
from ember.names import closest
from ember.profilers import PROFILERS, PassThroughProfiler, Profiler
from ember.strategies.launchers.launcher import detect_world
from ember.strategies.registry import get_strategy
from ember.strategies.strategy import Strategy
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer

log = logging.getLogger(__name__)

_ACCELERATORS = ("auto", "cpu", "cuda", "gpu")


def check_schedule(
    *,
    max_epochs: int | None,
    max_steps: int,
    min_epochs: int | None,
    min_steps: int | None,
    accumulate_grad_batches: int,
    gradient_clip_val: float | None,
    gradient_clip_algorithm: str,
    val_check_interval: int | float,
    check_val_every_n_epoch: int | None,
    log_every_n_steps: int,
    num_sanity_val_steps: int,
    reload_dataloaders_every_n_epochs: int,
    fast_dev_run: bool | int,
) -> None:
    """Check the Trainer's schedule arguments (each error names the argument and what it accepts). The epoch
    limits left None get their values when a fit starts (:func:`default_epoch_limits`)."""
    if min_steps is not None and (isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 0):
        raise ValueError(f"min_steps must be a non-negative int or None, got {min_steps!r}.")
    if max_epochs is not None and (not isinstance(max_epochs, int) or (max_epochs < 0 and max_epochs != -1)):
        raise ValueError(f"max_epochs must be a non-negative int (or -1 for no limit), got {max_epochs!r}.")
    if not isinstance(max_steps, int) or (max_steps < 0 and max_steps != -1):
        raise ValueError(f"max_steps must be a non-negative int (or -1 for no limit), got {max_steps!r}.")
    if min_epochs is not None and (not isinstance(min_epochs, int) or min_epochs < 0):
        raise ValueError(f"min_epochs must be a non-negative int, got {min_epochs!r}.")
    if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
        raise ValueError(f"accumulate_grad_batches must be a positive int, got {accumulate_grad_batches!r}.")
    if gradient_clip_algorithm not in ("norm", "value"):
        raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value', got {gradient_clip_algorithm!r}.")
    if gradient_clip_val is not None and gradient_clip_val < 0:
        raise ValueError(f"gradient_clip_val must be >= 0, got {gradient_clip_val!r}.")
    if (
        isinstance(val_check_interval, bool)
        or not isinstance(val_check_interval, (int, float))
        or val_check_interval <= 0
    ):
        raise ValueError(
            f"val_check_interval must be a fraction in (0, 1] or a positive int, got {val_check_interval!r}."
        )
    if isinstance(val_check_interval, float) and val_check_interval > 1.0:
        raise ValueError(
            f"val_check_interval={val_check_interval} is a fraction above 1.0; pass an int for a batch count."
        )
    if check_val_every_n_epoch is not None and (
        not isinstance(check_val_every_n_epoch, int) or check_val_every_n_epoch < 1
    ):
        raise ValueError(f"check_val_every_n_epoch must be a positive int or None, got {check_val_every_n_epoch!r}.")
    if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 0:
        raise ValueError(
            f"log_every_n_steps must be a non-negative int (0: no step metrics), got {log_every_n_steps!r}."
        )
    if not isinstance(num_sanity_val_steps, int) or num_sanity_val_steps < -1:
        raise ValueError(f"num_sanity_val_steps must be an int >= -1, got {num_sanity_val_steps!r}.")
    if not isinstance(reload_dataloaders_every_n_epochs, int) or reload_dataloaders_every_n_epochs < 0:
        raise ValueError(
            f"reload_dataloaders_every_n_epochs must be a non-negative int, got {reload_dataloaders_every_n_epochs!r}."
        )
    if not isinstance(fast_dev_run, int) or fast_dev_run < 0:  # bool is an int: True means 1
        raise ValueError(f"fast_dev_run must be a bool or a non-negative int, got {fast_dev_run!r}.")


class Switches(NamedTuple):
    """The Trainer's features that ``barebones`` turns off, resolved: the value given, or the default."""

    enable_checkpointing: bool
    enable_progress_bar: bool
    logger: Any
    log_every_n_steps: int
    enable_model_summary: bool
    num_sanity_val_steps: int


#: Why ``Trainer(barebones=True)`` refuses each argument that would turn on what it turns off.
_BAREBONES_REFUSES = {
    "enable_checkpointing": "writing checkpoints takes time",
    "logger": "logging takes time",
    "enable_progress_bar": "drawing a progress bar takes time",
    "log_every_n_steps": "logging takes time (barebones sets log_every_n_steps=0)",
    "enable_model_summary": "the model summary takes time",
    "num_sanity_val_steps": "the sanity check takes time (barebones sets num_sanity_val_steps=0)",
    "fast_dev_run": "a fast_dev_run is a smoke test of a batch or two, not a measure of speed",
    "detect_anomaly": "anomaly detection slows every backward",
    "profiler": "a profiler times every hook, which takes time",
}

_BAREBONES_NOTICE = (
    "Trainer(barebones=True): everything beside the training loop that may take time is off, so that what "
    "is measured is the loop's own cost:"
    + "".join(
        f"\n - {what}"
        for what in (
            "checkpointing (enable_checkpointing)",
            "the progress bar (enable_progress_bar)",
            "the model summary (enable_model_summary)",
            "logging (logger, log_every_n_steps; self.log and self.log_dict do nothing)",
            "the sanity check (num_sanity_val_steps)",
            "fast_dev_run",
            "anomaly detection (detect_anomaly)",
            "profiling (profiler)",
        )
    )
)

#: Said when a barebones Trainer starts a run (fit, validate, test or predict).
BAREBONES_RUN_NOTICE = (
    "Trainer(barebones=True) is running: it has no progress bar, so print the progress from your module if you "
    "want to follow it."
)


def resolve_switches(
    barebones: bool,
    *,
    enable_checkpointing: bool | None,
    enable_progress_bar: bool | None,
    logger: Any,
    log_every_n_steps: int | None,
    enable_model_summary: bool | None,
    num_sanity_val_steps: int | None,
    fast_dev_run: bool | int,
    detect_anomaly: bool,
    profiler: Any,
) -> Switches:
    """The switches as given, None standing for the default (as in Lightning's signature); under ``barebones``
    all off, and a ValueError naming the first argument given that would turn one on (or is
    ``fast_dev_run``, ``detect_anomaly`` or a ``profiler``).

    ``logger=True`` is ember's default, so barebones cannot tell it was given: it is turned off like the
    default (a Logger or a list of them is refused)."""
    if barebones is not True and barebones is not False:
        raise ValueError(f"barebones must be True or False, got {barebones!r}.")
    if not barebones:
        return Switches(
            True if enable_checkpointing is None else enable_checkpointing,
            True if enable_progress_bar is None else enable_progress_bar,
            logger,
            50 if log_every_n_steps is None else log_every_n_steps,
            bool(enable_model_summary),
            2 if num_sanity_val_steps is None else num_sanity_val_steps,
        )
    given = (  # (argument, its value, whether it turns on what barebones turns off)
        ("enable_checkpointing", enable_checkpointing, bool(enable_checkpointing)),
        ("logger", logger, logger is not True and logger is not None and logger is not False),
        ("enable_progress_bar", enable_progress_bar, bool(enable_progress_bar)),
        ("log_every_n_steps", log_every_n_steps, log_every_n_steps is not None and log_every_n_steps != 0),
        ("enable_model_summary", enable_model_summary, bool(enable_model_summary)),
        ("num_sanity_val_steps", num_sanity_val_steps, num_sanity_val_steps is not None and num_sanity_val_steps != 0),
        ("fast_dev_run", fast_dev_run, fast_dev_run is not False and fast_dev_run != 0),
        ("detect_anomaly", detect_anomaly, bool(detect_anomaly)),
        ("profiler", profiler, profiler is not None),
    )
    for name, value, on in given:
        if on:
            raise ValueError(
                f"Trainer(barebones=True) cannot take {name}={value!r}: barebones mode measures the bare "
                f"training loop, and {_BAREBONES_REFUSES[name]}. Leave {name} out, or drop barebones=True."
            )
    log.info(_BAREBONES_NOTICE)
    return Switches(False, False, False, 0, False, 0)


def wants_loggers(logger: Any) -> bool:
    """Whether ``Trainer(logger=...)`` asks for any logger (what ``fast_dev_run`` replaces with a DummyLogger)."""
    if logger is None or logger is False:
        return False
    return not (isinstance(logger, (list, tuple)) and not logger)


def set_backend_flags(deterministic: bool | str | None, benchmark: bool | None) -> None:
    """``deterministic`` and ``benchmark`` as Lightning sets them (``benchmark`` defaults to False when
    ``deterministic`` is True; None leaves ``torch.backends.cudnn.benchmark`` as it is)."""
    if deterministic is not None:
        if deterministic not in (True, False, "warn"):
            raise ValueError(f"deterministic must be True, False or 'warn', got {deterministic!r}.")
        torch.use_deterministic_algorithms(bool(deterministic), warn_only=deterministic == "warn")
        if deterministic:  # cuBLAS is deterministic only with this workspace setting (as Lightning sets it)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if benchmark not in (None, True, False):
        raise ValueError(f"benchmark must be True, False or None, got {benchmark!r}.")
    if deterministic is True:
        if benchmark is None:
            benchmark = False
        elif benchmark:
            warnings.warn(
                "deterministic=True and benchmark=True: PyTorch ignores cudnn's deterministic setting "
                "while torch.backends.cudnn.benchmark is True.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
    if benchmark is not None:
        torch.backends.cudnn.benchmark = benchmark


def default_epoch_limits(max_steps: int, min_steps: int | None, callbacks: list[Callback]) -> tuple[int, int]:
    """``(max_epochs, min_epochs)`` for a fit that set neither, as Lightning's: 1000 epochs unless ``max_steps`` or
    a ``Timer`` ends the fit (then -1, no limit); at least 1 epoch with ``min_steps`` (so a stop asked for at the
    start is weighed again), else 0."""
    return (1000 if max_steps == -1 and not has_timer(callbacks) else -1), (1 if min_steps is not None else 0)


def has_timer(callbacks: list[Callback]) -> bool:
    return any(isinstance(c, cbs.Timer) for c in callbacks)


def check_limit(name: str, value: int | float | None) -> int | float:
    """A ``limit_*_batches`` / ``overfit_batches`` value: a fraction in [0, 1] or an int count. A float
    above 1.0 with no fractional part is a count (``2.0`` -> 2), as in Lightning; others raise."""
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name} must be a fraction in [0, 1] or a non-negative int number of batches, got {value!r}.")
    if isinstance(value, float) and value > 1.0:
        if not value.is_integer():
            raise ValueError(
                f"{name}={value} is neither a fraction in [0, 1] nor a whole number of batches; pass "
                f"a fraction, or an int such as {int(value)}."
            )
        return int(value)
    return value


def check_root_dir(default_root_dir: Any) -> str:
    """``default_root_dir`` as a path string (the working directory when None)."""
    if default_root_dir is None:
        return os.getcwd()
    path = os.fspath(default_root_dir) if isinstance(default_root_dir, (str, os.PathLike)) else None
    if not isinstance(path, str):
        raise TypeError(
            f"default_root_dir must be a directory path (a str or a pathlib.Path), got {default_root_dir!r} "
            f"({type(default_root_dir).__name__}). Pass where logs and checkpoints go, e.g. "
            "default_root_dir='runs/exp1', or leave it out for the working directory."
        )
    return path


#: The keys of a ``max_time`` dict: ``datetime.timedelta``'s arguments.
_DURATION_KEYS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")


def check_max_time(max_time: Any) -> None:
    """``max_time``: a timedelta, seconds, a dict of timedelta's arguments or "DD:HH:MM:SS" (each error
    names the argument, the bad key or value, and what it takes)."""
    if isinstance(max_time, dict):
        for key, value in max_time.items():
            if key not in _DURATION_KEYS:
                hint = closest(str(key), list(_DURATION_KEYS))
                raise TypeError(
                    f"max_time has the key {key!r}, which is not a unit of time"
                    + (f" (did you mean {hint!r}?)" if hint else "")
                    + f". Its keys are datetime.timedelta's arguments: {', '.join(_DURATION_KEYS)}; for example "
                    "max_time={'hours': 2, 'minutes': 30}."
                )
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"max_time[{key!r}] is {value!r}, not a number; for example max_time={{{key!r}: 2}}.")
    try:
        duration = parse_duration(max_time)
    except (TypeError, ValueError) as err:
        raise type(err)(
            f"max_time is {max_time!r}: {err} It takes a datetime.timedelta, a number of seconds, a dict such as "
            "{'hours': 2}, a 'DD:HH:MM:SS' string, or None for no limit."
        ) from None
    if duration is not None and duration.total_seconds() < 0:
        raise ValueError(f"max_time is {max_time!r}, a negative duration; pass how long training may run, or None.")


#: Lightning ``Trainer`` arguments ember does not take, and why (named in the error instead of a guess).
NOT_TAKEN = {
    "num_nodes": "ember's ddp reads the world (nodes included) from torchrun or SLURM; start it with torchrun",
    "plugins": "ember has no plugin system; pass precision= and strategy= instead",
    "inference_mode": "ember always evaluates under torch.no_grad() (docs/from-lightning.md: where ember deliberately "
    "differs)",
    "use_distributed_sampler": "ember's ddp always gives a map-style loader its own sharded sampler (it "
    "resumes mid-epoch); for another split, use an IterableDataset that splits itself",
    "sync_batchnorm": "convert the module yourself with torch.nn.SyncBatchNorm.convert_sync_batchnorm before fit",
    "model_registry": "ember has no model registry",
}
#: Lightning 1.x arguments (removed in 2.0, where they are plain unknown keywords), and what replaced them.
REMOVED = {
    "gpus": "use accelerator='cuda', devices=n",
    "resume_from_checkpoint": "pass ckpt_path= to trainer.fit",
}


def reject_unknown(unknown: dict[str, Any], init: Callable[..., Any]) -> None:
    """Raise a TypeError for keywords ``Trainer(...)`` does not take, suggesting the closest argument."""
    names = [n for n in inspect.signature(init).parameters if n not in ("self", "unknown")]
    name = sorted(unknown)[0]
    if name in NOT_TAKEN:
        raise TypeError(f"Trainer() got the Lightning argument {name!r}, which ember does not take: {NOT_TAKEN[name]}.")
    if name in REMOVED:
        raise TypeError(f"Trainer() got {name!r}, a Lightning 1.x argument removed in Lightning 2.0: {REMOVED[name]}.")
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else " See help(ember.Trainer) for the arguments it takes."
    raise TypeError(f"Trainer() got an unexpected keyword argument {name!r}.{hint}")


def resolve_profiler(profiler: str | Profiler | None) -> Profiler:
    """``Trainer(profiler=...)``: a name, a Profiler, or None (the pass-through, which costs nothing)."""
    if profiler is None:
        return PassThroughProfiler()
    if isinstance(profiler, Profiler):
        return profiler
    if isinstance(profiler, str) and profiler.lower() in PROFILERS:
        return PROFILERS[profiler.lower()]()
    names = ", ".join(repr(n) for n in PROFILERS)
    close = difflib.get_close_matches(str(profiler).lower(), list(PROFILERS), n=1) if isinstance(profiler, str) else []
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"profiler must be one of {names}, an ember.profilers.Profiler or None, got {profiler!r}.{hint}")


def resolve_devices(accelerator: str, devices: Any) -> tuple[str, list[torch.device]]:
    if accelerator not in _ACCELERATORS:
        raise ValueError(f"Unknown accelerator {accelerator!r}. Use one of {', '.join(_ACCELERATORS)}.")
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "gpu":
        accelerator = "cuda"
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "accelerator='cuda' was requested but CUDA is not available on this machine. "
            "Use accelerator='cpu' (or 'auto')."
        )
    available = torch.cuda.device_count() if accelerator == "cuda" else None
    if devices == "auto":
        # One device, except for GPUs under torchrun or SLURM: then the processes started on this
        # machine, one GPU each (each process taking the first GPU would share it).
        world = detect_world() if accelerator == "cuda" else None
        devices = world.local_world_size if world is not None else 1
    if isinstance(devices, bool) or not isinstance(devices, (int, list, tuple)):
        raise ValueError(f"devices must be a positive int, a list of device indices or 'auto', got {devices!r}.")
    if isinstance(devices, int):
        if devices == -1:
            devices = available if available is not None else (os.cpu_count() or 1)
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}.")
        if available is not None and devices > available:
            raise ValueError(
                f"devices={devices} but only {available} CUDA device(s) are available. Ask for at most {available}."
            )
        ids = list(range(devices))
    else:
        ids = list(devices)
        if not ids or any(not isinstance(i, int) or i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"devices list must hold distinct non-negative device indices, got {devices!r}.")
        if available is not None and max(ids) >= available:
            raise ValueError(
                f"devices={ids} names CUDA device {max(ids)} but only {available} exist (0..{available - 1})."
            )
    if accelerator == "cpu":
        return "cpu", [torch.device("cpu")] * len(ids)
    return "cuda", [torch.device("cuda", i) for i in ids]


def resolve_strategy(
    trainer: Trainer, strategy: str | Strategy, accelerator: str, devices: list[torch.device]
) -> Strategy:
    if isinstance(strategy, Strategy):
        resolved = strategy
    elif isinstance(strategy, str):
        name = "single" if strategy == "auto" and len(devices) == 1 else ("ddp" if strategy == "auto" else strategy)
        resolved = get_strategy(name)
    else:
        raise TypeError(f"strategy must be a name or a Strategy instance, got {type(strategy).__name__}.")
    if resolved.strategy_name == "single" and len(devices) > 1:
        raise ValueError(
            f"strategy='single' runs on one device but devices={len(devices)}. Use strategy='dp' or "
            "'ddp' for several devices, or devices=1."
        )
    resolved.connect(trainer, accelerator, devices)
    return resolved


def build_callbacks(trainer: Trainer, callbacks: Any, switches: Switches, max_time: Any = None) -> list[Callback]:
    """``Trainer(callbacks=...)`` as a list, with the Timer of ``max_time`` and the default progress bar, model
    summary and ModelCheckpoint that ``switches`` turn on."""
    progress_bar, checkpointing = switches.enable_progress_bar, switches.enable_checkpointing
    if callbacks is None:
        callbacks = []
    elif isinstance(callbacks, Callback):
        callbacks = [callbacks]
    callbacks = list(callbacks)
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise TypeError(f"callbacks must be ember.callbacks.Callback instances, got {type(cb).__name__}.")
    check_max_time(max_time)
    if max_time is not None:  # as Lightning: a Timer checking after every step, unless one is given
        if any(isinstance(c, cbs.Timer) for c in callbacks):
            log.info("Ignoring Trainer(max_time=...): the callbacks already contain a Timer.")
        else:
            callbacks.append(cbs.Timer(duration=max_time, interval="step"))
    bars = [c for c in callbacks if isinstance(c, cbs.ProgressBar)]
    if progress_bar and not bars:
        callbacks.append(cbs.ProgressBar())
    elif not progress_bar and bars:  # as Lightning, which refuses this too
        raise ValueError(
            f"Trainer(enable_progress_bar=False) but a {type(bars[0]).__name__} is in callbacks: remove the "
            "progress bar from callbacks, or leave enable_progress_bar=True."
        )
    if switches.enable_model_summary and not any(isinstance(c, cbs.ModelSummary) for c in callbacks):
        callbacks.append(cbs.ModelSummary())
    checkpoint_cls = getattr(cbs, "ModelCheckpoint", None)
    if checkpoint_cls is not None:
        has_checkpoint = any(isinstance(c, checkpoint_cls) for c in callbacks)
        if checkpointing and not has_checkpoint:
            callbacks.append(checkpoint_cls())
        elif not checkpointing and has_checkpoint:  # (under fast_dev_run too: it then saves nothing)
            raise ValueError("enable_checkpointing=False but a ModelCheckpoint is in callbacks; remove one of them.")
    return callbacks


def checkpoints_last(callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` with the checkpointing ones (every ``Checkpoint``: ModelCheckpoint, OnExceptionCheckpoint, a
    user's subclass) moved to the end, the others keeping their order: as Lightning, so a checkpoint saves what
    every other callback did at that hook (an EarlyStopping counter, a logger's step) whatever order the user
    listed them in."""
    return [c for c in callbacks if not isinstance(c, Checkpoint)] + [c for c in callbacks if isinstance(c, Checkpoint)]


def build_loggers(trainer: Trainer, logger: Any) -> list[Logger]:
    if logger is None or logger is False:
        return []
    if logger is True:
        return [default_logger(trainer.default_root_dir)]
    if isinstance(logger, Logger):
        return [logger]
    loggers = list(logger)
    for lg in loggers:
        if not isinstance(lg, Logger):
            raise TypeError(f"logger must be a bool or ember Logger instances, got {type(lg).__name__}.")
    return loggers


def check_sharded_model_hook(module: Any, defines_configure_model: bool) -> None:
    """A module overriding Lightning's deprecated ``configure_sharded_model``: an error when it overrides
    ``configure_model`` too (one hook builds the layers), else a deprecation warning (the hook still runs)."""
    name = type(module).__name__
    if defines_configure_model:
        raise RuntimeError(
            f"{name} overrides both configure_model and configure_sharded_model, Lightning's deprecated name for "
            "it. Move what configure_sharded_model does into configure_model and delete configure_sharded_model."
        )
    warnings.warn(
        f"{name}.configure_sharded_model is deprecated (Lightning's older name); rename it configure_model, "
        "which runs at the same point.",
        DeprecationWarning,
        stacklevel=user_stacklevel(),
    )
