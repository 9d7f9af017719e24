"""WandbLogger, run for real in wandb's offline mode (no network): what a fit writes into the run's file,
hyper-parameters in its config, the experiment, finalize, rank zero only under ddp, and the errors.

wandb starts a service process (wandb-core) for its runs: every test here finishes its runs and tears the
service down, and checks that no process it started is left.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import warnings
from typing import Any

import pytest
import torch

import ember
from tests.helpers.dist import join_as_rank, run_ranks
from tests.helpers.models import BoringModel, fast_trainer, regression_loader

wandb = pytest.importorskip("wandb")
psutil = pytest.importorskip("psutil")

from ember.loggers import WandbLogger  # noqa: E402

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]


def offline_env(directory: Any) -> dict[str, str]:
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(directory),
        "WANDB_CONFIG_DIR": str(directory),
        "WANDB_CACHE_DIR": str(directory),
        "WANDB_DATA_DIR": str(directory),
        "WANDB_DISABLE_GIT": "true",
    }


def shut_down_wandb() -> None:
    if wandb.run is not None:
        wandb.finish()
    wandb.teardown()  # stops the wandb-core service process


@pytest.fixture
def offline(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    for key, value in offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield tmp_path
    shut_down_wandb()
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    gone, alive = psutil.wait_procs(started, timeout=10)
    for p in alive:  # (only if teardown failed: the test fails below, and nothing is left running)
        p.kill()
    assert not alive, f"wandb left processes running: {[p.name() for p in alive]}"


def records(save_dir: Any) -> list[Any]:
    """The records of the offline run under ``save_dir``: wandb's run file is a LevelDB-style log (a 7-byte
    header, then 32 KiB blocks of chunks with a 7-byte header each: crc, length, type) of protobuf records."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(str(save_dir), "wandb", "offline-run-*", "run-*.wandb"))
    raw = open(path, "rb").read()
    block, pos, out, pending = 32768, 7, [], b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data = raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # a whole record
            out.append(data)
        elif kind == 2:  # first, middle, last chunk of a record
            pending = data
        elif kind == 3:
            pending += data
        elif kind == 4:
            out.append(pending + data)
    parsed = []
    for data in out:
        record = pb.Record()
        record.ParseFromString(data)
        parsed.append(record)
    return parsed


def history(save_dir: Any) -> list[dict[str, Any]]:
    rows = []
    for r in records(save_dir):
        if r.WhichOneof("record_type") == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def config(save_dir: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for r in records(save_dir):
        kind = r.WhichOneof("record_type")
        if kind in ("config", "run"):
            items = r.config.update if kind == "config" else r.run.config.update
            values.update({item.key: json.loads(item.value_json) for item in items})
    return values


class Logged(BoringModel):
    def __init__(self, d: int = 4, lr: float = 0.1) -> None:
        super().__init__(d, lr)
        self.save_hyperparameters()


def test_a_fit_writes_metrics_at_lightnings_steps_and_hyperparameters(offline: Any) -> None:
    logger = WandbLogger(project="ember-test", save_dir=str(offline), offline=True, prefix="fit")
    trainer = fast_trainer(logger=logger, log_every_n_steps=2, max_epochs=2)
    trainer.fit(Logged(lr=0.05), regression_loader(n=32, batch_size=8), regression_loader(n=16))
    run = logger.experiment
    assert run is wandb.run and logger.version == run.id and logger.name == "ember-test"
    assert run.config["d"] == 4 and run.config["lr"] == 0.05
    trainer.test(Logged(), regression_loader(n=16))  # the run stays open after fit (finalize), as Lightning
    assert run.config["lr"] == 0.1  # the test's module's: a changed value replaces the earlier one, as Lightning
    shut_down_wandb()  # the service has written everything once it is down
    rows = history(offline)
    steps = [r["trainer/global_step"] for r in rows if "fit-train_loss" in r]
    assert steps == [1, 3, 5, 7]  # every 2 steps: the step index of the 2nd, 4th, ... batch, as Lightning
    assert [r["trainer/global_step"] for r in rows if "fit-val_loss" in r] == [3, 7]
    assert [r["fit-epoch"] for r in rows if "fit-val_loss" in r] == [0, 1]
    assert any("fit-test_loss" in r for r in rows)
    assert config(offline)["d"] == 4  # (which lr the offline file keeps last depends on wandb's version)


def test_log_hyperparams_keeps_nested_values_and_names_functions(offline: Any) -> None:
    logger = WandbLogger(save_dir=str(offline), offline=True)
    logger.log_hyperparams(
        {"opt": {"name": "adam", "betas": (0.9, 0.99)}, "act": torch.relu, "dev": torch.device("cpu")}
    )
    logger.log_hyperparams({"opt": {"name": "sgd"}})  # a changed value replaces the earlier one
    logger.log_metrics({"x": 1.5}, step=4)
    assert logger.experiment.config["act"] == "relu" and logger.experiment.config["dev"] == "cpu"
    shut_down_wandb()
    cfg = config(offline)
    assert cfg["opt"] == {"name": "sgd"}
    assert cfg["act"] == "relu" and cfg["dev"] == "cpu"
    assert history(offline) == [{"x": 1.5, "trainer/global_step": 4}]
    assert logger.name == "lightning_logs"  # Lightning's default project


def test_given_experiment_and_errors(offline: Any) -> None:
    run = wandb.init(project="given", dir=str(offline), mode="offline")
    logger = WandbLogger(experiment=run)
    assert logger.experiment is run and logger.version == run.id
    with pytest.raises(NotImplementedError, match="log_model=True. is not supported"):
        WandbLogger(log_model=True)
    with pytest.warns(UserWarning, match="wandb run already in progress"):
        assert WandbLogger(save_dir=str(offline)).experiment is run


def test_exported_under_lightnings_name() -> None:
    assert "WandbLogger" in ember.loggers.__all__ and ember.loggers.WandbLogger is WandbLogger


def _ddp_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    join_as_rank(rank, world)
    os.environ.update(offline_env(os.path.join(root, f"env{rank}")))
    warnings.simplefilter("ignore")
    save_dir = os.path.join(root, f"rank{rank}")
    os.makedirs(save_dir)
    logger = WandbLogger(save_dir=save_dir, offline=True)
    trainer = fast_trainer(logger=logger, log_every_n_steps=1, strategy="ddp", devices=world)
    trainer.fit(Logged(), regression_loader(n=32, batch_size=8))
    kind = type(logger.experiment).__name__
    children = psutil.Process().children(recursive=True)
    shut_down_wandb()
    _, alive = psutil.wait_procs(children, timeout=10)
    return {"experiment": kind, "left": len(alive), "files": sorted(os.listdir(save_dir))}


def test_under_ddp_only_rank_zero_creates_a_run(tmp_path: Any) -> None:
    ranks = run_ranks(_ddp_rank, 2, str(tmp_path), timeout=150)
    assert ranks[0]["experiment"] == "Run" and ranks[1]["experiment"] == "DummyExperiment"
    assert ranks[0]["files"] == ["wandb"] and ranks[1]["files"] == []
    assert [r["left"] for r in ranks] == [0, 0]
    rows = history(tmp_path / "rank0")
    assert [r["trainer/global_step"] for r in rows if "train_loss" in r] == [0, 1]  # 2 steps per rank


# ---------------------------------------------------------------------- media, and the base members
def media(row: dict[str, Any], key: str) -> dict[str, Any]:
    """The ``key/...`` items of a history row, without the prefix."""
    return {k[len(key) + 1 :]: v for k, v in row.items() if k.startswith(key + "/")}


def test_log_image_and_video_write_one_item_each_with_its_keywords(offline: Any) -> None:
    from PIL import Image

    gif = str(offline / "clip.gif")
    frames = [Image.new("RGB", (8, 8), (60 * i, 0, 0)) for i in range(3)]
    frames[0].save(gif, save_all=True, append_images=frames[1:])
    logger = WandbLogger(save_dir=str(offline), offline=True)
    logger.log_image("samples", [torch.rand(3, 8, 8), torch.zeros(3, 8, 8)], step=3, caption=["a", "b"])
    logger.log_video("clips", [gif], step=5, caption=["c"], format=["gif"])
    shut_down_wandb()
    images, videos = (r for r in history(offline) if any(k.startswith(("samples/", "clips/")) for k in r))
    assert images["trainer/global_step"] == 3 and videos["trainer/global_step"] == 5
    got = media(images, "samples")
    assert (got["_type"], got["count"], got["captions"], got["width"]) == ("images/separated", 2, ["a", "b"], 8)
    got = media(videos, "clips")
    assert (got["_type"], got["count"], got["captions"]) == ("videos", 1, ["c"])
    assert got["videos"][0]["path"].endswith(".gif")


def test_log_audio_writes_the_files(offline: Any) -> None:
    pytest.importorskip("soundfile")  # (what wandb.Audio needs to write any audio)
    import wave

    path = str(offline / "tone.wav")
    with wave.open(path, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(8000)
        out.writeframes(struct.pack("<100h", *range(100)))
    logger = WandbLogger(save_dir=str(offline), offline=True)
    logger.log_audio("sounds", [path, path], step=2, caption=["x", "y"])
    shut_down_wandb()
    (row,) = [r for r in history(offline) if "sounds/_type" in r]
    got = media(row, "sounds")
    assert (got["_type"], got["count"], got["captions"]) == ("audio", 2, ["x", "y"])
    assert row["trainer/global_step"] == 2


def test_media_arguments_that_do_not_fit_are_said(offline: Any) -> None:
    logger = WandbLogger(save_dir=str(offline), offline=True)
    with pytest.raises(TypeError, match="log_image expects a list of images, got a Tensor: wrap one in a list"):
        logger.log_image("x", torch.zeros(3, 8, 8))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"log_video got 2 videos but keyword lists of other lengths \{'fps': 1\}"):
        logger.log_video("x", ["a.gif", "b.gif"], fps=[4])
    with pytest.raises(TypeError, match="log_audio expects a list of audios"):
        logger.log_audio("x", "a.wav")  # type: ignore[arg-type]
    assert logger._experiment is None  # nothing was started for them


def test_other_ranks_log_no_media(offline: Any) -> None:
    logger = WandbLogger(save_dir=str(offline), offline=True)
    logger._rank = 1  # (what setup() records for a worker of a multi-process run)
    logger.log_image("x", [torch.zeros(3, 8, 8)], caption=["a"])
    assert logger._experiment is None and wandb.run is None


def test_base_members(offline: Any) -> None:
    logger = WandbLogger(save_dir=str(offline), offline=True)
    assert logger.root_dir is None and logger.group_separator == "/"  # as Lightning: no root_dir of its own
    assert logger.after_save_checkpoint(object()) is None and logger.log_graph(torch.nn.Linear(1, 1)) is None
