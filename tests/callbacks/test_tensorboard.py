"""TensorBoardLogger, read back with TensorBoard's own reader and its own HTTP server."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import types
import urllib.parse
import urllib.request

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.loggers import CSVLogger, TensorBoardLogger
from ember.loggers.tensorboard import default_logger
from tests.helpers.models import BoringModel, regression_loader

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2  # noqa: E402


class Tiny(ember.TrainModule):
    def __init__(self, lr: float = 0.05, tag: str = "tiny", fail_at: int = -1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 1)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        if self.global_step == self.hparams.fail_at:
            raise RuntimeError("boom")
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def loaders():
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    return DataLoader(ds, batch_size=4), DataLoader(ds, batch_size=8)


def fit(tmp_path, logger, module=None, **kw):
    args = dict(
        max_epochs=2,
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        logger=logger,
    )
    args.update(kw)
    trainer = ember.Trainer(**args)
    module = module or Tiny()
    trainer.fit(module, *loaders())
    return trainer, module


def read(log_dir):
    ea = EventAccumulator(str(log_dir))
    ea.Reload()
    return ea


def hparams_data(ea):
    return {
        tag: plugin_data_pb2.HParamsPluginData.FromString(content)
        for tag, content in ea.PluginTagToContent("hparams").items()
    }


def test_event_accumulator_reads_every_scalar_and_the_hparams(tmp_path):
    logger = TensorBoardLogger(save_dir=tmp_path)
    trainer, module = fit(tmp_path, logger)
    assert logger.log_dir == os.path.join(str(tmp_path), "ember_logs", "version_0") == trainer.log_dir
    ea = read(logger.log_dir)
    assert set(ea.Tags()["scalars"]) == {"train/loss", "val/loss", "epoch"}

    # step metrics every 2 optimizer steps, written (as Lightning) at the step's index (the 2nd step at 1, ...)
    # with the value of that step's loss
    train = [(e.step, e.value) for e in ea.Scalars("train/loss")]
    assert [s for s, _ in train] == list(range(1, 16, 2))
    for step, value in train:
        assert value == pytest.approx(module.losses[step], rel=1e-6)
    # epoch-level validation values at the index of each epoch's last step (as Lightning)
    val = [(e.step, e.value) for e in ea.Scalars("val/loss")]
    assert [s for s, _ in val] == [7, 15]
    for (_, value), row in zip(val, trainer.history):
        assert value == pytest.approx(row["val/loss"], rel=1e-6)
    assert {(e.step, e.value) for e in ea.Scalars("epoch")} == {(s, float(s > 7)) for s in range(1, 16, 2)}

    data = hparams_data(ea)
    start = data["_hparams_/session_start_info"].session_start_info
    assert start.hparams["lr"].number_value == pytest.approx(0.05)
    assert start.hparams["tag"].string_value == "tiny"
    assert start.hparams["fail_at"].number_value == -1
    experiment = data["_hparams_/experiment"].experiment
    assert {h.name for h in experiment.hparam_infos} == {"lr", "tag", "fail_at"}
    assert {m.name.tag for m in experiment.metric_infos} == {"train/loss", "val/loss"}
    assert data["_hparams_/session_end_info"].session_end_info.status == api_pb2.STATUS_SUCCESS

    with open(os.path.join(logger.log_dir, "hparams.yaml")) as fh:
        assert fh.read() == "lr: 0.05\ntag: tiny\nfail_at: -1\n"


def test_events_are_flushed_and_the_writer_closed_when_fit_fails(tmp_path):
    logger = TensorBoardLogger(save_dir=tmp_path, flush_secs=600)  # only the failure path flushes
    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path, logger, Tiny(fail_at=5))
    assert logger._writer is None
    ea = read(logger.log_dir)
    assert [e.step for e in ea.Scalars("train/loss")] == [1, 3]  # the 2nd and 4th steps, at their indices
    assert hparams_data(ea)["_hparams_/session_end_info"].session_end_info.status == api_pb2.STATUS_FAILURE


def test_save_flushes_while_the_writer_stays_open(tmp_path):
    logger = TensorBoardLogger(save_dir=tmp_path, flush_secs=600)
    logger.log_metrics({"a": 1.5}, step=3)
    logger.save()
    assert [(e.step, e.value) for e in read(logger.log_dir).Scalars("a")] == [(3, 1.5)]
    logger.log_metrics({"a": 2.5}, step=4)
    logger.finalize("success")
    assert [e.value for e in read(logger.log_dir).Scalars("a")] == [1.5, 2.5]


def test_directory_scheme_name_and_version(tmp_path):
    assert default_logger(str(tmp_path)).log_dir == os.path.join(str(tmp_path), "ember_logs", "version_0")
    fit(tmp_path, TensorBoardLogger(save_dir=tmp_path), max_epochs=1)
    nxt = TensorBoardLogger(save_dir=tmp_path)
    assert nxt.version == 1
    assert TensorBoardLogger(save_dir=tmp_path, name="exp", version="run-a").log_dir == os.path.join(
        str(tmp_path), "exp", "run-a"
    )
    assert TensorBoardLogger(save_dir=tmp_path, version=7).log_dir.endswith("version_7")
    # no save_dir: the Trainer's default_root_dir; logger=True is the same logger
    trainer, _ = fit(tmp_path / "root", True, max_epochs=1)
    assert isinstance(trainer.logger, TensorBoardLogger)
    assert trainer.log_dir == os.path.join(str(tmp_path / "root"), "ember_logs", "version_0")
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(trainer.log_dir))
    with pytest.raises(TypeError, match="version"):
        TensorBoardLogger(version=1.5)


def test_several_loggers_share_one_version_directory(tmp_path):
    (tmp_path / "ember_logs" / "version_0").mkdir(parents=True)
    tb, csv_logger = TensorBoardLogger(), CSVLogger()
    trainer, _ = fit(tmp_path, [tb, csv_logger], max_epochs=1)
    expected = os.path.join(str(tmp_path), "ember_logs", "version_1")
    assert tb.log_dir == csv_logger.log_dir == trainer.log_dir == expected
    assert trainer.loggers == [tb, csv_logger] and trainer.logger is tb
    assert {"metrics.csv", "hparams.yaml"} <= set(os.listdir(expected))
    assert read(expected).Tags()["scalars"]


def test_no_logger_means_log_dir_is_the_root(tmp_path):
    trainer = ember.Trainer(logger=False, default_root_dir=str(tmp_path), enable_progress_bar=False)
    assert trainer.loggers == [] and trainer.logger is None
    assert trainer.log_dir == str(tmp_path)


def test_other_ranks_write_nothing(tmp_path):
    logger = TensorBoardLogger(save_dir=tmp_path)
    rank1 = types.SimpleNamespace(
        default_root_dir=str(tmp_path),
        global_rank=1,
        world_size=2,
        strategy=types.SimpleNamespace(broadcast=lambda obj, src=0: 4),
    )
    logger.setup(rank1, None, "fit")
    assert logger.log_dir.endswith("version_4")  # rank zero's choice
    logger.log_hyperparams({"lr": 1.0})
    logger.log_metrics({"a": 1.0}, 1)
    logger.finalize("success")
    assert logger.experiment is None
    assert not (tmp_path / "ember_logs").exists()


def test_validate_after_fit_logs_and_closes_the_writer(tmp_path):
    logger = TensorBoardLogger(save_dir=tmp_path)
    trainer, module = fit(tmp_path, logger, max_epochs=1)
    trainer.validate(module, loaders()[1])
    assert logger._writer is None
    # as Lightning: the fit's validation at the index of the epoch's last step (7), a validate after the fit at
    # trainer.global_step (8), in a second event file (read after the first: they are named in order).
    assert [e.step for e in read(logger.log_dir).Scalars("val/loss")] == [7, 8]


def test_a_rewind_hides_the_events_from_its_step_on(tmp_path):
    first = TensorBoardLogger(save_dir=tmp_path, version=0, max_queue=1)
    for step in range(8):
        first.log_metrics({"a": float(step)}, step)
    first.log_metrics({"b": 1.0}, 6)  # a tag the continued run does not write again
    first.log_metrics({"b": 2.0}, 4)
    first.finalize("success")
    again = TensorBoardLogger(save_dir=tmp_path, version=0)  # a new process continuing the run
    again.rewind(5)  # what a fit resumed from a checkpoint after 5 steps does (on_load_checkpoint)
    again.log_metrics({"a": 50.0}, 5)
    again.log_metrics({"a": 60.0}, 6)
    again.finalize("success")
    ea = read(again.log_dir)
    expected = [(step, float(step)) for step in range(5)] + [(5, 50.0), (6, 60.0)]
    assert [(e.step, e.value) for e in ea.Scalars("a")] == expected
    assert [(e.step, e.value) for e in ea.Scalars("b")] == [(4, 2.0)]


@pytest.mark.processes
def test_the_experiment_writer_never_shares_the_scalars_file(tmp_path):
    # In a new process both counters of TensorBoard's file names start at 0: a SummaryWriter made in the same
    # second as the logger's own event file would get its name, and the two would truncate each other's file.
    code = (
        "import sys\n"
        "from ember.loggers import TensorBoardLogger\n"
        "logger = TensorBoardLogger(save_dir=sys.argv[1], version=0)\n"
        "logger.log_metrics({'a': 1.0}, 0)\n"
        "logger.experiment.add_scalar('b', 2.0, 0)\n"
        "logger.finalize('success')\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    ea = read(tmp_path / "ember_logs" / "version_0")
    assert [(e.step, e.value) for e in ea.Scalars("a")] == [(0, 1.0)]
    assert [(e.step, e.value) for e in ea.Scalars("b")] == [(0, 2.0)]


@pytest.mark.processes
def test_importing_and_building_the_default_logger_does_not_import_tensorboard(tmp_path):
    code = (
        "import sys, ember\n"
        "t = ember.Trainer(logger=True, default_root_dir=sys.argv[1], enable_progress_bar=False)\n"
        "assert type(t.logger).__name__ == 'TensorBoardLogger'\n"
        "assert not any(m == 'tensorboard' or m.startswith(('tensorboard.', 'torch.utils.tensorboard'))\n"
        "               for m in sys.modules), sorted(m for m in sys.modules if 'tensorboard' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read().decode())


@pytest.mark.processes
def test_real_tensorboard_server_serves_the_scalars(tmp_path):
    logger = TensorBoardLogger(save_dir=tmp_path)
    trainer, module = fit(tmp_path, logger)
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(tmp_path / "ember_logs"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast",
            "false",
            "--reload_interval",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 45
        tags = {}
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"tensorboard exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
            try:
                tags = _get_json(base + "/data/plugin/scalars/tags").get("version_0", {})
            except OSError:
                tags = {}
            if {"train/loss", "val/loss"} <= set(tags):
                break
            time.sleep(0.25)
        else:
            pytest.fail(f"tensorboard did not serve the run's scalars within 45 s (tags seen: {sorted(tags)})")

        query = urllib.parse.urlencode({"run": "version_0", "tag": "train/loss"})
        points = _get_json(f"{base}/data/plugin/scalars/scalars?{query}")
        # as Lightning: written at the step's index, every 2nd step (1, 3, ..., 15)
        assert [p[1] for p in points] == list(range(1, 16, 2))
        for _, step, value in points:
            assert value == pytest.approx(module.losses[step], rel=1e-6)
        query = urllib.parse.urlencode({"run": "version_0", "tag": "val/loss"})
        points = _get_json(f"{base}/data/plugin/scalars/scalars?{query}")
        assert [(p[1], pytest.approx(p[2], rel=1e-6)) for p in points] == [
            (7, trainer.history[0]["val/loss"]),
            (15, trainer.history[1]["val/loss"]),
        ]
        assert not math.isnan(points[-1][2])

        # the HParams dashboard: the run's hyper-parameters beside its final metric values
        body = json.dumps(
            {
                "experimentName": "",
                "startIndex": 0,
                "sliceSize": 10,
                "colParams": [],
                "allowedStatuses": ["STATUS_SUCCESS", "STATUS_UNKNOWN"],
            }
        ).encode()
        request = urllib.request.Request(
            base + "/data/plugin/hparams/session_groups", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            groups = json.loads(resp.read().decode())["sessionGroups"]
        assert len(groups) == 1 and groups[0]["hparams"] == {"lr": 0.05, "tag": "tiny", "fail_at": -1}
        final = {m["name"]["tag"]: (m["trainingStep"], m["value"]) for m in groups[0]["metricValues"]}
        assert final == {
            "train/loss": (15, pytest.approx(module.losses[15], rel=1e-6)),
            "val/loss": (15, pytest.approx(trainer.history[1]["val/loss"], rel=1e-6)),
        }
        assert groups[0]["sessions"][0]["status"] == "STATUS_SUCCESS"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        proc.stderr.close()


def test_nested_and_odd_hparams(tmp_path):
    logger = TensorBoardLogger(save_dir=tmp_path, version=0)
    logger.log_hyperparams(
        {
            "opt": {"lr": 0.1, "betas": [0.9, 0.99]},
            "act": None,
            "flag": True,
            "dtype": torch.float16,
            "n": torch.tensor(3),
        },
        metrics={"hp_metric": 0.5},
    )
    logger.finalize("interrupted")
    ea = read(logger.log_dir)
    data = hparams_data(ea)
    hp = data["_hparams_/session_start_info"].session_start_info.hparams
    assert hp["opt/lr"].number_value == 0.1 and hp["opt/betas"].string_value == "[0.9, 0.99]"
    assert hp["act"].string_value == "None" and hp["flag"].bool_value is True
    assert hp["dtype"].string_value == "torch.float16" and hp["n"].number_value == 3
    types_ = {h.name: api_pb2.DataType.Name(h.type) for h in data["_hparams_/experiment"].experiment.hparam_infos}
    assert types_ == {
        "opt/lr": "DATA_TYPE_FLOAT64",
        "opt/betas": "DATA_TYPE_STRING",
        "act": "DATA_TYPE_STRING",
        "flag": "DATA_TYPE_BOOL",
        "dtype": "DATA_TYPE_STRING",
        "n": "DATA_TYPE_FLOAT64",
    }
    assert data["_hparams_/session_end_info"].session_end_info.status == api_pb2.STATUS_FAILURE
    assert [(e.step, e.value) for e in ea.Scalars("hp_metric")] == [(0, 0.5)]
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as fh:
        assert fh.read() == (
            'opt:\n  lr: 0.1\n  betas: [0.9, 0.99]\nact: null\nflag: true\ndtype: torch.float16\n"n": 3\n'
        )


class Interrupted(Tiny):
    def training_step(self, batch, batch_idx):
        if self.global_step == 3:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)


def test_keyboard_interrupt_flushes_both_loggers(tmp_path):
    tb, csv_logger = TensorBoardLogger(save_dir=tmp_path, flush_secs=600), CSVLogger(save_dir=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        fit(tmp_path, [tb, csv_logger], Interrupted(), log_every_n_steps=1)
    assert tb._writer is None
    ea = read(tb.log_dir)
    assert [e.step for e in ea.Scalars("train/loss")] == [0, 1, 2]  # the 3 steps taken, at their indices
    assert hparams_data(ea)["_hparams_/session_end_info"].session_end_info.status == api_pb2.STATUS_FAILURE
    with open(csv_logger.metrics_file) as fh:
        assert [ln.split(",")[0] for ln in fh.read().splitlines()] == ["step", "0", "1", "2"]


def test_sub_dir_and_home_and_variables_in_the_log_dir(tmp_path, monkeypatch):
    """As Lightning: sub_dir goes inside the version's directory; ~ and $VARS are expanded."""
    logger = TensorBoardLogger(str(tmp_path), name="n", version="v", sub_dir="s")
    assert logger.log_dir == os.path.join(str(tmp_path), "n", "v", "s")
    monkeypatch.setenv("EMBER_TB_TEST_DIR", "somewhere")
    assert TensorBoardLogger("$EMBER_TB_TEST_DIR/x", name="n", version="v").log_dir == os.path.join(
        "somewhere", "x", "n", "v"
    )
    assert TensorBoardLogger("~/x", name="n", version="v").log_dir == os.path.join(
        os.path.expanduser("~"), "x", "n", "v"
    )


def test_a_successful_fit_leaves_an_hparams_yaml_even_with_none_saved(tmp_path):
    """As Lightning: the run's hparams.yaml exists after a successful fit, empty without hyper-parameters."""
    logger = TensorBoardLogger(str(tmp_path))
    trainer = ember.Trainer(
        max_steps=1, logger=logger, enable_progress_bar=False, accelerator="cpu", default_root_dir=str(tmp_path)
    )
    trainer.fit(BoringModel(), regression_loader())  # saves no hyper-parameters; its checkpoint makes the run dir
    assert os.path.isfile(os.path.join(logger.log_dir, "hparams.yaml"))
    assert not os.path.isfile(os.path.join(str(tmp_path), "hparams.yaml"))
