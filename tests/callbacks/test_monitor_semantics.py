"""EarlyStopping with ``min_epochs`` / ``min_steps``, and the monitors (LearningRateMonitor, Timer,
ModelSummary) as Lightning's.

Every expected value below was checked against Lightning 2.6.6 running the same module (4 training
batches per epoch) and the same callbacks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, EarlyStopping


class Module(ember.TrainModule):
    """Logs ``val_loss`` = ``values[k]`` at the k-th validation (the last value repeats)."""

    def __init__(self, values: list[float] | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.values = values or [1.0]
        self.k = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.tensor(self.values[min(self.k, len(self.values) - 1)]))

    def on_validation_epoch_end(self) -> None:
        self.k += 1

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class EpochEnds(Callback):
    """(current_epoch, global_step, should_stop) at every training epoch end, before EarlyStopping's check."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, bool]] = []

    def on_train_epoch_end(self, trainer: ember.Trainer, module: ember.TrainModule) -> None:
        self.seen.append((trainer.current_epoch, trainer.global_step, trainer.should_stop))


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 2, generator=torch.Generator().manual_seed(0))), batch_size=2)


def trainer(callbacks: list[Callback], **kw: Any) -> ember.Trainer:
    kw.setdefault("max_epochs", 10)
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", any(type(c).__name__ == "ModelCheckpoint" for c in callbacks))
    return ember.Trainer(
        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw
    )


# ---------------------------------------------------------------------------------------------- EarlyStopping
@pytest.mark.parametrize(
    ("min_epochs", "min_steps", "stopped_epoch", "wait", "epochs", "steps", "stop_seen"),
    [
        # val_loss never improves after the first check; patience=1 asks to stop at epoch 1.
        (0, 0, 1, 1, 2, 8, []),
        # min_epochs=5: training goes on to the end of epoch 4; every check asks again (stopped_epoch 4, wait 4)
        (5, 0, 4, 4, 5, 20, [2, 3, 4]),
        # min_steps=10: the stop is honoured mid-epoch, right after step 10 (epoch 2's second batch)
        (0, 10, 2, 2, 3, 10, [2]),
        (3, 3, 2, 2, 3, 12, [2]),
    ],
)
def test_early_stopping_waits_for_min_epochs_and_min_steps(
    min_epochs, min_steps, stopped_epoch, wait, epochs, steps, stop_seen
):
    # Lightning 2.6.6, same module: (min_epochs, min_steps) -> stopped_epoch, wait_count, current_epoch and
    # global_step after fit, and the epochs whose end saw should_stop already True.
    es, ends = EarlyStopping("val_loss", patience=1), EpochEnds()
    t = trainer([ends, es], min_epochs=min_epochs, min_steps=min_steps)
    t.fit(Module(), loader(), loader())
    assert (es.stopped_epoch, es.wait_count, t.current_epoch, t.global_step) == (stopped_epoch, wait, epochs, steps)
    assert t.should_stop is True
    assert [epoch for epoch, _, stop in ends.seen if stop] == stop_seen


def test_a_stop_asked_before_min_epochs_stands_even_if_the_metric_improves_later():
    # Lightning 2.6.6: val_loss 1, 2, .5, .4, ... patience=1, min_epochs=4: the stop asked at epoch 1 ends
    # training once min_epochs is met (4 epochs, 16 steps); stopped_epoch stays 1, wait_count 0, best 0.4.
    es = EarlyStopping("val_loss", patience=1)
    t = trainer([es], min_epochs=4)
    t.fit(Module([1, 2, 0.5, 0.4, 0.3, 0.2, 0.1]), loader(), loader())
    assert (es.stopped_epoch, es.wait_count, t.current_epoch, t.global_step) == (1, 0, 4, 16)
    assert isinstance(es.best_score, torch.Tensor) and es.best_score.item() == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("min_epochs", "min_steps", "stopped_epoch", "wait", "epochs", "steps"),
    [
        (0, 9, 2, 4, 3, 9),  # stops right after step 9, in epoch 2
        (2, 0, 1, 3, 2, 8),  # asked in epoch 0, honoured when epoch 1 ends; every later check asks again
    ],
)
def test_early_stopping_with_validation_twice_per_epoch(min_epochs, min_steps, stopped_epoch, wait, epochs, steps):
    # Lightning 2.6.6, val_check_interval=0.5 (checks after batches 2 and 4), val_loss rising every check.
    es = EarlyStopping("val_loss", patience=1)
    t = trainer([es], min_epochs=min_epochs, min_steps=min_steps, val_check_interval=0.5)
    t.fit(Module([float(v) for v in range(1, 30)]), loader(), loader())
    assert (es.stopped_epoch, es.wait_count, t.current_epoch, t.global_step) == (stopped_epoch, wait, epochs, steps)


def test_best_score_is_a_tensor_and_round_trips_through_the_state():
    es = EarlyStopping("val_loss", mode="max")
    assert isinstance(es.best_score, torch.Tensor) and es.best_score.item() == -float("inf")
    es.best_score = torch.tensor(0.25)
    state = es.state_dict()
    again = EarlyStopping("val_loss", mode="max")
    again.load_state_dict(state)
    assert again.best_score.item() == 0.25


# ---------------------------------------------------------------------------------------------- LearningRateMonitor
class Scheduled(Module):
    """SGD(lr=0.1, momentum=0.9) halved every epoch; logs ``val_loss`` too."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]


class LrAtEpochEnd(Callback):
    def __init__(self) -> None:
        self.seen: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer: ember.Trainer, module: ember.TrainModule) -> None:
        self.seen.append({k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("lr-")})


@pytest.mark.parametrize(("interval", "lrs"), [("epoch", [0.1, 0.05]), ("step", [0.1, 0.1, 0.05, 0.05])])
def test_lr_monitor_exposes_lrs_momentum_and_callback_metrics(tmp_path, interval, lrs):
    # Lightning 2.6.6, 2 epochs of 4 steps, log_every_n_steps=2: lrs {'lr-SGD': [0.1, 0.05]} ("epoch") or
    # [0.1, 0.1, 0.05, 0.05] ("step"); last_momentum_values {'lr-SGD-momentum': 0.9}; callback_metrics hold
    # tensors lr-SGD / lr-SGD-momentum: 0.1 at the end of epoch 0, 0.05 at the end of epoch 1.
    from ember.callbacks import LearningRateMonitor
    from ember.loggers import CSVLogger

    monitor, seen = LearningRateMonitor(logging_interval=interval, log_momentum=True), LrAtEpochEnd()
    t = trainer([monitor, seen], max_epochs=2, logger=CSVLogger(str(tmp_path)), log_every_n_steps=2)
    t.fit(Scheduled(), loader(), loader())
    assert monitor.lrs == {"lr-SGD": lrs}
    assert monitor.last_momentum_values == {"lr-SGD-momentum": 0.9}
    assert seen.seen == [
        {"lr-SGD": pytest.approx(0.1), "lr-SGD-momentum": pytest.approx(0.9)},
        {"lr-SGD": pytest.approx(0.05), "lr-SGD-momentum": pytest.approx(0.9)},
    ]
    assert isinstance(t.callback_metrics["lr-SGD"], torch.Tensor)


def test_early_stopping_and_checkpointing_can_monitor_the_learning_rate(tmp_path):
    # Lightning 2.6.6: EarlyStopping("lr-SGD", mode="max", patience=0) stops at epoch 1 (best 0.1);
    # ModelCheckpoint(monitor="lr-SGD", mode="max") keeps epoch=0-step=4.ckpt (score 0.1); 2 epochs ran.
    from ember.callbacks import LearningRateMonitor, ModelCheckpoint
    from ember.loggers import CSVLogger

    es = EarlyStopping("lr-SGD", mode="max", patience=0)
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="lr-SGD", mode="max")
    t = trainer([LearningRateMonitor(), es, mc], max_epochs=3, logger=CSVLogger(str(tmp_path)), log_every_n_steps=2)
    t.fit(Scheduled(), loader(), loader())
    assert es.stopped_epoch == 1 and es.best_score.item() == pytest.approx(0.1) and t.current_epoch == 2
    assert mc.best_model_path == str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    assert mc.best_model_score.item() == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------- Timer
class Seen(Callback):
    def __init__(self) -> None:
        self.should_stop_at_fit_start: bool | None = None
        self.epochs: list[int] = []

    def on_fit_start(self, trainer: ember.Trainer, module: ember.TrainModule) -> None:
        self.should_stop_at_fit_start = trainer.should_stop

    def on_train_epoch_start(self, trainer: ember.Trainer, module: ember.TrainModule) -> None:
        self.epochs.append(trainer.current_epoch)


def test_timer_checks_its_budget_when_fit_starts():
    # Lightning 2.6.6, Timer(duration={"seconds": 0}): should_stop is set in on_fit_start; no epoch runs.
    from ember.callbacks import Timer

    timer, seen = Timer(duration={"seconds": 0}), Seen()
    t = trainer([timer, seen], max_epochs=3)
    t.fit(Module(), loader())
    assert seen.should_stop_at_fit_start is True and timer.stopped
    assert seen.epochs == [] and t.global_step == 0


def test_timer_checks_its_budget_after_a_resume(tmp_path):
    # Lightning 2.6.6: one epoch trained, the checkpoint's Timer state edited to 5000 s used of 1000 s, resumed
    # with max_epochs=3: should_stop at fit start, no further epoch (global_step 4, current_epoch 1),
    # time_remaining() = -4000.
    from ember.callbacks import Timer

    first = trainer([Timer(duration={"seconds": 1000})], max_epochs=1, default_root_dir=str(tmp_path))
    first.fit(Module(), loader())
    path = str(tmp_path / "one_epoch.ckpt")
    first.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    [key] = [k for k in ckpt["callbacks"] if k.startswith("Timer")]
    ckpt["callbacks"][key]["time_elapsed"]["train"] = 5000.0
    torch.save(ckpt, path)
    timer, seen = Timer(duration={"seconds": 1000}), Seen()
    t = trainer([timer, seen], max_epochs=3, default_root_dir=str(tmp_path))
    t.fit(Module(), loader(), ckpt_path=path)
    assert seen.should_stop_at_fit_start is True and seen.epochs == []
    assert (t.global_step, t.current_epoch) == (4, 1)
    assert timer.time_remaining() == pytest.approx(-4000.0, abs=1.0)


# ---------------------------------------------------------------------------------------------- ModelSummary
class Summarized(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.ReLU())
        self.head = torch.nn.Linear(4, 1)
        self.head.weight.requires_grad_(False)
        self.register_buffer("buf", torch.zeros(3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.head(self.enc(batch[0])).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_model_summary_summarize_is_the_override_point(capsys):
    # Lightning 2.6.6, ModelSummary(max_depth=2, foo=1) with summarize overridden: called once at fit start
    # with the columns (' ', ['0'..'3']), ('Name', ['enc', 'enc.0', 'enc.1', 'head']),
    # ('Type', ['Sequential', 'Linear', 'ReLU', 'Linear']), ..., ('Mode', ['train'] * 4); 17 parameters,
    # 13 trainable; {'train': 4, 'eval': 0}; total_flops 0; summarize_kwargs {'foo': 1}.
    # (ember adds Trainable/Frozen columns, and its model size counts buffers too.)
    from ember.callbacks import ModelSummary

    calls: list[tuple[Any, ...]] = []

    class Recording(ModelSummary):
        @staticmethod
        def summarize(
            summary_data: Any,
            total_parameters: int,
            trainable_parameters: int,
            model_size: float,
            total_training_modes: dict[str, int],
            total_flops: int = 0,
            **kwargs: Any,
        ) -> None:
            calls.append(
                (
                    summary_data,
                    total_parameters,
                    trainable_parameters,
                    model_size,
                    total_training_modes,
                    total_flops,
                    kwargs,
                )
            )

    t = trainer([Recording(max_depth=2, foo=1)], max_epochs=1)
    t.fit(Summarized(), loader())
    [(data, total, trainable, size, modes, flops, kwargs)] = calls
    columns = dict(data)
    assert [h for h, _ in data][:4] == [" ", "Name", "Type", "Params"] and data[-1][0] == "Mode"
    assert columns[" "] == ["0", "1", "2", "3"] and columns["Name"] == ["enc", "enc.0", "enc.1", "head"]
    assert columns["Type"] == ["Sequential", "Linear", "ReLU", "Linear"] and columns["Mode"] == ["train"] * 4
    assert (total, trainable, modes, flops, kwargs) == (17, 13, {"train": 4, "eval": 0}, 0, {"foo": 1})
    assert size == pytest.approx((17 + 3) * 4 / 1e6)
    assert "Total params" not in capsys.readouterr().out  # the override replaced the printing


def test_model_summary_max_depth_zero_turns_it_off(capsys):
    # Lightning 2.6.6: ModelSummary(max_depth=0) does not call summarize.
    from ember.callbacks import ModelSummary

    t = trainer([ModelSummary(max_depth=0)], max_epochs=1)
    t.fit(Summarized(), loader())
    assert "Total params" not in capsys.readouterr().out
