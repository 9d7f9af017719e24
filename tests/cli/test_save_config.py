"""``SaveConfigCallback``'s Lightning API: the ``save_config`` hook a subclass overrides (called with the
stage, on rank zero, once per callback), ``save_to_log_dir=False``, and ``multifile`` (one file per part
of the config given as a file), with ember's rule that no file already there is overwritten."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers.models import regression_loader

pytest.importorskip("jsonargparse")
yaml = pytest.importorskip("yaml")

from ember.cli import EmberCLI, SaveConfigCallback  # noqa: E402


class Net(ember.TrainModule):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(ember.DataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return regression_loader(batch_size=self.batch_size)

    def val_dataloader(self):
        return regression_loader(batch_size=self.batch_size)


def fit_args(root, *extra: str, checkpoints: bool = False) -> list[str]:
    return [
        "fit",
        f"--trainer.default_root_dir={root}",
        "--trainer.max_epochs=1",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.enable_checkpointing={str(checkpoints).lower()}",
        "--seed_everything=0",
        *extra,
    ]


def test_save_config_is_called_with_the_stage_after_the_file_is_saved_and_once_per_callback(tmp_path):
    seen = []

    class Recording(SaveConfigCallback):
        def save_config(self, trainer, pl_module, stage):
            saved = yaml.safe_load(open(self.path).read()) if self.path else None
            seen.append((stage, pl_module, trainer.is_global_zero, saved["model"]))

    cli = EmberCLI(Net, Data, save_config_callback=Recording, args=fit_args(tmp_path, "--model.hidden=3"))
    assert seen == [("fit", cli.model, True, {"hidden": 3})]
    # Another stage on the same Trainer saves nothing more (and does not refuse the file it saved).
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    assert len(seen) == 1
    assert sorted(p.name for p in tmp_path.glob("config*")) == ["config.yaml"]


def test_save_to_log_dir_false_saves_no_file_and_needs_a_save_config_of_its_own(tmp_path):
    seen = []

    class Elsewhere(SaveConfigCallback):
        def save_config(self, trainer, pl_module, stage):
            seen.append((stage, yaml.safe_load(self.parser.dump(self.config))["model"]))

    kwargs = {"save_to_log_dir": False}
    EmberCLI(Net, Data, save_config_callback=Elsewhere, save_config_kwargs=kwargs, args=fit_args(tmp_path))
    assert seen == [("fit", {"hidden": 8})] and not list(tmp_path.glob("*.yaml"))
    with pytest.raises(ValueError, match="save_to_log_dir=False saves the configuration nowhere"):
        EmberCLI(Net, Data, save_config_kwargs=kwargs, args=fit_args(tmp_path))


def _parts(tmp_path):
    given = tmp_path / "given"
    given.mkdir()
    (given / "model.yaml").write_text("hidden: 5\n")
    (given / "data.yaml").write_text("batch_size: 4\n")
    return ["--model", str(given / "model.yaml"), "--data", str(given / "data.yaml")]


def test_multifile_saves_each_part_given_as_a_file_to_its_own_file(tmp_path):
    parts = _parts(tmp_path)
    EmberCLI(Net, Data, save_config_kwargs={"multifile": True}, args=fit_args(tmp_path / "multi", *parts))
    run = tmp_path / "multi"
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "data.yaml", "model.yaml"]
    top = yaml.safe_load((run / "config.yaml").read_text())
    assert top["model"] == "model.yaml" and top["data"] == "data.yaml" and top["trainer"]["max_epochs"] == 1
    assert yaml.safe_load((run / "model.yaml").read_text()) == {"hidden": 5}
    assert yaml.safe_load((run / "data.yaml").read_text()) == {"batch_size": 4}
    # Without multifile (the default): one file.
    EmberCLI(Net, Data, args=fit_args(tmp_path / "single", *parts))
    assert sorted(p.name for p in (tmp_path / "single").iterdir()) == ["config.yaml"]
    assert yaml.safe_load((tmp_path / "single" / "config.yaml").read_text())["model"] == {"hidden": 5}


def test_multifile_never_overwrites_a_file_already_there(tmp_path):
    parts = _parts(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.yaml").write_text("mine\n")
    with pytest.raises(RuntimeError, match=r"model\.yaml already exists.*does not overwrite"):
        EmberCLI(Net, Data, save_config_kwargs={"multifile": True}, args=fit_args(run, *parts))
    assert sorted(p.name for p in run.iterdir()) == ["model.yaml"]  # nothing written, nothing staged left
    assert (run / "model.yaml").read_text() == "mine\n"
    EmberCLI(Net, Data, save_config_kwargs={"multifile": True, "overwrite": True}, args=fit_args(run, *parts))
    assert yaml.safe_load((run / "model.yaml").read_text()) == {"hidden": 5}


def test_a_multifile_run_resumes_keeping_its_files_and_saves_a_changed_config_as_one_file(tmp_path):
    parts = _parts(tmp_path)
    kwargs = {"save_config_kwargs": {"multifile": True}}
    EmberCLI(Net, Data, **kwargs, args=fit_args(tmp_path, *parts, checkpoints=True))
    first = {p.name: p.read_text() for p in tmp_path.glob("*.yaml")}
    assert sorted(first) == ["config.yaml", "data.yaml", "model.yaml"]
    # The same config, resumed: its parts read back from their files, it is the run's, kept.
    EmberCLI(Net, Data, **kwargs, args=fit_args(tmp_path, *parts, "--ckpt_path=last", checkpoints=True))
    assert {p.name: p.read_text() for p in tmp_path.glob("*.yaml")} == first
    # Changed: saved beside, as one file, so the run's first parts stay as they were.
    changed = fit_args(tmp_path, *parts, "--ckpt_path=last", "--trainer.max_epochs=2", checkpoints=True)
    EmberCLI(Net, Data, **kwargs, args=changed)
    assert {p.name: p.read_text() for p in tmp_path.glob("*.yaml") if p.name != "config-1.yaml"} == first
    second = yaml.safe_load((tmp_path / "config-1.yaml").read_text())
    assert second["model"] == {"hidden": 5} and second["trainer"]["max_epochs"] == 2
