"""``Trainer(profiler=...)``: what each profiler records and reports, where the report goes, and that
with no profiler the step path is the plain bound methods (nothing wrapped)."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.profilers import AdvancedProfiler, PassThroughProfiler, Profiler, PyTorchProfiler, SimpleProfiler
from tests.helpers.models import regression_loader


class Net(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))

    def on_train_epoch_end(self):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, profiler, **kwargs) -> ember.Trainer:
    # The default configuration: logger and checkpointing on.
    trainer = ember.Trainer(
        accelerator="cpu",
        max_epochs=2,
        profiler=profiler,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        log_every_n_steps=1,
        **kwargs,
    )
    trainer.fit(Net(), regression_loader(n=32, batch_size=8), regression_loader(n=16, batch_size=8))
    return trainer


STEP_ACTIONS = (
    "run_training_epoch",
    "run_training_batch",
    "[FitLoop].train_dataloader_next",
    "[Strategy]SingleDeviceStrategy.training_step",
    "[Strategy]SingleDeviceStrategy.backward",
    "[TrainModule]Net.optimizer_step",
    "[Strategy]SingleDeviceStrategy.validation_step",
    "[TrainModule]Net.on_train_epoch_end",
    "[Callback]ModelCheckpoint.on_train_epoch_end",
)


def test_simple_profiler_times_every_part_of_the_step_and_prints_the_table(tmp_path, capsys):
    profiler = SimpleProfiler()
    fit(tmp_path, profiler)
    out = capsys.readouterr().out
    assert "FIT Profiler Report" in out
    for action in STEP_ACTIONS:
        assert action in out, action
    # 2 epochs x 4 batches; the loader's next is asked once more per epoch (the StopIteration).
    rows = {
        line.split("|")[1].strip(): line.split("|")[3].strip() for line in out.splitlines() if line.startswith("|  ")
    }
    assert rows["run_training_epoch"] == "2"
    assert rows["run_training_batch"] == "8"
    assert rows["[Strategy]SingleDeviceStrategy.backward"] == "8"
    assert rows["[FitLoop].train_dataloader_next"] == "10"


def test_the_profiler_by_name(tmp_path, capsys):
    trainer = fit(tmp_path, "simple")
    assert isinstance(trainer.profiler, SimpleProfiler)
    assert "run_training_batch" in capsys.readouterr().out


def test_a_filename_writes_the_report_to_the_log_folder_and_a_second_run_appends(tmp_path, capsys):
    profiler = SimpleProfiler(filename="perf")
    trainer = fit(tmp_path, profiler)
    path = os.path.join(trainer.log_dir, "fit-perf.txt")
    assert os.path.isfile(path)
    assert "FIT Profiler Report" not in capsys.readouterr().out  # written, not printed
    trainer.validate(trainer.module, regression_loader(n=16, batch_size=8))
    text = open(path).read()
    assert "run_training_batch" in text
    validate_path = os.path.join(trainer.log_dir, "validate-perf.txt")
    assert "[Strategy]SingleDeviceStrategy.validation_step" in open(validate_path).read()
    trainer.fit(trainer.module, regression_loader(n=32, batch_size=8))
    assert open(path).read().count("FIT Profiler Report") == 2  # appended, nothing overwritten


def test_dirpath_is_used_when_given(tmp_path):
    profiler = SimpleProfiler(dirpath=tmp_path / "prof", filename="perf")
    fit(tmp_path, profiler)
    assert os.path.isfile(tmp_path / "prof" / "fit-perf.txt")


def test_advanced_profiler_reports_cprofile_stats_per_action_with_nested_actions(tmp_path):
    profiler = AdvancedProfiler(dirpath=tmp_path, filename="adv")
    fit(tmp_path, profiler, logger=False)
    text = open(tmp_path / "fit-adv.txt").read()
    assert "Profile stats for: run_training_batch" in text
    assert "Profile stats for: [Strategy]SingleDeviceStrategy.backward" in text
    # The outer action keeps counting after a nested one stops: Python frames of the loop show up.
    batch = text.split("Profile stats for: run_training_batch")[1].split("Profile stats for:")[0]
    assert "function calls" in batch and "step.py" in batch


def test_pytorch_profiler_writes_a_chrome_trace_and_an_operator_table(tmp_path):
    profiler = PyTorchProfiler(dirpath=tmp_path, filename="torch", row_limit=5)
    fit(tmp_path, profiler, logger=False)
    traces = glob.glob(str(tmp_path / "*.pt.trace.json"))
    assert len(traces) == 1 and profiler.trace_paths == traces
    events = json.load(open(traces[0]))["traceEvents"]
    names = {e.get("name") for e in events}
    assert "run_training_batch" in names and "[Strategy]SingleDeviceStrategy.backward" in names
    table = open(tmp_path / "fit-torch.txt").read()
    assert "Self CPU time total" in table and "run_training_epoch" in table


def test_a_custom_profiler_gets_setup_actions_and_describe():
    class Recording(Profiler):
        def __init__(self):
            super().__init__()
            self.started, self.stopped, self.stages = [], [], []

        def start(self, action_name):
            self.started.append(action_name)

        def stop(self, action_name):
            self.stopped.append(action_name)

        def setup(self, stage, local_rank=None, log_dir=None):
            super().setup(stage, local_rank, log_dir)
            self.stages.append((stage, local_rank))

    profiler = Recording()
    trainer = ember.Trainer(
        accelerator="cpu",
        max_steps=3,
        profiler=profiler,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Net(), regression_loader(n=32, batch_size=8))
    assert profiler.stages == [("fit", None)]
    assert profiler.started.count("run_training_batch") == 3
    assert sorted(profiler.started) == sorted(profiler.stopped)


def test_no_profiler_leaves_the_step_path_unwrapped(tmp_path):
    """Off costs nothing: the loop calls the strategy's and module's bound methods themselves."""
    seen = {}

    class Spy(ember.callbacks.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            step = trainer.fit_loop.step
            seen.update(
                training_step=step._training_step,
                backward=step._backward,
                optimizer_step=step._optimizer_step,
                strategy=trainer.strategy,
            )

    trainer = ember.Trainer(
        accelerator="cpu",
        max_steps=1,
        callbacks=[Spy()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    assert isinstance(trainer.profiler, PassThroughProfiler)
    module = Net()
    trainer.fit(module, regression_loader(n=32, batch_size=8))
    assert seen["training_step"] == seen["strategy"].training_step
    assert seen["backward"] == seen["strategy"].backward
    assert seen["optimizer_step"] == module.optimizer_step


def test_a_misspelt_profiler_name_is_an_error_with_a_suggestion():
    with pytest.raises(ValueError, match="Did you mean 'simple'"):
        ember.Trainer(profiler="simpel")
    with pytest.raises(ValueError, match="'simple', 'advanced', 'pytorch'"):
        ember.Trainer(profiler=3)


def test_simple_profiler_refuses_unbalanced_actions():
    profiler = SimpleProfiler()
    profiler.start("a")
    with pytest.raises(ValueError, match="already started"):
        profiler.start("a")
    with pytest.raises(ValueError, match="never started"):
        profiler.stop("b")
