"""A module's weights from a checkpoint: checked against the module before anything is loaded, keys
matched across ``torch.compile``, and ``TrainModule.load_from_checkpoint``'s reading (``read_for_module``),
which imports nothing of ember but ``hparams`` and this package, so that every layer may use it (the
module reads through it, not through the trainer)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ember.checkpoint.format import CheckpointError
from ember.checkpoint.reading import load
from ember.hparams import build_from_hparams
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.module import TrainModule

_M = TypeVar("_M", bound="TrainModule")


def check_state_dict(module: torch.nn.Module, state_dict: dict[str, Any], path: str, exact_dtype: bool = False) -> None:
    """Raise, changing nothing, unless ``state_dict`` has exactly ``module``'s keys and shapes, and
    dtypes of the same kind (floating, complex, integer, bool; with ``exact_dtype`` the same dtypes).

    ``load_state_dict`` would silently cast an int64 tensor into a float32 parameter (or round a
    float into an integer buffer); a resume that claims to be exact must not.
    """
    if not isinstance(state_dict, dict):
        raise CheckpointError(
            f"Checkpoint {path!r} has a 'state_dict' entry that is a {type(state_dict).__name__}, "
            "not a dict of tensors. Nothing was loaded."
        )
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    shapes, dtypes = [], []
    for k, v in own.items():
        saved = state_dict.get(k)
        if k not in state_dict or not isinstance(v, torch.Tensor):
            continue
        if not isinstance(saved, torch.Tensor):
            dtypes.append(f"{k}: checkpoint holds a {type(saved).__name__}, not a tensor")
        elif saved.shape != v.shape:
            shapes.append(f"{k}: checkpoint {tuple(saved.shape)} vs module {tuple(v.shape)}")
        elif saved.dtype != v.dtype and (exact_dtype or _kind(saved.dtype) != _kind(v.dtype)):
            dtypes.append(f"{k}: checkpoint {saved.dtype} vs module {v.dtype}")
    if missing or unexpected or shapes or dtypes:
        parts = []
        if missing:
            parts.append(f"missing keys (in the module, not in the checkpoint): {_short(missing)}")
        if unexpected:
            parts.append(f"unexpected keys (in the checkpoint, not in the module): {_short(unexpected)}")
        if shapes:
            parts.append(f"shape mismatches: {_short(shapes)}")
        if dtypes:
            parts.append(f"dtype mismatches: {_short(dtypes)}")
        raise CheckpointError(
            f"Checkpoint {path!r} does not fit {type(module).__name__}: "
            + "; ".join(parts)
            + ". Was it saved from a different model or configuration (precision=...)? "
            "Nothing was loaded."
        )


def match_compiled_keys(module: torch.nn.Module, state_dict: Any) -> Any:
    """``state_dict`` with its keys renamed to ``module``'s where they differ only by ``torch.compile``'s
    ``_orig_mod`` level (a submodule compiled when the checkpoint was saved and not now, or the reverse);
    otherwise ``state_dict`` as it is (``check_state_dict`` then names what does not fit)."""
    own = list(module.state_dict())
    if not isinstance(state_dict, dict) or set(state_dict) == set(own):
        return state_dict

    def plain(key: str) -> str:
        return key.replace("._orig_mod.", ".").removeprefix("_orig_mod.")

    by_plain = {plain(k): k for k in own}
    renamed = {by_plain.get(plain(k), k): v for k, v in state_dict.items()}
    return renamed if len(by_plain) == len(own) and set(renamed) == set(own) else state_dict


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"


def _short(items: list[str], n: int = 10) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def read_for_module(
    path: str,
    cls: type[_M],
    overrides: dict[str, Any],
    strict: bool | None = True,
    map_location: Any = "cpu",
    weights_only: bool = True,
) -> _M:
    """Build ``cls`` from the hyper-parameters saved in ``path`` (``overrides`` win) and load its weights.

    As Lightning: the saved hyper-parameters updated with ``overrides`` are the constructor's keyword
    arguments; those it does not accept are left out (unless it takes ``**kwargs``), with a warning
    for the overrides; when ``save_hyperparameters(cfg)`` saved one dict argument (the checkpoint's
    ``hparams_name``), they are passed as that argument.
    """
    ckpt = load(path, map_location=map_location, lightning=True, weights_only=weights_only)
    try:
        module = build_from_hparams(cls, ckpt.get("hyper_parameters"), ckpt.get("hparams_name"), overrides)
    except TypeError as err:
        raise CheckpointError(
            f"Could not build {cls.__name__} from the hyper-parameters saved in {path!r}: {err}. "
            "Pass the missing arguments as keyword overrides to load_from_checkpoint, or call "
            "save_hyperparameters() in __init__."
        ) from err
    if strict is None:  # the module's own choice (TrainModule.strict_loading)
        strict = module.strict_loading
    elif strict and not module.strict_loading:
        raise ValueError(
            f"load_from_checkpoint(..., strict=True) conflicts with {cls.__name__}.strict_loading=False. "
            "Pass the same value as the module sets, or leave strict out."
        )
    module.configure_model()  # layers made there exist before the weights are loaded (a no-op by default)
    module.on_load_checkpoint(ckpt)  # first, as Lightning: it may rewrite ckpt["state_dict"]
    ckpt["state_dict"] = match_compiled_keys(module, ckpt["state_dict"])
    if strict:
        check_state_dict(module, ckpt["state_dict"], path)
    keys = module.load_state_dict(ckpt["state_dict"], strict=strict)
    if not strict and (keys.missing_keys or keys.unexpected_keys):  # as Lightning: said, not silent
        warnings.warn(
            f"load_from_checkpoint(strict=False) on {path!r}: keys of {cls.__name__} not in the checkpoint "
            f"(left as built): {keys.missing_keys}; keys of the checkpoint not in {cls.__name__} (ignored): "
            f"{keys.unexpected_keys}.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return module
