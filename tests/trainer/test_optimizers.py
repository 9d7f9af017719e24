"""configure_optimizers: every return form, scheduler intervals and frequencies, ReduceLROnPlateau."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ember
from ember.trainer.optim import SchedulerConfig, parse_optimizers
from tests.helpers.models import BoringModel, TrainOnlyModel, fast_trainer, regression_loader


def _opt(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=lr)


def module_returning(make: Callable[[torch.nn.Module], Any], base=BoringModel):
    class M(base):
        def configure_optimizers(self):
            return make(self)

    return M()


def lr_of(trainer) -> float:
    return trainer.optimizers[0].param_groups[0]["lr"]


def test_single_optimizer():
    trainer = fast_trainer()
    module = module_returning(lambda m: torch.optim.Adam(m.parameters(), lr=0.01))
    trainer.fit(module, regression_loader())
    assert len(trainer.optimizers) == 1 and isinstance(trainer.optimizers[0], torch.optim.Adam)
    assert trainer.lr_scheduler_configs == [] and trainer.global_step == 4


@pytest.mark.parametrize("wrap", [list, tuple])
def test_list_of_one_optimizer(wrap):
    trainer = fast_trainer()
    trainer.fit(module_returning(lambda m: wrap([torch.optim.SGD(m.parameters(), lr=0.1)])), regression_loader())
    assert len(trainer.optimizers) == 1 and trainer.global_step == 4


def test_optimizers_and_schedulers_lists():
    trainer = fast_trainer(max_epochs=3)

    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    trainer.fit(module_returning(make), regression_loader())
    cfg = trainer.lr_scheduler_configs[0]
    assert (cfg.interval, cfg.frequency) == ("epoch", 1)
    assert lr_of(trainer) == pytest.approx(0.125)  # stepped once per epoch


def test_dict_with_a_bare_scheduler_defaults_to_epoch_interval():
    trainer = fast_trainer(max_epochs=2)

    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}

    trainer.fit(module_returning(make), regression_loader())
    assert lr_of(trainer) == pytest.approx(0.25)


def test_dict_without_scheduler():
    trainer = fast_trainer()
    trainer.fit(module_returning(lambda m: {"optimizer": torch.optim.SGD(m.parameters(), lr=0.1)}), regression_loader())
    assert trainer.lr_scheduler_configs == [] and trainer.global_step == 4


@pytest.mark.parametrize(
    "interval,frequency,epochs,expected_steps",
    [
        ("step", 1, 1, 4),  # 4 optimizer steps
        ("step", 2, 1, 2),
        ("step", 3, 2, 2),  # 4 batches per epoch -> stepped after each epoch's third batch
        ("epoch", 1, 3, 3),
        ("epoch", 2, 3, 1),  # after epoch 2 only
        ("epoch", 2, 4, 2),
    ],
)
def test_scheduler_config_interval_and_frequency(interval, frequency, epochs, expected_steps):
    calls = []

    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5**i)
        original = sched.step

        def step(*a, **k):
            calls.append(trainer.global_step)
            return original(*a, **k)

        sched.step = step
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": interval, "frequency": frequency}}

    trainer = fast_trainer(max_epochs=epochs)
    trainer.fit(module_returning(make), regression_loader())
    assert len(calls) == expected_steps
    assert lr_of(trainer) == pytest.approx(0.5**expected_steps)


class RecordsSchedulerSteps(TrainOnlyModel):
    """A LambdaLR halving per step with ``interval="step"`` and ``frequency``; records (epoch, global_step)
    at each of its steps."""

    def __init__(self, frequency: int) -> None:
        super().__init__()
        self.frequency = frequency
        self.stepped_at: list[tuple[int, int]] = []

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5**i)
        original = sched.step

        def step(*args, **kwargs):
            self.stepped_at.append((self.trainer.current_epoch, self.trainer.global_step))
            return original(*args, **kwargs)

        sched.step = step
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": self.frequency}}


# (epoch, global_step) of each scheduler step, as Lightning 2.6.6 gives them for the same fits: the frequency
# counts the epoch's batches (batch_idx + 1, from 0 again each epoch) and is checked only on batches where
# the optimizer steps (the end of an accumulation window, or the epoch's last batch).
@pytest.mark.parametrize(
    "frequency,k,batches,expected",
    [
        (3, 1, 5, [(0, 3), (1, 8)]),  # not every third global step: batch 3 of each epoch
        (2, 2, 5, [(0, 1), (0, 2), (1, 4), (1, 5)]),  # batches 2 and 4 end windows
        (4, 2, 10, [(0, 2), (0, 4), (1, 7), (1, 9)]),
        (2, 3, 7, [(0, 2), (1, 5)]),  # steps end batches 3, 6 and 7: only 6 is even
        (3, 2, 5, []),  # steps end batches 2, 4 and 5: none a multiple of 3
    ],
)
def test_step_scheduler_frequency_counts_the_epochs_batches(frequency, k, batches, expected):
    module = RecordsSchedulerSteps(frequency)
    trainer = fast_trainer(max_epochs=2, accumulate_grad_batches=k, limit_train_batches=batches)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="A step-interval LR scheduler", category=UserWarning)
        trainer.fit(module, regression_loader(n=64, batch_size=4))
    assert module.stepped_at == expected
    assert lr_of(trainer) == 0.5 ** len(expected)


def test_a_batch_refused_by_on_train_batch_start_steps_no_step_scheduler():
    # docs/from-lightning.md, differences: the refused batch 3 ran no optimizer step, so no scheduler steps for it
    # (Lightning 2.6.6 steps this one there, (batch_idx + 1) % 2 == 0: [(0, 2), (0, 3), (1, 5), (1, 6)]).
    class Refuses(RecordsSchedulerSteps):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 3 else None

    module = Refuses(2)
    trainer = fast_trainer(max_epochs=2, limit_train_batches=6)
    trainer.fit(module, regression_loader(n=64, batch_size=4))
    assert trainer.global_step == 6 and module.stepped_at == [(0, 2), (1, 5)]


def test_a_step_scheduler_frequency_no_multiple_of_accumulation_is_warned_about_once():
    module = RecordsSchedulerSteps(3)
    trainer = fast_trainer(max_epochs=2, accumulate_grad_batches=2, limit_train_batches=5)
    with pytest.warns(UserWarning) as caught:
        trainer.fit(module, regression_loader(n=64, batch_size=4))
    messages = [str(w.message) for w in caught if "step-interval LR scheduler" in str(w.message)]
    assert messages == [
        "A step-interval LR scheduler (LambdaLR) has frequency=3, which is no multiple of "
        "accumulate_grad_batches=2. As in Lightning, the frequency counts the epoch's batches (batch_idx + 1) and "
        "is checked only on batches where the optimizer steps, so the scheduler steps every 6 batches (3 optimizer "
        "steps), counted again from each epoch's start: never in an epoch of fewer batches, except on its last one "
        "when the frequency divides its number. For a step every N optimizer steps, set frequency=N*2."
    ]


@pytest.mark.parametrize("frequency,k", [(1, 2), (4, 2), (3, 1)])
def test_a_step_scheduler_frequency_that_fits_the_accumulation_is_not_warned_about(frequency, k):
    trainer = fast_trainer(max_epochs=1, accumulate_grad_batches=k)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="A step-interval LR scheduler", category=UserWarning)
        trainer.fit(RecordsSchedulerSteps(frequency), regression_loader(n=64, batch_size=4))


def test_step_interval_scheduler_steps_after_the_optimizer_step():
    lrs = []

    class M(BoringModel):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_before_optimizer_step(self, optimizer):
            lrs.append(optimizer.param_groups[0]["lr"])

    fast_trainer(accumulate_grad_batches=2).fit(M(), regression_loader(n=48))
    # 6 batches, 3 optimizer steps: the first step uses the initial lr.
    assert lrs == pytest.approx([1.0, 0.5, 1 / 3])


def test_reduce_lr_on_plateau_with_monitor():
    class Plateau(BoringModel):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("val_loss", torch.tensor(1.0))  # never improves

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}

    trainer = fast_trainer(max_epochs=3)
    trainer.fit(Plateau(), regression_loader(), regression_loader())
    # Epoch 1 sets the best value; epochs 2 and 3 do not improve -> two reductions.
    assert lr_of(trainer) == pytest.approx(0.25)
    assert trainer.lr_scheduler_configs[0].monitor == "val_loss"


def test_reduce_lr_on_plateau_without_monitor_is_an_error():
    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)}

    with pytest.raises(ValueError, match=r"ReduceLROnPlateau needs a metric.*'monitor': 'val/loss'"):
        fast_trainer().fit(module_returning(make), regression_loader())


def test_monitored_metric_missing_is_an_error_unless_not_strict():
    def make(strict):
        def inner(m):
            opt = torch.optim.SGD(m.parameters(), lr=1.0)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "nope", "strict": strict}}

        return inner

    with pytest.raises(KeyError, match=r"monitors 'nope', which was not logged.*train_loss.*self.log\('nope'"):
        fast_trainer().fit(module_returning(make(True)), regression_loader())
    trainer = fast_trainer()
    with pytest.warns(RuntimeWarning, match="monitors 'nope', which is not available, and strict is False"):
        trainer.fit(module_returning(make(False)), regression_loader())
    assert lr_of(trainer) == 1.0


def test_several_optimizers_need_manual_optimization():
    def make(m):
        return [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.Adam(m.parameters())]

    with pytest.raises(ValueError, match=r"returned 2 optimizers.*self.automatic_optimization = False"):
        fast_trainer().fit(module_returning(make), regression_loader())


def test_missing_configure_optimizers_is_an_error():
    class NoOpt(TrainOnlyModel):
        configure_optimizers = ember.TrainModule.configure_optimizers

    with pytest.raises(NotImplementedError, match=r"NoOpt must define configure_optimizers\(\) returning an optimizer"):
        fast_trainer().fit(NoOpt(), regression_loader())


# ---------------------------------------------------------------------- parse_optimizers directly
def test_parse_forms():
    o1, o2 = _opt(), _opt()
    s1 = torch.optim.lr_scheduler.StepLR(o1, 1)
    assert parse_optimizers(None) == ([], [])
    assert parse_optimizers(o1) == ([o1], [])
    assert parse_optimizers([o1, o2]) == ([o1, o2], [])
    opts, scheds = parse_optimizers(([o1], [s1]))
    assert opts == [o1] and scheds[0].scheduler is s1 and scheds[0].interval == "epoch"
    opts, scheds = parse_optimizers(
        ({"optimizer": o1, "lr_scheduler": {"scheduler": s1, "interval": "step"}}, {"optimizer": o2})
    )
    assert opts == [o1, o2] and len(scheds) == 1 and scheds[0].interval == "step"
    cfg = SchedulerConfig(scheduler=s1, frequency=3)
    assert parse_optimizers(([o1], [cfg]))[1] == [cfg]


@pytest.mark.parametrize(
    "bad,err,match",
    [
        ("adam", TypeError, r"configure_optimizers returned str; it may return an optimizer"),
        ([torch.nn.Linear(1, 1)], TypeError, r"returned a Linear where an optimizer was expected"),
        ({"lr_scheduler": None}, ValueError, r"dict without 'optimizer'"),
    ],
)
def test_parse_bad_forms(bad, err, match):
    with pytest.raises(err, match=match):
        parse_optimizers(bad)


def test_parse_bad_scheduler_configs():
    o = _opt()
    s = torch.optim.lr_scheduler.StepLR(o, 1)
    with pytest.raises(ValueError, match="needs a 'scheduler' key"):
        parse_optimizers({"optimizer": o, "lr_scheduler": {"interval": "step"}})
    with pytest.raises(ValueError, match=r"Unknown lr_scheduler config keys \['intervall'\]"):
        parse_optimizers({"optimizer": o, "lr_scheduler": {"scheduler": s, "intervall": "step"}})
    with pytest.raises(ValueError, match="interval must be 'step' or 'epoch', got 'batch'"):
        parse_optimizers({"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "batch"}})
    with pytest.raises(ValueError, match="frequency must be a positive int, got 0"):
        parse_optimizers({"optimizer": o, "lr_scheduler": {"scheduler": s, "frequency": 0}})
    with pytest.raises(TypeError, match="str is not an LR scheduler"):
        parse_optimizers({"optimizer": o, "lr_scheduler": "cosine"})


def test_dict_with_a_top_level_monitor():
    # Lightning's {"optimizer": opt, "lr_scheduler": plateau, "monitor": "val_loss"} spelling.
    class Plateau(BoringModel):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("val_loss", torch.tensor(1.0))

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
            return {"optimizer": opt, "lr_scheduler": sched, "monitor": "val_loss"}

    trainer = fast_trainer(max_epochs=3)
    trainer.fit(Plateau(), regression_loader(), regression_loader())
    assert trainer.lr_scheduler_configs[0].monitor == "val_loss"
    assert lr_of(trainer) == pytest.approx(0.25)


# ---------------------------------------------------------------------- Lightning's scheduler config keys
# Each expectation below was observed on Lightning 2.6.6 with the same module and data (4 batches/epoch).
class CustomPlateau:
    """A scheduler outside torch's API: its step takes a metric, positionally."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.metrics: list[float] = []

    def step(self, metric):
        self.metrics.append(float(metric))
        self.optimizer.param_groups[0]["lr"] *= 0.5

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def custom_config(**extra):
    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        m.sched = CustomPlateau(opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": m.sched, **extra}}

    return make


class SteppingItself(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.received: list[Any] = []

    def lr_scheduler_step(self, scheduler, metric):
        self.received.append(None if metric is None else float(metric))
        scheduler.step(0.0 if metric is None else metric)


def test_a_scheduler_outside_torchs_api_needs_lr_scheduler_step():
    # Lightning 2.6.6: "The provided lr scheduler `CustomPlateau` doesn't follow PyTorch's LRScheduler API.
    # You should override the `LightningModule.lr_scheduler_step` hook ..."
    with pytest.raises(
        TypeError,
        match=r"CustomPlateau is not a torch.optim.lr_scheduler scheduler.*Override "
        r"M.lr_scheduler_step\(self, scheduler, metric\)",
    ):
        fast_trainer(max_epochs=2).fit(module_returning(custom_config()), regression_loader())


@pytest.mark.parametrize(
    ("extra", "gets_metric"),
    [
        ({"reduce_on_plateau": True, "monitor": "train_loss"}, True),  # Lightning: the metric, once per epoch
        ({"monitor": "train_loss"}, False),  # Lightning: monitor ignored, metric None
    ],
)
def test_reduce_on_plateau_key_decides_whether_the_monitor_is_read(extra, gets_metric):
    module = module_returning(custom_config(**extra), base=SteppingItself)
    trainer = fast_trainer(max_epochs=2)
    trainer.fit(module, regression_loader())
    assert len(module.received) == 2 and lr_of(trainer) == 0.25
    if gets_metric:
        assert all(isinstance(v, float) for v in module.received)
    else:
        assert module.received == [None, None]
    assert trainer.lr_scheduler_configs[0].reduce_on_plateau is gets_metric


def test_a_torch_scheduler_with_a_monitor_is_stepped_without_the_metric():
    # Lightning 2.6.6: StepLR with 'monitor': 'nope' (never logged) steps per epoch: lr 1.0 -> 0.25 after 2 epochs.
    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                "monitor": "nope",
                "name": "steplr",
            },
        }

    trainer = fast_trainer(max_epochs=2)
    trainer.fit(module_returning(make), regression_loader())
    assert lr_of(trainer) == 0.25 and trainer.lr_scheduler_configs[0].name == "steplr"


def test_a_scheduler_without_state_dict_is_an_error():
    # Lightning 2.6.6: TypeError "... It should have `state_dict` and `load_state_dict` methods defined."
    class NoState:
        def step(self):
            pass

    with pytest.raises(
        TypeError,
        match=r"NoState is not an LR scheduler: it needs state_dict\(\) and load_state_dict\(\), which save "
        r"and restore it with checkpoints",
    ):
        fast_trainer().fit(
            module_returning(lambda m: ([torch.optim.SGD(m.parameters(), lr=1.0)], [NoState()])), regression_loader()
        )


def test_a_non_strict_missing_monitor_warns_and_skips():
    # Lightning 2.6.6: RuntimeWarning "ReduceLROnPlateau conditioned on metric missing which is not available but
    # strict is set to `False`. Skipping learning rate update."; lr stays 1.0.
    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
                "monitor": "missing",
                "strict": False,
            },
        }

    trainer = fast_trainer()
    with pytest.warns(
        RuntimeWarning,
        match=r"monitors 'missing', which is not available, and strict is False: "
        r"skipping this learning rate update",
    ):
        trainer.fit(module_returning(make), regression_loader())
    assert lr_of(trainer) == 1.0


def test_one_cycle_with_an_epoch_interval_warns():
    # Lightning 2.6.6 warns: "A `OneCycleLR` scheduler is using 'interval': 'epoch'. Are you sure you didn't mean ..."
    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        return [opt], [torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=10)]

    with pytest.warns(RuntimeWarning, match=r"OneCycleLR scheduler is using 'interval': 'epoch'"):
        fast_trainer().fit(module_returning(make), regression_loader())


# ---------------------------------------------------------------------- stopping mid-epoch
@pytest.mark.parametrize(
    ("kwargs", "lr"),
    [
        ({"max_steps": 6, "max_epochs": 5}, 0.5),  # Lightning 2.6.6: stepped after epoch 0 only
        ({"max_steps": 4, "max_epochs": 5}, 0.5),  # the stop falls on the epoch's last batch: it steps
        ({"max_steps": 2, "max_epochs": 5}, 1.0),
    ],
)
def test_epoch_schedulers_do_not_step_when_max_steps_ends_an_epoch_early(kwargs, lr):
    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]

    trainer = fast_trainer(**kwargs)
    trainer.fit(module_returning(make, base=TrainOnlyModel), regression_loader())
    assert lr_of(trainer) == lr


def test_a_strict_plateau_monitor_is_not_read_when_max_steps_ends_mid_epoch():
    # Lightning 2.6.6: max_steps=2 -> no error, lr 1.0; with max_steps=4 (the epoch's end) it raises.
    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "monitor": "missing"},
        }

    trainer = fast_trainer(max_steps=2, max_epochs=5)
    trainer.fit(module_returning(make, base=TrainOnlyModel), regression_loader())
    assert lr_of(trainer) == 1.0
    with pytest.raises(KeyError, match="monitors 'missing'"):
        fast_trainer(max_steps=4, max_epochs=5).fit(module_returning(make, base=TrainOnlyModel), regression_loader())


def test_epoch_schedulers_do_not_step_when_should_stop_ends_an_epoch_early():
    # Lightning 2.6.6: should_stop at global_step 2 (of 4 per epoch) -> StepLR never steps, lr 1.0.
    class StopAt2(ember.callbacks.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            trainer.should_stop = trainer.global_step == 2

    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]

    trainer = fast_trainer(max_epochs=3, callbacks=[StopAt2()])
    trainer.fit(module_returning(make, base=TrainOnlyModel), regression_loader())
    assert lr_of(trainer) == 1.0 and trainer.global_step == 2
