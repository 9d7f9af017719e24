"""What a Lightning 2.6 user sees of a run: zero_grad calls, what the loggers get from validate / test, the
results table, callbacks (their order, deep copies), ``strict_loading``, a misspelt optimizer key, the
messages a program without logging configuration prints, and the epoch values the progress bar shows."""

from __future__ import annotations

import copy
import io
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ember
from ember.callbacks import Callback
from ember.loggers import Logger
from tests.helpers.dist import join_as_rank, run_ranks
from tests.helpers.models import BoringModel, TrainOnlyModel, fast_trainer, regression_loader


class Recording(Logger):
    def __init__(self) -> None:
        self.calls: list[tuple[dict, int | None]] = []

    def log_metrics(self, metrics, step=None):
        self.calls.append((dict(metrics), step))


def test_zero_grad_is_called_once_per_optimizer_step():
    class M(TrainOnlyModel):
        def configure_optimizers(self):
            opt = super().configure_optimizers()
            original, self.calls = opt.zero_grad, 0

            def zero_grad(*args, **kwargs):
                self.calls += 1
                return original(*args, **kwargs)

            opt.zero_grad = zero_grad
            return opt

    module = M()
    fast_trainer(max_epochs=2, limit_train_batches=3).fit(module, regression_loader())
    assert module.calls == 6  # not one more at the start of fit (as Lightning)


def test_validate_and_test_without_logged_values_send_the_loggers_nothing():
    logger = Recording()
    trainer = fast_trainer(logger=logger)
    trainer.validate(BoringModel(), regression_loader())  # logs val_loss
    assert [sorted(m) for m, _ in logger.calls] == [["epoch", "val_loss"]]
    logger.calls.clear()

    class Quiet(BoringModel):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            pass

        def test_step(self, batch, batch_idx, dataloader_idx=0):
            pass

    trainer.validate(Quiet(), regression_loader())
    trainer.test(Quiet(), regression_loader())
    assert logger.calls == []  # not a lone {"epoch": 0}


def test_validate_and_test_print_lightnings_results_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")

    class M(BoringModel):
        def test_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("test_loss", torch.tensor(0.5 + dataloader_idx))

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("val_acc", 0.25)
            self.log("a_very_long_metric_name_that_goes_on_and_on_and_on_forever_and_ever", 1.0)

    trainer = fast_trainer()
    capsys.readouterr()
    trainer.test(M(), [regression_loader(8), regression_loader(8)])
    rule = "─" * 80
    # As Lightning 2.6.6 prints it without `rich` (checked against it with COLUMNS=80).
    assert capsys.readouterr().out == "\n".join(
        [
            rule,
            "       Test metric             DataLoader 0             DataLoader 1",
            rule,
            "        test_loss                   0.5                      1.5",
            rule,
            "",
        ]
    )
    trainer.validate(M(), regression_loader(8))
    assert capsys.readouterr().out == "\n".join(
        [
            rule,
            "            Validate metric                           DataLoader 0",
            rule,
            "a_very_long_metric_name_that_goes_on_and                  1.0",
            "      _on_and_on_forever_and_ever",
            "                val_acc                                   0.25",
            rule,
            "",
        ]
    )
    trainer.test(M(), regression_loader(8), verbose=False)
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------- callbacks
def test_checkpoint_callbacks_run_after_the_others(tmp_path):
    class Mine(Callback):
        pass

    class Extra(Callback):
        pass

    ckpt, mine = ember.callbacks.ModelCheckpoint(dirpath=tmp_path), Mine()
    stop = ember.callbacks.EarlyStopping("train_loss")
    trainer = ember.Trainer(callbacks=[ckpt, mine, stop], default_root_dir=tmp_path, logger=False)
    assert [type(c).__name__ for c in trainer.callbacks] == ["Mine", "EarlyStopping", "ProgressBar", "ModelCheckpoint"]

    class M(TrainOnlyModel):
        def configure_callbacks(self):
            return [Extra()]

    trainer.fit(M(), regression_loader())
    assert [type(c).__name__ for c in trainer.callbacks][-2:] == ["Extra", "ModelCheckpoint"]


def test_callbacks_can_be_deep_copied_before_and_after_a_fit(tmp_path):
    trainer = ember.Trainer(
        max_epochs=1,
        default_root_dir=tmp_path,
        accelerator="cpu",
        callbacks=[ember.callbacks.ProgressBar(mode="bar", stream=sys.stderr)],
    )
    copies = copy.deepcopy(trainer.callbacks)
    assert [type(c) for c in copies] == [type(c) for c in trainer.callbacks]
    trainer.fit(BoringModel(), regression_loader(), regression_loader())
    bar = copy.deepcopy(trainer.callbacks)[0]
    assert isinstance(bar, ember.callbacks.ProgressBar) and bar is not trainer.callbacks[0]


# ---------------------------------------------------------------------- strict_loading, optimizer keys
class Partial(BoringModel):
    """Saves its head only (a frozen backbone is rebuilt, not saved): the case strict_loading=False is for."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(4, 4)
        self.strict_loading = False

    def on_save_checkpoint(self, checkpoint):
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("backbone")}


def test_strict_loading_false_resumes_from_a_partial_checkpoint(tmp_path):
    path = str(tmp_path / "partial.ckpt")
    trainer = fast_trainer()
    trainer.fit(Partial(), regression_loader())
    trainer.save_checkpoint(path)
    assert not any(k.startswith("backbone") for k in torch.load(path, weights_only=False)["state_dict"])
    resumed = fast_trainer(max_epochs=2)
    resumed.fit(Partial(), regression_loader(), ckpt_path=path)
    assert resumed.current_epoch == 2
    fast_trainer().validate(Partial(), regression_loader(), ckpt_path=path, verbose=False)
    strict = Partial()
    strict.strict_loading = True
    with pytest.raises(ValueError, match=r"missing keys \(in the module, not in the checkpoint\): backbone"):
        fast_trainer(max_epochs=2).fit(strict, regression_loader(), ckpt_path=path)


def test_load_from_checkpoint_follows_strict_loading(tmp_path):
    path = str(tmp_path / "partial.ckpt")
    trainer = fast_trainer()
    trainer.fit(Partial(), regression_loader())
    trainer.save_checkpoint(path)
    with pytest.warns(
        UserWarning,
        match=r"keys of Partial not in the checkpoint \(left as built\): "
        r"\['backbone.weight', 'backbone.bias'\]",
    ):
        Partial.load_from_checkpoint(path)
    with pytest.raises(ValueError, match=r"strict=True\) conflicts with Partial.strict_loading=False"):
        Partial.load_from_checkpoint(path, strict=True)
    assert BoringModel().strict_loading is True


@pytest.mark.parametrize("key, hint", [("scheduler", "lr_scheduler"), ("monitr", "monitor")])
def test_a_misspelt_key_of_the_optimizer_dict_is_refused(key, hint):
    class M(TrainOnlyModel):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), key: None}

    with pytest.raises(ValueError, match=rf"unknown key\(s\) '{key}' \(did you mean '{hint}'\?\)"):
        fast_trainer().fit(M(), regression_loader())


# ---------------------------------------------------------------------- messages without logging configured
_SCRIPT = textwrap.dedent("""
    import sys
    import ember
    from tests.helpers.models import BoringModel, fast_trainer, regression_loader
    stop = ember.callbacks.EarlyStopping("val_loss", verbose=True)
    trainer = fast_trainer(max_epochs=1, callbacks=[stop])
    trainer.fit(BoringModel(), regression_loader(), regression_loader())
    trainer.save_checkpoint(sys.argv[1])
    fast_trainer(max_epochs=2).fit(BoringModel(), regression_loader(), regression_loader(), ckpt_path=sys.argv[1])
    fast_trainer().validate(BoringModel(), regression_loader(), ckpt_path=sys.argv[1], verbose=False)
""")


@pytest.mark.processes
def test_info_messages_reach_stderr_when_the_program_configures_no_logging(tmp_path):
    path = str(tmp_path / "a.ckpt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("RANK", None)
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, path],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert any(line.startswith("EarlyStopping: 'val_loss' improved to ") for line in lines), out.stderr
    assert f"Restored all states from the checkpoint at {path} (epoch 1, global step 4)" in lines, out.stderr
    assert f"Loaded model weights from the checkpoint at {path}" in lines, out.stderr


def test_with_logging_configured_the_messages_go_to_its_handlers(tmp_path, caplog):
    path = str(tmp_path / "a.ckpt")
    trainer = fast_trainer()
    trainer.fit(BoringModel(), regression_loader())
    trainer.save_checkpoint(path)
    with caplog.at_level(logging.INFO, logger="ember"):
        fast_trainer(max_epochs=2).fit(BoringModel(), regression_loader(), ckpt_path=path)
    assert f"Restored all states from the checkpoint at {path} (epoch 1, global step 4)" in caplog.messages


# ---------------------------------------------------------------------- the epoch values the bar shows
class EpochMean(ember.TrainModule):
    """Logs ``m`` = 10 * (epoch + 1) + rank each step, for the progress bar, averaged over the epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        self.log("m", 10.0 * (self.current_epoch + 1) + self.global_rank, prog_bar=True, on_step=False, on_epoch=True)
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _epoch_lines(stream: io.StringIO) -> list[str]:
    return [line.split("done")[1].split()[-1] for line in stream.getvalue().splitlines() if " done " in line]


def test_the_epoch_line_shows_this_epochs_value():
    stream = io.StringIO()
    bar = ember.callbacks.ProgressBar(mode="lines", stream=stream)
    fast_trainer(max_epochs=2, callbacks=[bar], enable_progress_bar=True).fit(EpochMean(), regression_loader())
    assert _epoch_lines(stream) == ["m=10", "m=20"]  # epoch 1 used to show epoch 0's mean


def test_a_callbacks_epoch_end_reads_this_epochs_progress_bar_value():
    seen = []

    class Reader(Callback):
        def on_train_epoch_end(self, trainer, module):
            seen.append(float(trainer.progress_bar_metrics["m"]))

    fast_trainer(max_epochs=2, callbacks=[Reader()]).fit(EpochMean(), regression_loader())
    assert seen == [10.0, 20.0]  # as Lightning 2.6.6 (ember showed [nothing, 10.0])


def _ddp_epoch_lines(rank: int, world: int) -> tuple[list[str], float]:
    join_as_rank(rank, world)  # join run_ranks' process group
    stream = io.StringIO()
    bar = ember.callbacks.ProgressBar(mode="lines", stream=stream)
    trainer = ember.Trainer(
        max_epochs=2,
        accelerator="cpu",
        strategy="ddp",
        devices=world,
        logger=False,
        enable_checkpointing=False,
        callbacks=[bar],
    )
    trainer.fit(EpochMean(), regression_loader())
    return _epoch_lines(stream), float(trainer.callback_metrics["m"])


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_under_ddp_the_bar_shows_the_reduced_epoch_value():
    (lines0, metric0), (lines1, metric1) = run_ranks(_ddp_epoch_lines, 2, timeout=80)
    assert metric0 == metric1 == 20.5
    assert lines0 == ["m=10.5", "m=20.5"] and lines1 == []  # not rank 0's own 10 and 20
