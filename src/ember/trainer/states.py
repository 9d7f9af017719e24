"""``trainer.state``: what the Trainer is doing, in Lightning's terms (``TrainerState`` and its enums).

``status`` says whether a run is going (``RUNNING``), ended (``FINISHED``) or ended by an exception
(``INTERRUPTED``: Ctrl-C, a stop signal, or any error); ``fn`` is the entry point of the current or last
run (``fit`` / ``validate`` / ``test`` / ``predict``); ``stage`` the part of it running now
(``train``, ``sanity_check``, ``validate``, ``test``, ``predict``; None outside a run). The enums are
strings that compare equal to their value in any case (``TrainerFn.FITTING == "fit"``), as Lightning's.

ember's earlier ``trainer.state`` was one string ("initializing", "fitting", "validating", "testing",
"predicting", "finished"): that word is ``trainer.state.activity``, and the object still compares equal to
it, so code written against it keeps working.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ember.utilities.enums import LightningEnum

if TYPE_CHECKING:
    from ember.types import Stage

__all__ = ["RunningStage", "TrainerFn", "TrainerState", "TrainerStatus"]


class TrainerStatus(LightningEnum):
    """Whether the Trainer is being built, running, done, or stopped by an exception."""

    INITIALIZING = "initializing"
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"

    @property
    def stopped(self) -> bool:
        """The run ended, by finishing or by an exception."""
        return self in (TrainerStatus.FINISHED, TrainerStatus.INTERRUPTED)


class TrainerFn(LightningEnum):
    """The entry point running: ``Trainer.fit``, ``validate``, ``test`` or ``predict``."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class RunningStage(LightningEnum):
    """The part of an entry point running now (a fit runs ``train``, ``sanity_check`` and ``validate``)."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    @property
    def evaluating(self) -> bool:
        """Validating, testing or sanity checking."""
        return self in (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)

    @property
    def dataloader_prefix(self) -> str | None:
        """The prefix of the loader hooks this stage reads (``val`` for the sanity check and validation)."""
        if self in (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING):
            return "val"
        return str(self.value)


# ember's earlier one-string state, by entry point, for the comparisons code written against it makes.
_RUNNING_NAMES = {
    TrainerFn.FITTING: "fitting",
    TrainerFn.VALIDATING: "validating",
    TrainerFn.TESTING: "testing",
    TrainerFn.PREDICTING: "predicting",
}


class TrainerState:
    """The Trainer's ``status``, ``fn`` and ``stage``.

    ``stage`` is read from the Trainer each time (the loops move through stages without telling this
    object); assigning it is refused, since the Trainer decides it.
    """

    def __init__(self, stage_of: Callable[[], RunningStage | None] | None = None) -> None:
        self.status = TrainerStatus.INITIALIZING
        self.fn: TrainerFn | None = None
        self._stage_of = stage_of
        self._open = False  # from an entry point's start to the end of its teardown

    @property
    def stage(self) -> RunningStage | None:
        if self._stage_of is None or not self._open:
            return None
        return self._stage_of()

    @property
    def finished(self) -> bool:
        return self.status == TrainerStatus.FINISHED

    @property
    def stopped(self) -> bool:
        return self.status.stopped

    def start(self, fn: Stage | TrainerFn) -> None:
        """An entry point begins: ``fn`` is its name ("fit", "validate", "test" or "predict")."""
        self.fn = TrainerFn(fn)
        self.status = TrainerStatus.RUNNING
        self._open = True

    def interrupt(self) -> None:
        """An exception is ending the run (its ``on_exception`` hooks and teardown still run in its stage)."""
        self.status = TrainerStatus.INTERRUPTED

    def close(self) -> None:
        """The run's teardown is done: finished, unless an exception ended it."""
        if self.status == TrainerStatus.RUNNING:
            self.status = TrainerStatus.FINISHED
        self._open = False

    @property
    def activity(self) -> str:
        """ember's one-word state: "initializing", "fitting", "validating", "testing", "predicting" (from an
        entry point's start to the end of its teardown) or "finished"."""
        if self.status == TrainerStatus.INITIALIZING:
            return "initializing"
        if not self._open or self.fn is None:
            return "finished"
        return _RUNNING_NAMES[self.fn]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):  # ember's earlier string state
            return self.activity == other
        if isinstance(other, TrainerState):
            return (self.status, self.fn, self.stage, self.activity) == (
                other.status,
                other.fn,
                other.stage,
                other.activity,
            )
        return NotImplemented

    def __hash__(self) -> int:
        # As the string it equals, so code that used ember's earlier string state as a dict key still works
        # (Lightning's dataclass has no hash). It changes as the run goes on, as that string did.
        return hash(self.activity)

    def __repr__(self) -> str:
        return f"TrainerState(status={self.status!r}, fn={self.fn!r}, stage={self.stage!r})"
