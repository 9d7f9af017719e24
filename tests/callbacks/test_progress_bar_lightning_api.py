"""Lightning's TQDMProgressBar API on ember's bar: the ``init_*_tqdm`` hooks, the ``*_progress_bar`` references,
``TQDM_MINITERS``, ``process_position``, ``refresh_rate`` and pickling a Trainer that holds a bar."""

from __future__ import annotations

import copy
import io
import pickle
import re
import sys
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ProgressBar, TQDMProgressBar


class Tiny(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.layer(batch[0]).pow(2).mean(), prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.layer(batch[0]).pow(2).mean())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(n: int = 16, batch_size: int = 4) -> DataLoader:
    return DataLoader(
        TensorDataset(torch.randn(n, 4, generator=torch.Generator().manual_seed(0))), batch_size=batch_size
    )


def trainer(bar: ProgressBar, **kwargs: Any) -> ember.Trainer:
    kwargs.setdefault("max_epochs", 2)
    kwargs.setdefault("num_sanity_val_steps", 1)
    return ember.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=[bar], **kwargs)


class Recorded(TQDMProgressBar):
    """Keeps every bar its init_*_tqdm hooks return, by stage, with a format of its own for the training bar."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.made: list[tuple[str, Any]] = []

    def _keep(self, stage: str, bar: Any) -> Any:
        self.made.append((stage, bar))
        return bar

    def init_train_tqdm(self) -> Any:
        bar = super().init_train_tqdm()
        bar.bar_format = "MINE {desc} {n_fmt}/{total_fmt} {postfix}"
        return self._keep("train", bar)

    def init_sanity_tqdm(self) -> Any:
        return self._keep("sanity", super().init_sanity_tqdm())

    def init_validation_tqdm(self) -> Any:
        return self._keep("validate", super().init_validation_tqdm())

    def init_test_tqdm(self) -> Any:
        return self._keep("test", super().init_test_tqdm())

    def init_predict_tqdm(self) -> Any:
        return self._keep("predict", super().init_predict_tqdm())

    def bars(self, stage: str) -> list[Any]:
        return [bar for s, bar in self.made if s == stage]


def test_each_init_tqdm_hook_makes_the_bar_its_stage_updates() -> None:
    out = io.StringIO()  # not a terminal: an overriding subclass still gets tqdm bars (Lightning's always are)
    bar = Recorded(stream=out)
    t = trainer(bar)
    module = Tiny()
    t.fit(module, loader(), loader(8))
    assert not bar.is_line_mode
    assert [s for s, _ in bar.made] == ["sanity", "train", "validate", "validate"]  # one training bar, reset
    (train,) = bar.bars("train")
    assert bar.train_progress_bar is train
    assert (train.n, train.total, train.desc) == (4, 4, "Epoch 1/1: ")
    # the returned bar's format is the one drawn, epoch after epoch
    assert re.search(r"MINE Epoch 0/1: +4/4 , train_loss=", out.getvalue())
    assert re.search(r"MINE Epoch 1/1: +4/4 , train_loss=\S+ val_loss=", out.getvalue())
    sanity, _, last_val = bar.bars("sanity") + bar.bars("validate")
    assert (sanity.n, sanity.total) == (1, 1)
    assert bar.val_progress_bar is last_val and (last_val.n, last_val.total) == (2, 2)
    with pytest.raises(TypeError, match=r"`Recorded._test_progress_bar` reference has not been set yet"):
        _ = bar.test_progress_bar

    t.test(module, loader(12))
    t.predict(module, loader(8))
    assert bar.test_progress_bar is bar.bars("test")[0] and bar.test_progress_bar.n == 3
    assert bar.predict_progress_bar is bar.bars("predict")[0] and bar.predict_progress_bar.n == 2
    assert bar.train_progress_bar is train  # the last fit's bar, still there after other runs


def test_the_bars_while_running_are_the_live_ones() -> None:
    seen: dict[str, Any] = {}

    class Watch(TQDMProgressBar):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
            seen.setdefault("train", []).append((self.train_progress_bar.n, self.train_progress_bar.disable))

        def on_validation_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            super().on_validation_batch_end(trainer, module, *args)
            seen.setdefault("val", []).append((self.val_progress_bar.desc, self.val_progress_bar.n))

    bar = Watch(mode="bar", stream=io.StringIO(), refresh_rate=1)
    trainer(bar, max_epochs=1).fit(Tiny(), loader(), loader(8))
    assert seen["train"] == [(1, False), (2, False), (3, False), (4, False)]  # open while it runs
    assert seen["val"] == [("Sanity check: ", 1), ("Validation: ", 1), ("Validation: ", 2)]
    assert bar.train_progress_bar.disable  # closed when the fit ended, and still there


def test_leave_true_makes_one_training_bar_per_epoch() -> None:
    bar = Recorded(stream=io.StringIO(), leave=True)
    trainer(bar, max_epochs=3, num_sanity_val_steps=0).fit(Tiny(), loader())
    bars = bar.bars("train")
    assert [b.desc for b in bars] == ["Epoch 0/2: ", "Epoch 1/2: ", "Epoch 2/2: "]
    assert all(b.n == 4 and b.leave for b in bars)
    assert bar.train_progress_bar is bars[-1]


def test_the_setter_replaces_the_bar_being_drawn() -> None:
    replacement: list[Any] = []

    class Swap(TQDMProgressBar):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            super().on_train_epoch_start(trainer, module)
            new = self.init_train_tqdm()
            new.reset(total=self.train_progress_bar.total)
            replacement.append(new)
            self.train_progress_bar = new

    bar = Swap(mode="bar", stream=io.StringIO())
    trainer(bar, max_epochs=1, num_sanity_val_steps=0).fit(Tiny(), loader())
    assert bar.train_progress_bar is replacement[0] and replacement[0].n == 4  # the run updated the new bar
    bar.train_progress_bar = None
    with pytest.raises(TypeError, match="has not been set yet"):
        _ = bar.train_progress_bar


def test_the_references_are_empty_before_a_run_and_in_line_mode() -> None:
    bar = TQDMProgressBar()
    for name in ("train_progress_bar", "val_progress_bar", "test_progress_bar", "predict_progress_bar"):
        with pytest.raises(TypeError, match=rf"`TQDMProgressBar._{name}` reference has not been set yet"):
            getattr(bar, name)
    lines = TQDMProgressBar(stream=io.StringIO())  # a file: timed lines, no tqdm bar
    trainer(lines, max_epochs=1).fit(Tiny(), loader(), loader(8))
    assert lines.is_line_mode
    with pytest.raises(TypeError, match="in bar mode"):
        _ = lines.train_progress_bar


def test_process_position_moves_the_bars_two_lines_per_run() -> None:
    bar = Recorded(stream=io.StringIO(), process_position=1)
    t = trainer(bar, max_epochs=1)
    module = Tiny()
    t.fit(module, loader(), loader(8))
    t.validate(module, loader(8))
    t.test(module, loader(8))
    # tqdm keeps an explicit position as -position
    where = [(stage, -b.pos, b.leave) for stage, b in bar.made]
    assert where == [
        ("sanity", 2, False),
        ("train", 2, True),
        ("validate", 3, False),  # under the training bar, gone when full
        ("validate", 2, True),  # trainer.validate: no training bar above it; it stays
        ("test", 2, True),
    ]
    assert all(b.bar_format == TQDMProgressBar.BAR_FORMAT for s, b in bar.made if s != "train")


def test_refresh_rate_updates_every_n_batches_and_the_last_count_is_shown() -> None:
    counts: list[int] = []

    class Watch(TQDMProgressBar):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
            counts.append(self.train_progress_bar.n)

    bar = Watch(mode="bar", stream=io.StringIO(), refresh_rate=3)
    trainer(bar, max_epochs=1, num_sanity_val_steps=0).fit(Tiny(), loader(32))
    assert counts == [0, 0, 3, 3, 3, 6, 6, 6]
    assert bar.train_progress_bar.n == 8  # the epoch's end shows the full count


def test_tqdm_miniters_raises_the_refresh_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQDM_MINITERS", "5")
    assert TQDMProgressBar(refresh_rate=2).refresh_rate == 5
    assert TQDMProgressBar(refresh_rate=9).refresh_rate == 9
    assert TQDMProgressBar(refresh_rate=0).refresh_rate == 0  # off stays off (Lightning would turn it on)
    assert ProgressBar(refresh_rate=2).refresh_rate == 2  # Lightning's TQDMProgressBar reads it, not ember's base
    monkeypatch.setenv("TQDM_MINITERS", "often")
    with pytest.raises(ValueError, match="TQDM_MINITERS .* whole number of batches, got 'often'"):
        TQDMProgressBar()
    monkeypatch.delenv("TQDM_MINITERS")
    assert TQDMProgressBar(refresh_rate=2).refresh_rate == 2


@pytest.mark.parametrize("save", ["pickle", "torch.save"])
def test_a_trainer_holding_a_bar_pickles_after_a_run(save: str) -> None:
    out = io.StringIO()
    bar = TQDMProgressBar(mode="bar", stream=out, refresh_rate=2, process_position=1, leave=True)
    t = trainer(bar)
    t.fit(Tiny(), loader(), loader(8))
    if save == "pickle":
        loaded = pickle.loads(pickle.dumps(t))
    else:
        buffer = io.BytesIO()
        torch.save(t, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    (copy_bar,) = [c for c in loaded.callbacks if isinstance(c, TQDMProgressBar)]
    assert (copy_bar.refresh_rate, copy_bar.process_position, copy_bar.leave, copy_bar.mode) == (2, 1, True, "bar")
    with pytest.raises(TypeError, match="has not been set yet"):
        _ = copy_bar.train_progress_bar  # the bars stay behind
    assert bar.train_progress_bar.n == 4  # the original keeps its own
    # the loaded bar writes to the stdout of its process (a stream cannot be pickled), and can draw again
    loaded_out = io.StringIO()
    real = sys.stdout
    sys.stdout = loaded_out
    try:
        loaded.fit(Tiny(), loader(), loader(8))
    finally:
        sys.stdout = real
    assert "Epoch 1/1" in loaded_out.getvalue() and copy_bar.train_progress_bar.n == 4


def test_a_line_mode_bar_pickles_and_copies() -> None:
    bar = ProgressBar(stream=io.StringIO(), line_interval=3600.0)
    t = trainer(bar)
    t.fit(Tiny(), loader(), loader(8))
    loaded = pickle.loads(pickle.dumps(bar))
    assert (loaded.line_interval, loaded.refresh_rate) == (3600.0, 1)
    assert copy.copy(bar)._stream is bar._stream  # a shallow copy still shares everything


def test_a_deep_copy_leaves_the_bars_behind() -> None:
    bar = TQDMProgressBar(mode="bar", stream=io.StringIO())
    trainer(bar, max_epochs=1).fit(Tiny(), loader(), loader(8))
    deep = copy.deepcopy(bar)
    assert bar.train_progress_bar.n == 4 and bar.val_progress_bar.n == 2
    for name in ("train_progress_bar", "val_progress_bar"):
        with pytest.raises(TypeError, match="has not been set yet"):
            getattr(deep, name)
