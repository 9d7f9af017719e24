"""RichProgressBar: the tqdm bar's metrics drawn with rich, for fit, validate, test and predict; silent when
off, on other ranks, or refused beside enable_progress_bar=False; a clear error without rich."""

from __future__ import annotations

import io
import re
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ProgressBar, TQDMProgressBar
from tests.helpers.dist import join_as_rank, run_ranks

pytest.importorskip("rich")

from ember.callbacks import RichProgressBar, RichProgressBarTheme  # noqa: E402


class Tiny(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train_loss", loss, prog_bar=True)
        self.log("hidden", loss)  # not prog_bar: in neither bar
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.layer(batch[0]).pow(2).mean(), prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.layer(batch[0]).pow(2).mean(), prog_bar=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(0))), batch_size=8)


def rich_bar(out: io.StringIO, **kwargs: Any) -> RichProgressBar:
    # A file is not a terminal: rich then writes the display's last frame when it stops.
    return RichProgressBar(console_kwargs={"file": out, "width": 200, "color_system": None}, **kwargs)


def trainer(bar: ProgressBar, **kwargs: Any) -> ember.Trainer:
    kwargs.setdefault("max_epochs", 2)
    return ember.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=[bar], **kwargs)


def shown(text: str) -> dict[str, str]:
    """The ``name: value`` pairs of the last line that has any."""
    lines = [line for line in text.splitlines() if ": " in line]
    return dict(re.findall(r"(\w+): (\S+)", lines[-1])) if lines else {}


def test_fit_shows_the_same_metrics_as_the_tqdm_bar() -> None:
    out = io.StringIO()
    torch.manual_seed(0)
    t = trainer(rich_bar(out))
    t.fit(Tiny(), loader(), loader())
    text = out.getvalue()
    assert "Epoch 1/1" in text and "4/4" in text
    # The tqdm bar of the same run shows the same prog_bar metrics, formatted the same way.
    tqdm_out = io.StringIO()
    torch.manual_seed(0)
    t2 = trainer(TQDMProgressBar(mode="lines", stream=tqdm_out))
    t2.fit(Tiny(), loader(), loader())
    tqdm_metrics = dict(re.findall(r"(\w+)=(\S+)", tqdm_out.getvalue().splitlines()[-1]))
    assert shown(text) == tqdm_metrics
    assert set(tqdm_metrics) == {"train_loss", "val_loss"}
    assert float(shown(text)["val_loss"]) == pytest.approx(float(t.progress_bar_metrics["val_loss"]), rel=1e-3)


@pytest.mark.parametrize(("run", "title"), [("validate", "Validation"), ("test", "Testing"), ("predict", "Predicting")])
def test_validate_test_and_predict_draw_their_bar(run: str, title: str) -> None:
    """A full bar that stays on screen; as Lightning's rich bar (and the tqdm bar), without metrics: those are
    in the results table that validate and test print."""
    out = io.StringIO()
    getattr(trainer(rich_bar(out)), run)(Tiny(), loader())
    last = [line for line in out.getvalue().splitlines() if title in line]
    assert last and "4/4" in last[-1]
    assert shown(out.getvalue()) == {}


def test_refresh_rate_zero_draws_nothing() -> None:
    out = io.StringIO()
    t = trainer(rich_bar(out, refresh_rate=0))
    t.fit(Tiny(), loader(), loader())
    t.test(Tiny(), loader())
    assert out.getvalue() == ""


def test_enable_progress_bar_false_refuses_a_bar_in_callbacks() -> None:
    """As Lightning (a MisconfigurationException there): the two settings contradict each other."""
    with pytest.raises(ValueError, match=r"enable_progress_bar=False\) but a RichProgressBar is in callbacks"):
        trainer(rich_bar(io.StringIO()), enable_progress_bar=False)
    # the one bar in callbacks is the only one: no default tqdm bar beside it
    t = trainer(rich_bar(io.StringIO()))
    assert [type(c).__name__ for c in t.callbacks if isinstance(c, ProgressBar)] == ["RichProgressBar"]


def test_theme_and_arguments() -> None:
    out = io.StringIO()
    bar = rich_bar(out, theme=RichProgressBarTheme(metrics_text_delimiter=" | "), leave=True)
    trainer(bar).fit(Tiny(), loader(), loader())
    assert " | val_loss: " in out.getvalue()
    assert sum("Epoch 0/1" in line for line in out.getvalue().splitlines()) >= 1  # leave=True kept epoch 0
    with pytest.raises(ValueError, match="refresh_rate .* non-negative int"):
        RichProgressBar(refresh_rate=-1)
    with pytest.raises(TypeError, match="console_kwargs must be a dict"):
        RichProgressBar(console_kwargs=["file"])  # type: ignore[arg-type]


def test_without_rich_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rich" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'ember\[rich\]'"):
        RichProgressBar()


def _ddp_rank(rank: int, world: int) -> str:
    join_as_rank(rank, world)
    warnings.simplefilter("ignore")
    out = io.StringIO()
    trainer(rich_bar(out), strategy="ddp", devices=world).fit(Tiny(), loader(), loader())
    return out.getvalue()


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_ddp_draws_on_rank_zero_only() -> None:
    outputs = run_ranks(_ddp_rank, 2, timeout=80)
    assert "Epoch 1/1" in outputs[0] and "2/2" in outputs[0]  # each rank has half of the 4 batches
    assert set(shown(outputs[0])) == {"train_loss", "val_loss"}
    assert outputs[1] == ""


def test_dp_draws_the_one_process_bar() -> None:
    out = io.StringIO()
    trainer(rich_bar(out), strategy="dp", devices=2).fit(Tiny(), loader(), loader())
    assert "Epoch 1/1" in out.getvalue() and set(shown(out.getvalue())) == {"train_loss", "val_loss"}


# ---------------------------------------------------------------------- Lightning's RichProgressBar members
def test_the_tasks_of_a_fit_one_per_stage() -> None:
    bar = rich_bar(io.StringIO())
    for name in ("train_progress_bar", "val_progress_bar", "test_progress_bar", "val_sanity_check_bar"):
        with pytest.raises(TypeError, match=rf"`RichProgressBar.{name}` is not there yet"):
            getattr(bar, name)
    t = trainer(bar, max_epochs=3, num_sanity_val_steps=1)
    module = Tiny()
    t.fit(module, loader(), loader())
    # leave=False: one training task reset at each epoch and one validation task, not one per epoch
    tasks = [(task.description, task.completed, task.total) for task in bar.progress.tasks]
    assert tasks == [("Sanity check", 1, 1), ("Epoch 2/2", 4, 4), ("Validation", 4, 4)]
    assert bar.train_progress_bar.id == bar.train_progress_bar_id and bar.train_progress_bar.completed == 4
    assert bar.val_progress_bar.description == "Validation" and bar.val_progress_bar.completed == 4
    assert bar.val_sanity_check_bar.id == bar.val_sanity_progress_bar_id and not bar.val_sanity_check_bar.visible
    assert bar.train_progress_bar.fields["metrics"].startswith("train_loss: ")
    assert not bar.progress.live.is_started  # the display stopped, its object is still there
    with pytest.raises(TypeError, match="is not there yet"):
        _ = bar.test_progress_bar

    t.test(module, loader())
    assert bar.test_progress_bar.description == "Testing" and bar.test_progress_bar.completed == 4
    assert [task.description for task in bar.progress.tasks] == ["Testing"]  # a new display for the new run
    with pytest.raises(TypeError, match="a new run's display starts without the old tasks"):
        _ = bar.train_progress_bar


def test_leave_true_keeps_each_epoch_on_screen() -> None:
    out = io.StringIO()
    bar = rich_bar(out, leave=True)
    trainer(bar, max_epochs=3, num_sanity_val_steps=0).fit(Tiny(), loader(), loader())
    epochs = [line.split()[:2] for line in out.getvalue().splitlines() if line.startswith("Epoch")]
    assert epochs == [["Epoch", "0/2"], ["Epoch", "1/2"], ["Epoch", "2/2"]]  # each epoch's last frame, once
    assert bar.train_progress_bar.description == "Epoch 2/2" and bar.train_progress_bar.completed == 4


def test_refresh_rate_is_redraws_a_second_and_every_batch_is_counted() -> None:
    seen: list[float] = []

    class Watch(RichProgressBar):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
            seen.append(self.train_progress_bar.completed)

    bar = Watch(refresh_rate=3, console_kwargs={"file": io.StringIO()})
    assert bar.refresh_rate == 3 and bar.is_enabled
    trainer(bar, max_epochs=1).fit(Tiny(), loader(), loader())
    assert bar.progress.live.refresh_per_second == 3
    assert seen == [1, 2, 3, 4]  # not every third batch: the rate is in seconds
    assert bar.val_progress_bar.completed == 4


def test_configure_columns_gives_the_columns_drawn() -> None:
    from rich.progress import ProgressColumn, TextColumn

    default = RichProgressBar().configure_columns(None)
    assert len(default) == 6 and all(isinstance(column, ProgressColumn) for column in default)

    class Plain(RichProgressBar):
        def configure_columns(self, trainer: Any) -> list:
            assert trainer is self.trainer
            return [TextColumn("{task.description} did {task.completed} of {task.total}")]

    out = io.StringIO()
    trainer(Plain(console_kwargs={"file": out, "width": 200}), max_epochs=1).fit(Tiny(), loader(), loader())
    text = out.getvalue()
    assert "Epoch 0/0 did 4 of 4" in text
    assert "it/s" not in text and "━" not in text  # none of the default columns
    assert "train_loss: " in text  # the metrics column still follows


def test_refresh_redraws_the_live_display_now() -> None:
    out = io.StringIO()
    grew: list[int] = []

    class Redraw(RichProgressBar):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
            before = len(out.getvalue())
            self.refresh()
            self.refresh(hard=True)
            grew.append(len(out.getvalue()) - before)

    # a terminal console (drawn in place), redrawn by rich's thread once a second only
    bar = Redraw(refresh_rate=1, console_kwargs={"file": out, "force_terminal": True, "width": 120})
    bar.refresh()  # no display yet: nothing to do
    assert out.getvalue() == ""
    trainer(bar, max_epochs=1).fit(Tiny(), loader(), loader())
    assert len(grew) == 4 and all(n > 0 for n in grew)


@pytest.mark.parametrize("save", ["pickle", "torch.save"])
def test_a_trainer_holding_the_rich_bar_pickles_after_a_run(save: str) -> None:
    import pickle

    bar = rich_bar(io.StringIO(), refresh_rate=5, theme=RichProgressBarTheme(metrics_format=".1f"))
    t = trainer(bar)
    t.fit(Tiny(), loader(), loader())
    if save == "pickle":
        loaded = pickle.loads(pickle.dumps(t))
    else:
        buffer = io.BytesIO()
        torch.save(t, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    (copy_bar,) = [c for c in loaded.callbacks if isinstance(c, RichProgressBar)]
    assert copy_bar.refresh_rate == 5 and copy_bar.theme.metrics_format == ".1f"
    assert copy_bar.progress is None and "file" not in copy_bar.console_kwargs  # a stream cannot be pickled
    assert copy_bar.console_kwargs["width"] == 200
    assert bar.progress is not None and bar.train_progress_bar.completed == 4  # the original keeps its own
