"""The members ember's bars share with Lightning's ProgressBar: enable/disable, get_metrics, trainer,
the descriptions, the batch totals and print."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ProgressBar, TQDMProgressBar
from ember.callbacks import progress_bar as progress_bar_module
from ember.callbacks.progress_members import get_standard_metrics
from ember.loggers import CSVLogger
from tests.helpers.models import OtherRank


class Net(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("trn", loss, prog_bar=True)
        self.log("quiet", loss)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("vl", F.mse_loss(self.net(x), y), prog_bar=True)

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("tst", F.mse_loss(self.net(x), y))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(n: int = 12, batch_size: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 2), torch.randn(n, 1)), batch_size=batch_size)


def trainer(bar, tmp_path=None, **kwargs) -> ember.Trainer:
    kwargs.setdefault("logger", False)
    kwargs.setdefault("max_epochs", 1)
    return ember.Trainer(
        accelerator="cpu",
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[bar],
        **kwargs,
    )


def test_enable_disable_and_their_flags():
    bar = TQDMProgressBar()
    assert bar.is_enabled and not bar.is_disabled
    bar.disable()
    assert bar.is_disabled and not bar.is_enabled
    bar.enable()
    assert bar.is_enabled
    assert ProgressBar(refresh_rate=0).is_disabled  # refresh_rate 0 is off, enabled or not


def test_a_disabled_bar_prints_nothing_and_stays_disabled_through_setup():
    out = io.StringIO()
    bar = ProgressBar(mode="lines", stream=out, line_interval=0.0)
    bar.disable()
    trainer(bar).fit(Net(), loader())
    assert out.getvalue() == "" and bar.is_disabled
    bar.enable()
    trainer(bar).fit(Net(), loader())
    assert "Epoch 0/0 done" in out.getvalue()


def test_disable_in_the_middle_of_an_epoch_stops_the_lines():
    out = io.StringIO()

    class Off(ProgressBar):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 1:
                self.disable()
            super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)

    trainer(Off(mode="lines", stream=out, line_interval=0.0)).fit(Net(), loader())
    assert [ln.split()[2] for ln in out.getvalue().splitlines()] == ["1/3"]  # batch 1's line; none after disable()
    assert "done" not in out.getvalue()


def test_other_ranks_are_disabled():
    bar = ProgressBar(mode="lines", stream=io.StringIO())
    trainer(bar, strategy=OtherRank()).fit(Net(), loader())
    assert bar.is_disabled


def test_get_metrics_has_the_prog_bar_metrics_and_v_num(tmp_path):
    bar = ProgressBar(mode="lines", stream=io.StringIO(), line_interval=3600.0)
    t = trainer(bar, logger=CSVLogger(tmp_path, version=3))
    t.fit(Net(), loader(), loader())
    items = bar.get_metrics(t, t.lightning_module)
    assert list(items) == ["v_num", "trn", "vl"]  # "quiet" is not a prog_bar metric
    assert items["v_num"] == 3 and all(isinstance(items[k], float) for k in ("trn", "vl"))
    assert "v_num=3 trn=" in bar._stream.getvalue()


def test_v_num_of_string_versions_and_of_several_loggers(tmp_path):
    class Logged:
        def __init__(self, *versions):
            self.loggers = [type("L", (), {"version": v})() for v in versions]

    assert get_standard_metrics(Logged("version_12345")) == {"v_num": "2345"}
    assert get_standard_metrics(Logged(1, 1, 2)) == {"v_num": "1_2"}
    assert get_standard_metrics(Logged("")) == {} and get_standard_metrics(Logged()) == {}


def test_a_get_metrics_override_changes_what_is_shown(tmp_path):
    class NoVersion(ProgressBar):
        def get_metrics(self, trainer, pl_module):
            items = super().get_metrics(trainer, pl_module)
            items.pop("v_num", None)
            items["extra"] = "x"
            return items

    out = io.StringIO()
    trainer(NoVersion(mode="lines", stream=out), logger=CSVLogger(tmp_path)).fit(Net(), loader())
    line = out.getvalue().splitlines()[0]
    assert "v_num" not in line and "trn=" in line and line.endswith("extra=x")


def test_a_prog_bar_metric_named_v_num_warns_and_wins(tmp_path):
    bar = ProgressBar(mode="lines", stream=io.StringIO())
    t = trainer(bar, logger=CSVLogger(tmp_path, version=5))
    t.fit(Net(), loader())
    t._metrics.progress_bar_metrics["v_num"] = torch.tensor(9.0)  # as self.log("v_num", 9.0, prog_bar=True) would
    with pytest.warns(UserWarning, match="already tracks a metric with the name"):
        assert bar.get_metrics(t, t.lightning_module)["v_num"] == 9.0


def test_trainer_property_and_descriptions():
    bar = TQDMProgressBar()
    with pytest.raises(TypeError, match=r"`TQDMProgressBar._trainer` reference has not been set yet"):
        _ = bar.trainer
    t = trainer(bar)
    t.fit(Net(), loader())
    assert bar.trainer is t
    assert copy.deepcopy(bar).trainer is t  # a copy refers to the same trainer
    assert (
        bar.train_description,
        bar.validation_description,
        bar.test_description,
        bar.predict_description,
        bar.sanity_check_description,
    ) == ("Training", "Validation", "Testing", "Predicting", "Sanity Checking")


def test_descriptions_name_the_evaluation_bars():
    class Worded(ProgressBar):
        test_description = "Checking"  # type: ignore[assignment]
        sanity_check_description = "Warmup"  # type: ignore[assignment]

    out = io.StringIO()
    t = trainer(Worded(mode="bar", stream=out), num_sanity_val_steps=1)
    t.fit(Net(), loader(), loader())
    t.test(t.lightning_module, loader())
    text = out.getvalue()
    assert "Warmup" in text and "Checking" in text and "Validation" in text
    out = io.StringIO()
    trainer(ProgressBar(mode="bar", stream=out), num_sanity_val_steps=1).fit(Net(), loader(), loader())
    assert "Sanity check" in out.getvalue()  # ember's own words, unless a subclass names them


def test_batch_totals_follow_the_trainer():
    seen: list[tuple] = []

    class Watch(ProgressBar):
        def on_train_epoch_end(self, trainer, module):
            super().on_train_epoch_end(trainer, module)
            seen.append(("epoch", self.total_train_batches, self.total_val_batches))

        def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
            super().on_validation_batch_start(trainer, module, batch, batch_idx, dataloader_idx)
            seen.append(("val", trainer.sanity_checking, self.total_val_batches_current_dataloader))

        def on_test_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
            super().on_test_batch_start(trainer, module, batch, batch_idx, dataloader_idx)
            seen.append(("test", self.total_test_batches_current_dataloader))

        def on_predict_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
            super().on_predict_batch_start(trainer, module, batch, batch_idx, dataloader_idx)
            seen.append(("predict", self.total_predict_batches_current_dataloader))

    bar = Watch(mode="lines", stream=io.StringIO())
    t = trainer(bar, max_epochs=2, check_val_every_n_epoch=2, num_sanity_val_steps=1)
    module = Net()
    t.fit(module, loader(12), [loader(8), loader(4)])
    assert seen == [
        ("val", True, 1),
        ("val", True, 1),
        ("epoch", 3, 0),  # epoch 0 does not validate
        ("val", False, 2),
        ("val", False, 2),
        ("val", False, 1),
        ("epoch", 3, 3),
    ]
    seen.clear()
    t.test(module, [loader(4), loader(8)])
    t.predict(module, loader(8, batch_size=8))
    assert seen == [("test", 1), ("test", 2), ("test", 2), ("predict", 1)]
    assert bar._current_eval_dataloader_idx is None  # reset when a run ends
    assert bar.has_dataloader_changed(1) and not bar.has_dataloader_changed(1)
    bar.reset_dataloader_idx_tracker()
    assert bar._current_eval_dataloader_idx is None

    seen.clear()
    trainer(bar, max_epochs=-1, max_steps=5).fit(Net(), loader(12))  # fewer steps left than batches
    assert seen == [("epoch", 2, 0), ("epoch", 0, 0)]  # read at epoch end: min(3, 5 - global_step)


def test_print_goes_through_tqdm_while_a_bar_is_open(monkeypatch):
    out = io.StringIO()
    written: list[str] = []

    class Talk(ProgressBar):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
            self.print("batch", batch_idx, sep="-")

    bar = Talk(mode="bar", stream=out)
    tqdm_class = progress_bar_module._tqdm_class()
    real_write = tqdm_class.write
    monkeypatch.setattr(tqdm_class, "write", staticmethod(lambda s, **kw: written.append(s) or real_write(s, **kw)))
    trainer(bar).fit(Net(), loader())
    assert written == ["batch-0", "batch-1", "batch-2"]
    assert "batch-2\n" in out.getvalue()

    out = io.StringIO()
    bar = ProgressBar(mode="lines", stream=out)
    bar.print("no", "bar", sep="_")  # no bar open: a plain print to the bar's stream
    assert out.getvalue() == "no_bar\n"


def test_rich_bar_shares_the_members(capsys):
    pytest.importorskip("rich")
    from ember.callbacks import RichProgressBar

    bar = RichProgressBar(console_kwargs={"file": io.StringIO(), "force_terminal": False})
    assert bar.is_enabled
    bar.disable()
    assert bar.is_disabled
    bar.enable()
    t = trainer(bar)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(Net(), loader())
    assert bar.trainer is t and bar.total_train_batches == 3
    assert list(bar.get_metrics(t, t.lightning_module)) == ["trn"]
    bar.print("hello", "rich")
    assert capsys.readouterr().out.endswith("hello rich\n")
    assert RichProgressBar(refresh_rate=0).is_disabled
