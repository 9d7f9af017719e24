"""``Tuner(trainer).lr_find(model)``: the sweep, the suggestion, the attribute update, and that the
module and the Trainer are as they were afterwards (in the default configuration: logger and
checkpointing on)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.tuner import LRFinder, Tuner
from tests.helpers.models import regression_loader


class Net(ember.TrainModule):
    def __init__(self, lr: float = 0.01, use_hparams: bool = False) -> None:
        super().__init__()
        if use_hparams:
            self.save_hyperparameters()
        else:
            self.lr = lr
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.lrs_seen: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.lrs_seen.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        lr = self.hparams.lr if "lr" in self.hparams else self.lr
        return torch.optim.SGD(self.parameters(), lr=lr)


def trainer(tmp_path, **kwargs) -> ember.Trainer:
    return ember.Trainer(accelerator="cpu", default_root_dir=tmp_path, enable_progress_bar=False, **kwargs)


def test_lightnings_defaults_sweep_100_steps_from_1e_8_to_1_evenly_in_log_space(tmp_path):
    finder = Tuner(trainer(tmp_path)).lr_find(Net(), regression_loader(n=32, batch_size=8), early_stop_threshold=None)
    lrs = finder.results["lr"]
    assert len(lrs) == len(finder.results["loss"]) == 100
    assert lrs[0] == pytest.approx(1e-8) and lrs[-1] == pytest.approx(1.0)
    ratios = [b / a for a, b in zip(lrs, lrs[1:])]
    assert max(ratios) == pytest.approx(min(ratios)) == pytest.approx(1e8 ** (1 / 99))


def test_each_step_trains_at_the_swept_rate(tmp_path):
    module = Net()
    finder = Tuner(trainer(tmp_path)).lr_find(
        module,
        regression_loader(n=32, batch_size=8),
        num_training=20,
        min_lr=1e-4,
        max_lr=1e-1,
        mode="linear",
        early_stop_threshold=None,
    )
    assert module.lrs_seen == pytest.approx(finder.results["lr"])
    assert finder.results["lr"] == pytest.approx([1e-4 + (1e-1 - 1e-4) * i / 19 for i in range(20)])


def test_the_suggestion_is_set_on_the_lr_attribute_and_the_module_and_trainer_are_restored(tmp_path):
    module = Net()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    t = trainer(tmp_path, max_epochs=4, log_every_n_steps=8)
    callbacks, loggers = list(t.callbacks), list(t.loggers)
    # 4 epochs x 32 batches: 100 steps
    finder = Tuner(t).lr_find(module, regression_loader(n=32, batch_size=1), early_stop_threshold=None)
    assert module.lr == finder.suggestion() != 0.01
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert t.callbacks == callbacks and t.loggers == loggers
    assert len(finder.results["lr"]) == 100
    assert (t.global_step, t.current_epoch, t.max_steps, t.max_epochs, t.should_stop) == (0, 0, -1, 4, False)
    assert t.state == "initializing" and t.state.fn is None  # as before the sweep's fits
    assert not os.path.exists(os.path.join(tmp_path, "ember_logs"))  # the sweep logged and saved nothing
    # The real fit then runs as configured, at the suggested rate, with its logger and checkpoints.
    t.fit(module, regression_loader(n=32, batch_size=8))
    assert t.optimizers[0].param_groups[0]["lr"] == finder.suggestion()
    assert (t.global_step, t.current_epoch) == (16, 4)
    assert os.listdir(os.path.join(t.log_dir, "checkpoints"))


def test_the_hparams_lr_is_updated_and_learning_rate_is_found_too(tmp_path):
    module = Net(use_hparams=True)
    finder = Tuner(trainer(tmp_path, logger=False)).lr_find(module, regression_loader(), num_training=30)
    assert module.hparams.lr == finder.suggestion()

    class Other(Net):
        def __init__(self):
            super().__init__()
            del self.lr
            self.learning_rate = 0.5

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.learning_rate)

    other = Other()
    finder = Tuner(trainer(tmp_path, logger=False)).lr_find(other, regression_loader(), num_training=30)
    assert other.learning_rate == finder.suggestion()


def test_a_diverging_loss_stops_the_sweep_early(tmp_path):
    # SGD on a linear regression diverges well below lr=10.
    t = trainer(tmp_path, logger=False)
    finder = Tuner(t).lr_find(Net(), regression_loader(n=32, batch_size=8), min_lr=1e-3, max_lr=100.0)
    assert 5 < len(finder.results["lr"]) < 100
    assert finder.results["lr"][-1] < 100.0
    assert not t.should_stop  # given back


def test_accumulation_records_one_point_per_optimizer_step(tmp_path):
    module = Net()
    finder = Tuner(trainer(tmp_path, logger=False, accumulate_grad_batches=2)).lr_find(
        module, regression_loader(n=32, batch_size=8), num_training=10, early_stop_threshold=None
    )
    assert len(finder.results["lr"]) == 10
    assert module.lrs_seen[::2] == module.lrs_seen[1::2] == finder.results["lr"]  # one rate per window


def test_the_suggestion_is_the_steepest_fall_skipping_the_ends_and_non_finite_points():
    finder = LRFinder("exponential", 1e-3, 1.0, 6)
    finder.results = {"lr": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "loss": [9.0, 9.0, 8.0, 4.0, 3.9, 100.0]}
    # gradients over points 1..4: [-1, -2.5, -2.05, -0.1]: steepest at lr 3
    assert finder.suggestion(skip_begin=1, skip_end=1) == 3.0
    finder.results["loss"][2] = math.nan
    # Left out: losses [9, 4, 3.9] at [2, 4, 5]; gradients [-2.5, -0.9, -0.1]: steepest at lr 2
    assert finder.suggestion(skip_begin=1, skip_end=1) == 2.0
    with pytest.warns(UserWarning, match="too few points"):
        assert finder.suggestion(skip_begin=4, skip_end=1) is None


def test_plot_returns_a_figure_with_the_suggestion_marked(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    finder = Tuner(trainer(tmp_path, logger=False)).lr_find(
        Net(), regression_loader(), num_training=30, update_attr=False
    )
    fig = finder.plot(suggest=True)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    (curve, marker) = ax.lines
    assert list(curve.get_xdata()) == finder.results["lr"]
    assert list(marker.get_xdata()) == [finder.suggestion()]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_mistakes_are_explained(tmp_path):
    tuner = Tuner(trainer(tmp_path, logger=False))

    class NoLr(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(AttributeError, match="'lr' or 'learning_rate'.*attr_name="):
        tuner.lr_find(NoLr(), regression_loader())
    with pytest.raises(AttributeError, match="'my_lr'"):
        tuner.lr_find(Net(), regression_loader(), attr_name="my_lr")
    with pytest.raises(ValueError, match="method='fit' only"):
        tuner.lr_find(Net(), regression_loader(), method="validate")
    with pytest.raises(ValueError, match="'exponential' or 'linear'"):
        tuner.lr_find(Net(), regression_loader(), mode="exp")
    with pytest.raises(ValueError, match="0 < min_lr < max_lr"):
        tuner.lr_find(Net(), regression_loader(), min_lr=1.0, max_lr=0.1)
    assert Tuner(trainer(tmp_path, fast_dev_run=True)).lr_find(Net(), regression_loader()) is None


def test_the_sweep_is_not_profiled_and_the_profiler_is_given_back(tmp_path, capsys):
    from ember.profilers import SimpleProfiler

    profiler = SimpleProfiler()
    t = trainer(tmp_path, logger=False, profiler=profiler, max_epochs=2)
    Tuner(t).lr_find(Net(), regression_loader(), num_training=8)
    assert "Profiler Report" not in capsys.readouterr().out
    assert t.profiler is profiler
    t.fit(Net(), regression_loader())
    assert "FIT Profiler Report" in capsys.readouterr().out
