"""Progress output: tqdm bars in a pseudo-terminal, compact timed lines in a pipe or a file."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ProgressBar
from ember.callbacks import progress_bar as progress_bar_module
from tests.helpers.models import OtherRank

SCRIPT = r"""
import sys
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import ember
from ember.callbacks import ProgressBar

class Tiny(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y), prog_bar=True)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
trainer = ember.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, num_sanity_val_steps=1,
                        callbacks=[ProgressBar(refresh_rate=2, line_interval=0.0)])
trainer.fit(Tiny(), DataLoader(ds, batch_size=4), DataLoader(ds, batch_size=8))
print("FIT DONE", flush=True)
"""


def _start(tmp_path, stdout):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TQDM_DISABLE", None)
    return subprocess.Popen(
        [sys.executable, str(script)],
        stdout=stdout,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=str(tmp_path),
    )


def _read_pty(master: int, proc: subprocess.Popen, timeout: float) -> bytes:
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    return b"".join(chunks)


@pytest.mark.processes
def test_bar_mode_in_a_terminal_and_line_mode_in_a_pipe(tmp_path):
    (tmp_path / "tty").mkdir()
    (tmp_path / "pipe").mkdir()
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    tty_proc = _start(tmp_path / "tty", slave)
    os.close(slave)
    pipe_proc = _start(tmp_path / "pipe", subprocess.PIPE)
    try:
        tty_out = _read_pty(master, tty_proc, timeout=60).decode("utf-8", "replace")
        tty_err = tty_proc.communicate(timeout=60)[1].decode()
        pipe_out, pipe_err = (b.decode() for b in pipe_proc.communicate(timeout=60))
    finally:
        os.close(master)
        for proc in (tty_proc, pipe_proc):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    # terminal: tqdm bars redrawn in place, a validation bar that reaches 100%
    assert tty_proc.returncode == 0 and "Traceback" not in tty_err, tty_err
    assert "FIT DONE" in tty_out
    assert re.search(r"\r(?!\n)", tty_out), "no in-place redraw in a terminal"
    assert re.search(r"Epoch 1/1: 100%\|.*16/16", tty_out)  # 0-based, as the line mode: epoch 1 of 0..1
    assert "it/s" in tty_out and "train/loss=" in tty_out
    assert re.search(r"Validation: 100%\|.*8/8", tty_out)
    assert " done " not in tty_out  # no line-mode output

    # pipe: plain lines, no carriage return at all
    assert pipe_proc.returncode == 0 and "Traceback" not in pipe_err, pipe_err
    assert "\r" not in pipe_out and "\r" not in pipe_err
    lines = pipe_out.splitlines()
    assert lines[-1] == "FIT DONE"
    progress = [ln for ln in lines if ln.startswith("Epoch 0/1  ")]
    assert [re.match(r"Epoch 0/1  (\d+)/16", ln).group(1) for ln in progress] == [str(n) for n in range(2, 17, 2)]
    assert all("it/s" in ln and "train/loss=" in ln for ln in progress)
    done = [ln for ln in lines if " done " in ln]
    # one line per epoch, the validation's metrics folded in
    assert [ln.split("  ")[0] for ln in done] == ["Epoch 0/1 done", "Epoch 1/1 done"]
    assert all(re.search(r"val/loss=\S+", ln) for ln in done)
    assert not any(ln.startswith("Sanity check") for ln in lines)
    assert all(len(ln) < 200 for ln in lines)


class Tiny(ember.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y), prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", F.mse_loss(self.net(x), y), prog_bar=True)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data(n=32, bs=4):
    ds = TensorDataset(torch.randn(n, 4), torch.randn(n, 1))
    return DataLoader(ds, batch_size=bs)


def run(bar, strategy="auto", epochs=2):
    trainer = ember.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        callbacks=[bar],
        num_sanity_val_steps=1,
        strategy=strategy,
    )
    module = Tiny()
    trainer.fit(module, data(), data(16, 8))
    return trainer, module


def test_line_mode_on_a_non_terminal_stream(tmp_path):
    out = io.StringIO()
    bar = ProgressBar(line_interval=3600.0, stream=out)  # only the closing lines
    trainer, module = run(bar)
    assert bar.is_line_mode
    trainer.test(module, data(16, 8))
    trainer.predict(module, data(16, 8))
    lines = out.getvalue().splitlines()
    assert [ln.split("  ")[0] for ln in lines] == [
        "Epoch 0/1 done",
        "Epoch 1/1 done",
        "Testing done",
        "Predicting done",
    ]
    assert re.match(r"Epoch 1/1 done  8/8 \(100%\)  [\d.]+ it/s  \d\d:\d\d  train/loss=\S+ val/loss=\S+$", lines[1])
    assert "test/loss=" in lines[2]
    assert "\r" not in out.getvalue()


def test_forced_bar_mode_and_zero_refresh_rate():
    out = io.StringIO()
    run(ProgressBar(mode="bar", stream=out), epochs=1)
    assert "\r" in out.getvalue() and "Epoch 0" in out.getvalue()
    silent = io.StringIO()
    run(ProgressBar(refresh_rate=0, stream=silent), epochs=1)
    run(ProgressBar(refresh_rate=0, mode="bar", stream=silent), epochs=1)
    assert silent.getvalue() == ""


def test_metrics_are_converted_only_when_something_is_printed(monkeypatch):
    calls = []
    real = progress_bar_module.to_floats

    def counting(metrics):
        calls.append(1)
        return real(metrics)

    monkeypatch.setattr(progress_bar_module, "to_floats", counting)
    out = io.StringIO()
    run(ProgressBar(line_interval=3600.0, stream=out))
    assert len(calls) == len(out.getvalue().splitlines()) == 2  # 2 epochs of 8 batches: 2 lines, 2 conversions


@pytest.mark.parametrize("mode", ["bar", "lines"])
def test_nothing_is_printed_on_other_ranks(mode, capsys):
    out = io.StringIO()
    run(ProgressBar(mode=mode, stream=out, line_interval=0.0), strategy=OtherRank())
    run(ProgressBar(mode=mode, line_interval=0.0), strategy=OtherRank(), epochs=1)
    assert out.getvalue() == ""
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="refresh_rate"):
        ProgressBar(refresh_rate=-1)
    with pytest.raises(ValueError, match="mode"):
        ProgressBar(mode="fancy")
    with pytest.raises(ValueError, match="line_interval"):
        ProgressBar(line_interval=-1)


DDP_SCRIPT = r"""
import sys
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import ember
from ember.callbacks import ProgressBar
from ember.loggers import CSVLogger

class Tiny(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

if __name__ == "__main__":
    ds = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    trainer = ember.Trainer(strategy="ddp_spawn", devices=2, accelerator="cpu", max_epochs=2, log_every_n_steps=1,
                            enable_checkpointing=False, default_root_dir=sys.argv[1], logger=CSVLogger(),
                            callbacks=[ProgressBar(mode="lines", line_interval=0.0)])
    trainer.fit(Tiny(), DataLoader(ds, batch_size=4))
    print("FIT DONE", flush=True)
"""


@pytest.mark.processes
def test_only_rank_zero_prints_and_logs_under_ddp(tmp_path):
    import importlib.util

    if importlib.util.find_spec("ember.strategies.ddp") is None:
        pytest.skip("the ddp strategy is not in this build yet")
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    # each rank runs 4 of the 8 batches per epoch; only rank zero's progress is printed, once
    assert [ln.split("  ")[0] for ln in lines if " done " in ln] == ["Epoch 0/1 done", "Epoch 1/1 done"]
    assert len([ln for ln in lines if ln.startswith("Epoch 0/1  ")]) == 4
    # the end-of-fit line: once (rank zero's), after the progress
    assert [ln for ln in lines if ln.startswith("ember: ")] == ["ember: logs in ember_logs/version_0"]
    assert lines[-2:] == ["ember: logs in ember_logs/version_0", "FIT DONE"]
    assert os.listdir(tmp_path / "ember_logs") == ["version_0"]
    rows = (tmp_path / "ember_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    # 8 steps, rank zero's rows only, each written (as Lightning) at the step's index: 0..7
    assert [r.split(",")[0] for r in rows] == ["step", *map(str, range(8))]


def test_bar_mode_redraws_at_most_every_mininterval():
    # tqdm's refresh() does not advance its own redraw clock, so pacing must not rely on it:
    # a 3000-batch epoch (well over the 0.1 s redraw interval) redraws a handful of times, not per batch.
    out = io.StringIO()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(3000, 4), torch.randn(3000, 1)), batch_size=1
    )
    trainer = ember.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        accelerator="cpu",
        callbacks=[ProgressBar(mode="bar", stream=out)],
    )
    start = time.monotonic()
    trainer.fit(Tiny(), loader)
    elapsed = time.monotonic() - start
    redraws = out.getvalue().count("\r")
    assert elapsed > 0.2  # long enough for a per-batch redraw bug to show
    assert redraws <= 6 + 2 * elapsed / 0.1, (redraws, elapsed)


def _fit_lines(epochs=3, **trainer_kwargs):
    """The closing lines of a fit in line mode (timed lines off: one an hour)."""
    out = io.StringIO()
    trainer = ember.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=[ProgressBar(line_interval=3600.0, stream=out)],
        **trainer_kwargs,
    )
    module = Tiny()
    trainer.fit(module, data(), data(16, 8))
    return trainer, module, out


def test_one_line_per_epoch_with_the_validation_metrics_folded_in():
    trainer, module, out = _fit_lines(epochs=3)
    lines = out.getvalue().splitlines()
    assert [ln.split("  ")[0] for ln in lines] == ["Epoch 0/2 done", "Epoch 1/2 done", "Epoch 2/2 done"]
    assert all(re.search(r"  train/loss=\S+ val/loss=\S+$", ln) for ln in lines), lines
    # the last line shows the metrics the fit ended with
    assert lines[-1].endswith(f"val/loss={float(trainer.callback_metrics['val/loss']):.4g}")
    # a standalone validate still prints its own line
    out.truncate(0), out.seek(0)
    trainer.validate(module, data(16, 8))
    assert [ln.split("  ")[0] for ln in out.getvalue().splitlines()] == ["Validation done"]
    assert "val/loss=" in out.getvalue()


def test_the_last_of_ten_epochs_is_epoch_9_of_0_to_9_in_both_modes():
    _, _, out = _fit_lines(epochs=10, limit_train_batches=1, limit_val_batches=1)
    lines = out.getvalue().splitlines()
    assert [ln.split("  ")[0] for ln in lines] == [f"Epoch {i}/9 done" for i in range(10)]
    bar = io.StringIO()
    ember.Trainer(
        max_epochs=10,
        logger=False,
        enable_checkpointing=False,
        limit_train_batches=1,
        limit_val_batches=1,
        callbacks=[ProgressBar(mode="bar", stream=bar)],
    ).fit(Tiny(), data(), data(16, 8))
    assert "Epoch 9/9: 100%" in bar.getvalue() and "Epoch 10" not in bar.getvalue()
    # without an epoch limit: no total
    _, _, out = _fit_lines(epochs=-1, max_steps=10)
    assert [ln.split("  ")[0] for ln in out.getvalue().splitlines()] == ["Epoch 0 done", "Epoch 1 done"]


def test_validation_every_2_epochs_shows_its_metrics_only_in_the_epochs_that_validated():
    _, _, out = _fit_lines(epochs=4, check_val_every_n_epoch=2)
    lines = out.getvalue().splitlines()
    assert [ln.split("  ")[0] for ln in lines] == [f"Epoch {i}/3 done" for i in range(4)]
    assert ["val/loss=" in ln for ln in lines] == [False, True, False, True]  # no stale value shown as new
    assert all("train/loss=" in ln for ln in lines)


def test_a_mid_epoch_validation_keeps_its_own_line():
    _, _, out = _fit_lines(epochs=2, val_check_interval=0.5)
    lines = out.getvalue().splitlines()
    assert [ln.split("  ")[0] for ln in lines] == [
        "Validation done",
        "Epoch 0/1 done",
        "Validation done",
        "Epoch 1/1 done",
    ]
    assert all("val/loss=" in ln for ln in lines)
    # the mid-epoch line shows the metrics of its moment, not those of the batch after it
    assert re.match(r"Validation done  2/2 \(100%\)", lines[0])


def test_a_validation_whose_epoch_fails_still_gets_its_line():
    class Boom(Callback):
        def on_train_epoch_end(self, trainer, module):
            raise RuntimeError("boom")

    out = io.StringIO()
    trainer = ember.Trainer(
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=[Boom(), ProgressBar(line_interval=3600.0, stream=out)],
    )
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Tiny(), data(), data(16, 8))
    lines = out.getvalue().splitlines()
    assert [ln.split("  ")[0] for ln in lines] == ["Validation done"] and "val/loss=" in lines[0]
