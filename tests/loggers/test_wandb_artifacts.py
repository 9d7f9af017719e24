"""WandbLogger.download_artifact / use_artifact, against a stand-in ``wandb`` module that records what the
logger asks of it (the real one needs a wandb server for artifacts; tests/loggers/test_wandb.py runs the
rest of the logger on wandb itself, offline)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest


class Artifact:
    def __init__(self, name: str, how: str, type: str | None = None) -> None:
        self.name, self.how, self.type = name, how, type
        self.roots: list[Any] = []

    def download(self, root: str | None = None) -> str:
        self.roots.append(root)
        return root or f"./artifacts/{self.name}"


class Run:
    def __init__(self) -> None:
        self.used: list[Artifact] = []

    def use_artifact(self, name: str, type: str | None = None) -> Artifact:
        self.used.append(Artifact(name, "run", type))
        return self.used[-1]

    def define_metric(self, *args: Any, **kwargs: Any) -> None: ...


class Api:
    fetched: list[Artifact] = []

    def artifact(self, name: str, type: str | None = None) -> Artifact:
        Api.fetched.append(Artifact(name, "api", type))
        return Api.fetched[-1]


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = types.ModuleType("wandb")
    module.run = None  # type: ignore[attr-defined]
    module.Api = Api  # type: ignore[attr-defined]

    def init(**kwargs: Any) -> Run:
        module.run = Run()  # type: ignore[attr-defined]
        return module.run  # type: ignore[attr-defined]

    module.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    Api.fetched = []
    return module


def test_download_artifact_without_a_run_uses_the_public_api(fake_wandb, tmp_path):
    from ember.loggers import WandbLogger

    path = WandbLogger.download_artifact("team/proj/data:v3", save_dir=tmp_path, artifact_type="dataset")
    (got,) = Api.fetched
    assert (got.name, got.type, got.roots, path) == ("team/proj/data:v3", "dataset", [str(tmp_path)], str(tmp_path))


def test_download_artifact_in_a_run_records_its_use_unless_told_not_to(fake_wandb, tmp_path):
    from ember.loggers import WandbLogger

    logger = WandbLogger(project="p", save_dir=str(tmp_path))
    run = logger.experiment
    assert WandbLogger.download_artifact("team/proj/model:latest") == "./artifacts/team/proj/model:latest"
    assert [a.name for a in run.used] == ["team/proj/model:latest"] and Api.fetched == []
    WandbLogger.download_artifact("team/proj/model:v1", use_artifact=False)
    assert [a.name for a in Api.fetched] == ["team/proj/model:v1"] and len(run.used) == 1


def test_use_artifact_goes_through_the_loggers_run(fake_wandb, tmp_path):
    from ember.loggers import WandbLogger

    logger = WandbLogger(project="p", save_dir=str(tmp_path))
    artifact = logger.use_artifact("team/proj/data:v2", artifact_type="dataset")
    assert logger.experiment.used == [artifact] and (artifact.name, artifact.type) == ("team/proj/data:v2", "dataset")
