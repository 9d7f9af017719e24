"""What ddp tells a user in its own words: too many CPU ranks for the cores, and a parameter without a gradient
(the engine's messages name its wrapper; a Trainer user chooses through the strategy)."""

from __future__ import annotations

from ember.parallel.advice import UnusedParameterAdvice

__all__ = ["oversubscription_message", "unused_parameter_advice"]


def oversubscription_message(ranks: int, cores: int) -> str | None:
    """What to tell a user whose ``ranks`` CPU processes on one machine outnumber its ``cores`` (None if not)."""
    if ranks <= cores:
        return None
    return (
        f"{ranks} CPU ranks run on this machine, which has {cores} core(s) for this job: the ranks take turns "
        f"on the cores, so training runs slower than with devices={cores}. Use devices={cores} (or fewer) on "
        "this machine, more machines, or GPUs."
    )


def unused_parameter_advice(start_method: str, warn: bool) -> UnusedParameterAdvice:
    """What the engine's messages about parameters without a gradient say under the Trainer, whose users
    choose ``find_unused_parameters`` through the strategy, never by constructing the wrapper.

    Args:
        start_method: the strategy's (``"spawn"`` names the ``ddp_spawn_...`` strategies).
        warn: whether this process warns that every parameter got a gradient (one rank per job does).
    """
    name = "ddp_spawn" if start_method == "spawn" else "ddp"
    missing = (
        f'Under strategy="{name}" every parameter that requires grad has to get a gradient in every backward: '
        "each rank waits for all of them before averaging. The usual causes are manual optimization with "
        "self.toggle_optimizer(opt), which sets requires_grad=False on the other optimizers' parameters, so "
        "they get no gradient in that backward, and a forward that skips layers in some steps (a branch, a head "
        "used only at times). Either way, which parameters get a gradient changes from one backward to the "
        "next, so ddp has to look for them after every forward: use "
        f'Trainer(strategy="{name}_find_unused_parameters_true") or '
        f"Trainer(strategy=DDPStrategy(find_unused_parameters=True{_spawn_arg(start_method)})) (an autograd-graph "
        "walk per step). Layers you never train: set requires_grad=False on them before fit, or remove them."
    )
    all_used = (
        "The autograd-graph walk costs time every step; if your model always uses all its parameters, use "
        f'Trainer(strategy="{name}") (or DDPStrategy(find_unused_parameters=False{_spawn_arg(start_method)})).'
    )
    return UnusedParameterAdvice(missing=missing, all_used=all_used if warn else None)


def _spawn_arg(start_method: str) -> str:
    return ', start_method="spawn"' if start_method == "spawn" else ""
