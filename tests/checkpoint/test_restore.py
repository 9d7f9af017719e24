"""``ember.checkpoint.restore``: one restore for every part of a fit's state. A bad part anywhere, checked
or loaded, at any moment, leaves every part (itself included) as it was before the resume."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import ember
from ember.callbacks import Callback
from ember.checkpoint import CheckpointError, contents, validation
from ember.checkpoint.restore import Restore
from ember.data.resumable import resumable_sampler_of
from ember.state import MOMENTS, State
from ember.strategies.single import SingleDeviceStrategy
from ember.trainer.progress import FitProgress
from tests.checkpoint.fixture_run import FixtureData, FixtureNet


# ---------------------------------------------------------------------------------------------- any parts
class Counter:
    """A part whose state is one entry, ``{name: {"n": ...}}``; ``fail`` makes its check or its load of the
    checkpoint's values fail (the load after changing its state: the worst case); ``"always"``, every load."""

    def __init__(self, name: str, n: int, fail: str | None = None) -> None:
        self.name, self.n, self.fail = name, n, fail

    def state_dict(self) -> dict[str, Any]:
        return {self.name: {"n": self.n}}

    def check(self, checkpoint: dict[str, Any], source: str) -> None:
        if self.fail == "check":
            validation.check(self.name, self._bad, checkpoint[self.name])

    @staticmethod
    def _bad(value: Any) -> None:
        raise validation.Bad(f"n is {value['n']}, which this run cannot take")

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        self.n = checkpoint[self.name]["n"]
        if self.fail == "always" or self.fail == "load" and self.n:
            raise RuntimeError(f"{self.name} failed half-way")


class Required:
    """The entries every file a fit resumes from has (weights, progress), for a state of counters only."""

    def state_dict(self) -> dict[str, Any]:
        return {"state_dict": {}, "progress": FitProgress().state_dict()}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        pass


def saved_state(tmp_path: Any) -> tuple[State, str]:
    """Nine counters, three per moment, saved with n = 1..9 and then set to 0."""
    state = State()
    state.register("required", Required(), "modules", weights=True)
    for i in range(9):
        state.register(f"p{i}", Counter(f"p{i}", i + 1), MOMENTS[i // 3])
    path = contents.save(state, SingleDeviceStrategy("cpu"), tmp_path / "parts.ckpt")
    for counter in counters(state):
        counter.n = 0
    return state, path


def counters(state: State) -> list[Counter]:
    return [part for _, part in state.parts() if isinstance(part, Counter)]


def test_a_restore_loads_each_moments_parts_when_it_is_reached(tmp_path):
    state, path = saved_state(tmp_path)
    restore = Restore(state, path)
    for reached, moment in enumerate(MOMENTS):
        restore.load(moment)
        assert [c.n for c in counters(state)] == [i + 1 if i // 3 <= reached else 0 for i in range(9)]


@pytest.mark.parametrize("failing", range(9))
@pytest.mark.parametrize("how", ["check", "load"])
def test_a_bad_part_anywhere_leaves_every_part_as_it_was(tmp_path, failing, how):
    state, path = saved_state(tmp_path)
    counters(state)[failing].fail = how
    restore = Restore(state, path)
    with pytest.raises((CheckpointError, RuntimeError)) as info:
        for moment in MOMENTS:
            restore.load(moment)
    assert [c.n for c in counters(state)] == [0] * 9
    if how == "check":
        assert f"'p{failing}' entry: n is {failing + 1}" in str(info.value) and "Nothing was loaded" in str(info.value)


def test_a_part_that_cannot_be_put_back_is_named_and_the_others_are_put_back(tmp_path):
    state, path = saved_state(tmp_path)
    counters(state)[4].fail = "always"
    restore = Restore(state, path)
    restore.load("modules")
    with pytest.warns(RuntimeWarning, match="could not put back a part.*Counter: RuntimeError: p4 failed"):
        with pytest.raises(RuntimeError, match="p4 failed half-way"):
            restore.load("training")
    assert [c.n for c in counters(state)] == [0] * 9


def test_a_complete_restore_keeps_no_snapshot_and_says_so(tmp_path):
    state, path = saved_state(tmp_path)
    done: list[str] = []
    restore = Restore(state, path, on_complete=lambda: done.append("complete"))
    for moment in MOMENTS:
        restore.load(moment)
    assert done == ["complete"] and restore._loaded == []


# ---------------------------------------------------------------------------------------------- a fit's parts
class Kept(Callback):
    """A callback with state of its own."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": list(self.seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = list(state["seen"])


def trainer(root: Any, callbacks: list[Callback]) -> ember.Trainer:
    return ember.Trainer(
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        callbacks=callbacks,
    )


class SaveAt(Callback):
    def __init__(self, path: str, step: int) -> None:
        self.path, self.step = path, step

    def on_train_step_boundary(self, trainer: Any, module: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


@pytest.fixture(scope="module")
def mid_epoch(tmp_path_factory: Any) -> str:
    """A checkpoint of every part, mid-epoch (step 3 of 8)."""
    root = tmp_path_factory.mktemp("saved")
    path = str(root / "mid.ckpt")
    ember.seed_everything(3)
    trainer(root, [Kept(), SaveAt(path, 3)]).fit(FixtureNet(), datamodule=FixtureData())
    return path


def observed(module: FixtureNet, dm: FixtureData, kept: Kept, t: ember.Trainer) -> dict[str, Any]:
    """What each part of a fit holds, as far as a user sees it."""
    opts = t.fit_state.optim
    sampler = resumable_sampler_of(t.fit_state.data.train_loader)
    return {
        "module": copy.deepcopy(module.state_dict()),
        "datamodule": dm.made,
        "callbacks": list(kept.seen),
        "optimizers": [bool(o.state) for o in opts.optimizers] + [c.scheduler.last_epoch for c in opts.schedulers],
        "precision": t.fit_state.precision.state_dict(),
        "progress": t.fit_state.progress.state_dict(),
        "metrics": dict(t.callback_metrics),
        "position": None if sampler is None else sampler.state_dict()["position"],
        "rng": torch.get_rng_state(),
    }


PARTS = ["module", "datamodule", "callbacks", "optimizers", "precision", "progress", "metrics", "position", "rng"]


def test_the_fit_registers_every_part_of_its_state_in_the_order_it_is_resumed():
    state = ember.Trainer(logger=False).fit_state
    assert list(state) == PARTS
    assert [[name for name, _ in state.parts(m)] for m in MOMENTS] == [PARTS[:3], PARTS[3:7], PARTS[7:]]
    assert [name for name, _ in state.parts(weights_only=True)] == ["module"]


@pytest.mark.parametrize("bad", PARTS)
def test_a_part_that_fails_as_it_loads_leaves_every_part_of_the_fit_as_it_was(tmp_path, monkeypatch, mid_epoch, bad):
    # The part loads its entries, then fails: the worst case, since it has changed itself already.
    cls = type(ember.Trainer(logger=False).fit_state[bad])
    real_load = cls.load_state_dict

    failed: list[Any] = []

    def load_then_fail(self: Any, checkpoint: dict[str, Any]) -> None:
        real_load(self, checkpoint)
        if not failed:  # (a part without a rollback of its own is put back by loading its copy again)
            failed.append(self)
            raise RuntimeError(f"the {bad} part failed")

    monkeypatch.setattr(cls, "load_state_dict", load_then_fail)
    module, dm, kept = FixtureNet(), FixtureData(), Kept()
    t = trainer(tmp_path, [kept])
    moment = next(m for m in MOMENTS if bad in [name for name, _ in t.fit_state.parts(m)])
    # What the fit holds when the failing moment starts, and once the failure comes out of the fit's run.
    at_moment: dict[str, Any] = {}
    after: dict[str, Any] = {}
    real_restore, real_fit = Restore.load, t._fit

    def restore(self: Restore, at: str) -> None:
        if at == moment:
            at_moment.update(observed(module, dm, kept, t))
        real_restore(self, at)

    def fit(*args: Any) -> None:
        try:
            real_fit(*args)
        finally:
            after.update(observed(module, dm, kept, t))

    monkeypatch.setattr(Restore, "load", restore)
    monkeypatch.setattr(t, "_fit", fit)
    start = observed(module, dm, kept, t)
    with pytest.raises(RuntimeError, match=f"the {bad} part failed"):
        t.fit(module, datamodule=dm, ckpt_path=mid_epoch)
    # What every moment loaded is put back, the earlier moments' too: the module, the datamodule and the
    # callbacks as they were given (their attributes as a whole), the progress and metrics of a fit that has
    # not started, ...
    for name in ("module", "datamodule", "callbacks", "precision", "progress", "metrics"):
        assert _same(after[name], start[name]), (bad, name)
    assert after["optimizers"] == ([] if moment == "modules" else [False, 0]), bad  # no state, not stepped
    # ... the sampler and the random generators as the failing moment found them.
    assert after["position"] == at_moment["position"] == (0 if moment == "data" else None), bad
    assert torch.equal(after["rng"], at_moment["rng"]), bad


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b
