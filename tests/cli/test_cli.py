"""``EmberCLI``: the example run as a user runs it (``python examples/cli_digits.py fit --config
cli_digits.yaml``, then ``test`` from the saved config), ``--print_config``, misspelt keys, the
saved configuration (never overwritten), links, and the in-process API."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ember
from tests.helpers.models import regression_data

pytest.importorskip("jsonargparse")
yaml = pytest.importorskip("yaml")

from ember.cli import EmberCLI  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SRC = Path(__file__).resolve().parents[2] / "src"


def run(cwd: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(EXAMPLES / "cli_digits.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _fail(proc: subprocess.CompletedProcess[str]) -> str:
    return f"status {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"


@pytest.mark.processes
@pytest.mark.timeout(400)
def test_the_example_fits_from_yaml_saves_its_config_and_tests_from_it(tmp_path):
    config = str(EXAMPLES / "cli_digits.yaml")
    proc = run(tmp_path, "fit", "--config", config, "--model.lr", "0.01")
    assert proc.returncode == 0, _fail(proc)
    run_dir = tmp_path / "ember_logs" / "version_0"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    # The YAML's values, the command line's override, and the defaults the YAML left out.
    assert saved["trainer"]["max_epochs"] == 2 and saved["trainer"]["limit_train_batches"] == 8
    assert saved["model"] == {"lr": 0.01, "channels": 8} and saved["data"] == {"batch_size": 32, "split_seed": 0}
    assert saved["seed_everything"] == 0
    assert saved["trainer"]["callbacks"][0]["class_path"] == "ember.callbacks.ModelCheckpoint"
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_file()
    # The saved config repeats the run's settings for another entry point; this one logs to a new version.
    proc = run(tmp_path, "test", "--config", str(run_dir / "config.yaml"), "--ckpt_path", str(last))
    assert proc.returncode == 0, _fail(proc)
    assert "test/acc" in proc.stdout
    assert (tmp_path / "ember_logs" / "version_1" / "config.yaml").is_file()


@pytest.mark.processes
@pytest.mark.timeout(200)
def test_print_config_and_a_misspelt_key_in_the_yaml(tmp_path):
    proc = run(tmp_path, "fit", "--config", str(EXAMPLES / "cli_digits.yaml"), "--print_config")
    assert proc.returncode == 0, _fail(proc)
    printed = yaml.safe_load(proc.stdout)
    assert printed["trainer"]["max_epochs"] == 2 and printed["trainer"]["max_steps"] == -1  # given and default
    assert printed["model"]["lr"] == 0.005 and "profiler" in printed["trainer"]
    assert not (tmp_path / "ember_logs").exists()  # printing runs nothing
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_epoch: 1\n")
    proc = run(tmp_path, "fit", "--config", str(bad))
    assert proc.returncode != 0
    assert "max_epoch" in proc.stderr and not (tmp_path / "ember_logs").exists()


# ---------------------------------------------------------------------- in-process
class Net(ember.TrainModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1, out: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, out))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Data(ember.DataModule):
    def __init__(self, batch_size: int = 8, width: int = 1) -> None:
        super().__init__()
        self.batch_size, self.width = batch_size, width

    def train_dataloader(self):
        return DataLoader(regression_data(32), batch_size=self.batch_size)


class LinkedCLI(EmberCLI):
    def add_arguments_to_parser(self, parser):
        parser.link_arguments("data.width", "model.out")


def test_arguments_links_and_defaults_build_the_objects(tmp_path):
    cli = LinkedCLI(
        Net,
        Data,
        trainer_defaults={"enable_progress_bar": False, "logger": False},
        args=[
            "fit",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_epochs=1",
            "--model.hidden=5",
            "--data.batch_size=16",
            "--data.width=1",
            "--seed_everything=3",
        ],
    )
    assert cli.model.hparams.hidden == 5 and cli.model.hparams.out == 1 and cli.datamodule.batch_size == 16
    assert cli.trainer.global_step == 2 and cli.trainer.current_epoch == 1
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["seed_everything"] == 3 and saved["trainer"]["logger"] is False


def test_a_saved_config_is_never_overwritten(tmp_path):
    args = [
        "fit",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_epochs=1",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
    ]
    EmberCLI(Net, Data, args=args)
    before = (tmp_path / "config.yaml").read_text()
    with pytest.raises(RuntimeError, match="already exists.*does not overwrite"):
        EmberCLI(Net, Data, args=[*args, "--model.hidden=3"])
    assert (tmp_path / "config.yaml").read_text() == before
    EmberCLI(Net, Data, args=[*args, "--model.hidden=3"], save_config_kwargs={"overwrite": True})
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]["hidden"] == 3


def test_seed_true_picks_a_seed_and_saves_it_and_run_false_only_builds(tmp_path):
    cli = EmberCLI(Net, Data, run=False, args=["--model.lr=0.5"])
    assert isinstance(cli.trainer, ember.Trainer) and cli.model.hparams.lr == 0.5 and cli.trainer.global_step == 0
    assert isinstance(cli.config["seed_everything"], int)


def test_a_misspelt_argument_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        EmberCLI(Net, Data, args=["fit", "--model.hiden=3"])
    assert "hiden" in capsys.readouterr().err
