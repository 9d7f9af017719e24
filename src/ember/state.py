"""A fit's state as a registry of named parts: what a checkpoint saves and a resume restores.

As torchtnt's ``app_state()``: whoever runs the fit (the Trainer, ``ember/trainer/state.py``) registers
each piece of its state under a name, and the code that saves or restores a fit works through this
registry alone: ``ember.checkpoint`` takes a :class:`State` and the strategy, never the Trainer. A part
is any object with ``state_dict()`` and ``load_state_dict(state)``: torch's ``Stateful`` protocol
(``torch.distributed.checkpoint.stateful``), so ``dict(state)`` is what ``torch.distributed.checkpoint.save``
takes as it is. (Its ``load`` fills state dicts in place, so it needs each part's ``state_dict()`` to have
the saved structure already, which parts that grow during a run, the optimizers' states or the epoch's
running sums, do not have at its start: sharded checkpoints will have to arrange for that. ember's own files
are written with ``torch.save``.)

A part's state is the checkpoint entries it owns: ``state_dict()`` returns them under their keys in the
file (``{"progress": {...}}``, or several, as ``{"optimizer_states": [...], "lr_schedulers": [...]}``),
and ``load_state_dict(checkpoint)`` reads them from the whole checkpoint, where a part may also read an
entry another part writes (whether the optimizers had stepped, from ``progress``). So a file is the
parts' states side by side, under keys that stay those of earlier versions whatever the parts are.

Each part is registered with the moment a resume loads it, one of :data:`MOMENTS`, in Lightning's order:
``"modules"`` before ``configure_optimizers`` (the weights, the datamodule, the callbacks),
``"training"`` once the optimizers exist (optimizers, schedulers, precision, progress, metrics), ``"data"``
once the train loader exists (its position, the RNG states); and with ``weights=True`` when a
weights-only checkpoint holds it too. Registration order is the order of loading within a moment.

A part may also have these methods, which the checkpoint code calls when they exist:

=================================  ====================================================================
``check(checkpoint, source)``      raise (``ember.checkpoint.validation.Invalid``, or a
                                   ``CheckpointError``) when its entries do not fit this run; changes
                                   nothing. ``source`` names the file, for messages.
``snapshot()``, ``rollback(s)``    what a failed resume puts back (default: a deep copy of
                                   ``state_dict()``, loaded again: :func:`take_snapshot`)
``summary()``                      entries every checkpoint carries, weights-only ones too, for readers
                                   that restore nothing (``load_from_checkpoint``'s hyper-parameters,
                                   the epoch and step auto-resume names)
``on_save_checkpoint(checkpoint)``  sees the whole checkpoint once every part's state is in, and may
                                   add to it (the callbacks' and the module's hooks); called in the
                                   reverse of registration order, so the module, registered first, has
                                   the last word, as in Lightning
=================================  ====================================================================
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

#: When a resume loads a part: before ``configure_optimizers``, once the optimizers exist, once the
#: train loader exists (Lightning's order; ``ember/checkpoint/restore.py``).
MOMENTS: tuple[str, ...] = ("modules", "training", "data")
Moment = Literal["modules", "training", "data"]


@runtime_checkable
class Stateful(Protocol):
    """torch's ``Stateful``: what a part of the fit's state is."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class _Entry:
    part: Stateful
    moment: str
    weights: bool


class State(Mapping[str, Stateful]):
    """The fit's parts by name (a read-only mapping; :meth:`register` adds and replaces them).

    Itself ``Stateful``: :meth:`state_dict` is every part's entries side by side (what a full checkpoint
    holds of the fit; a part may gather from every rank, so call it on every rank), :meth:`load_state_dict`
    loads every part from such a dict, unchecked (``ember.checkpoint.restore`` is the checked way).
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def register(self, name: str, part: Stateful, moment: Moment, *, weights: bool = False) -> None:
        """Add ``part`` under ``name``; a part registered again under a name takes the old one's place.

        Args:
            name: the part's name (``"optimizers"``).
            part: its ``state_dict`` / ``load_state_dict`` (and the optional methods above).
            moment: when a resume loads it, one of :data:`MOMENTS`.
            weights: whether weights-only checkpoints hold it too.
        """
        if moment not in MOMENTS:
            raise ValueError(f"A part's moment is one of {MOMENTS}, got {moment!r} for {name!r}.")
        if not isinstance(part, Stateful):
            raise TypeError(f"Part {name!r} is a {type(part).__name__}, without state_dict() / load_state_dict().")
        self._entries[name] = _Entry(part, moment, weights)

    def __getitem__(self, name: str) -> Stateful:
        return self._entries[name].part

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def parts(self, moment: str | None = None, *, weights_only: bool = False) -> list[tuple[str, Stateful]]:
        """``(name, part)`` in registration order: those a resume loads at ``moment`` (None: all), and
        with ``weights_only`` those a weights-only checkpoint holds."""
        return [
            (name, e.part)
            for name, e in self._entries.items()
            if (moment is None or e.moment == moment) and (e.weights or not weights_only)
        ]

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for _, part in self.parts():
            out.update(part.state_dict())
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for _, part in self.parts():
            part.load_state_dict(state_dict)

    def snapshot(self, names: list[str]) -> dict[str, Any]:
        """What :meth:`rollback` puts back into the parts ``names``."""
        return {name: take_snapshot(self[name]) for name in names}

    def rollback(self, snapshots: dict[str, Any]) -> None:
        for name, snapshot in snapshots.items():
            put_back(self[name], snapshot)


def take_snapshot(part: Stateful) -> Any:
    """``part.snapshot()``, or a deep copy of its ``state_dict()``."""
    own = getattr(part, "snapshot", None)
    return own() if own is not None else copy.deepcopy(part.state_dict())


def put_back(part: Stateful, snapshot: Any) -> None:
    """``part.rollback(snapshot)``, or ``load_state_dict`` of the copy :func:`take_snapshot` took."""
    own = getattr(part, "rollback", None)
    if own is not None:
        own(snapshot)
    else:
        part.load_state_dict(snapshot)
