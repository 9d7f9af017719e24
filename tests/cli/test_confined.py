"""A config builds only what the types ask for (``ember/cli/confined.py``).

The matrix: every Trainer, module and datamodule parameter whose type accepts anything (``Any``,
``object``, ``dict``, no annotation..., found by introspection so a new one is covered), given a
class_path that would run code (``os.system``, ``subprocess.Popen``, ``builtins.eval``,
``builtins.exec``, ``importlib.import_module``, a class of a module whose import runs code), through
a YAML file given to ``--config``, a YAML string given to ``--config``, a section's own file
(``--model model.yaml``) and a command-line value. Nothing runs (each payload would create a marker
file), nothing is imported, and the error names the key. Then the same below the top level (a
callback's arguments, a model given by class_path), and that class-typed positions still build.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import types
import typing
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Union

import pytest
import torch

import ember

pytest.importorskip("jsonargparse")
yaml = pytest.importorskip("yaml")

from ember.cli import EmberCLI  # noqa: E402

# For the parameter left unannotated on purpose, jsonargparse looks for a type in typeshed's stubs
# (typeshed_client), which starts a Python process once per process to read sys.path.
pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]


class OpenModule(ember.TrainModule):
    def __init__(
        self,
        hidden: int = 4,
        anything: Any = None,
        obj: object = None,
        options: dict | None = None,
        extras: dict[str, Any] | None = None,
        items: list[Any] | None = None,
        untyped=None,  # noqa: ANN001  (no annotation on purpose)
        fn: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class OpenData(ember.DataModule):
    def __init__(self, batch_size: int = 4, anything: Any = None, obj: object = None, options: Mapping | None = None):
        super().__init__()


class OpenCallback(ember.callbacks.Callback):
    def __init__(self, payload: Any = None) -> None:
        self.payload = payload


def _accepts_anything(hint: Any) -> bool:
    """The test's own reading of a type: accepts any value (so, once, any class_path)."""
    if hint is inspect.Parameter.empty or hint is Any or hint is object:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_accepts_anything(a) for a in args)
    if hint in (dict, list, tuple, set, Mapping, Iterable) or origin is Callable:
        return True
    return origin in (dict, list, tuple, set, Mapping) and any(_accepts_anything(a) for a in args)


def open_keys() -> dict[str, bool]:
    """``{key: whether its type is a list}`` for each parameter whose type accepts anything."""
    keys = {}
    for section, cls in (("trainer", ember.Trainer), ("model", OpenModule), ("data", OpenData)):
        hints = typing.get_type_hints(cls.__init__)
        for name, param in inspect.signature(cls.__init__).parameters.items():
            hint = hints.get(name, param.annotation)
            if name != "self" and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                if _accepts_anything(hint):
                    is_list = list in (hint, typing.get_origin(hint), *map(typing.get_origin, typing.get_args(hint)))
                    keys[f"{section}.{name}"] = is_list
    return keys


def test_the_introspection_finds_the_open_parameters():
    keys = open_keys()
    assert "trainer.max_time" in keys  # the Trainer's (Any)
    assert {"model.anything", "model.obj", "model.options", "model.untyped", "data.options"} <= set(keys)
    assert "model.hidden" not in keys and "trainer.callbacks" not in keys


@pytest.fixture
def payloads(tmp_path, monkeypatch):
    """Each payload would create its marker file in tmp_path if it ran (or, for a module, were imported)."""
    module = f"ember_test_probe_{uuid.uuid4().hex}"
    marker = str(tmp_path / "imported")
    (tmp_path / f"{module}.py").write_text(f"open({marker!r}, 'w').close()\n\nclass Thing:\n    x: int = 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield {
        "os.system": {"class_path": "os.system", "init_args": {"command": f"touch '{tmp_path / 'system'}'"}},
        "subprocess.Popen": {
            "class_path": "subprocess.Popen",
            "init_args": {"args": f"touch '{tmp_path / 'popen'}'", "shell": True},
        },
        "builtins.eval": {
            "class_path": "builtins.eval",
            "init_args": {"source": f"open({str(tmp_path / 'eval')!r}, 'w')"},
        },
        "builtins.exec": {
            "class_path": "builtins.exec",
            "init_args": {"source": f"open({str(tmp_path / 'exec')!r}, 'w')"},
        },
        "importlib.import_module": {"class_path": "importlib.import_module", "init_args": {"name": module}},
        "a module's class": {"class_path": f"{module}.Thing"},
    }
    sys.modules.pop(module, None)


def _nested(key: str, value: Any) -> dict[str, Any]:
    section, name = key.split(".")
    return {section: {name: value}}


def _args(channel: str, key: str, payload: dict[str, Any], tmp_path: Path) -> list[str]:
    section, name = key.split(".")
    if channel == "yaml file":
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(_nested(key, payload)))
        return ["--config", str(path)]
    if channel == "yaml string":
        return ["--config", yaml.safe_dump(_nested(key, payload))]
    if channel == "section file":
        path = tmp_path / f"{section}.yaml"
        path.write_text(yaml.safe_dump({name: payload}))
        return [f"--{section}", str(path)]
    return [f"--{key}={json.dumps(payload)}"]


def _refused(args: list[str], capsys, **kwargs: Any) -> str:
    """The error EmberCLI stopped with (it must stop while parsing)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        EmberCLI(OpenModule, OpenData, trainer_defaults={"logger": False}, run=False, args=args, **kwargs)
    assert stop.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("channel", ["yaml file", "yaml string", "section file", "command line"])
@pytest.mark.parametrize(
    "name",
    ["os.system", "subprocess.Popen", "builtins.eval", "builtins.exec", "importlib.import_module", "a module's class"],
)
def test_a_class_path_where_the_type_accepts_anything_runs_nothing_and_names_the_key(
    channel, name, payloads, tmp_path, capsys
):
    for key, is_list in open_keys().items():
        payload = [payloads[name]] if is_list else payloads[name]  # (a list's item, for a list)
        err = _refused(_args(channel, key, payload, tmp_path), capsys)
        assert f'"{key}"' in err and "names no class to build" in err, (key, err)
        assert payloads[name]["class_path"] in err
        ran = sorted(p.name for p in tmp_path.iterdir() if p.suffix not in (".py", ".yaml"))
        assert ran == [], f"{key} via {channel}: {ran}"


def test_nested_class_paths_are_refused_at_every_depth(payloads, tmp_path, capsys, monkeypatch):
    spec = payloads["os.system"]
    callback = f"{OpenCallback.__module__}.OpenCallback"
    in_callback = {"trainer": {"callbacks": [{"class_path": callback, "init_args": {"payload": spec}}]}}
    cases = {
        "trainer.callbacks": [
            ["--config", yaml.safe_dump(in_callback)],
            [f"--trainer.callbacks+={callback}", f"--trainer.callbacks.payload={json.dumps(spec)}"],
            [f"--trainer.callbacks+={callback}", "--trainer.callbacks.payload.class_path=os.system"],
        ],
        "model.extras": [[f"--model.extras={json.dumps({'inner': {'deeper': [spec]}})}"]],
        "model.items": [[f"--model.items={json.dumps([1, spec])}"]],
        "model.anything": [  # dotted sub-options of a parameter that has none
            ["--model.anything.class_path=os.system", "--model.anything.init_args.command=true"],
            ["--model.anything=os.system", "--model.anything.command=true"],
        ],
    }
    for key, variants in cases.items():
        for args in variants:
            err = _refused(args, capsys)
            assert f'"{key}"' in err and ("names no class to build" in err or "is not an option here" in err), err
    # From the environment (parser_kwargs={"default_env": True}).
    monkeypatch.setenv("EMBER_TEST_MODEL__ANYTHING", json.dumps(spec))
    err = _refused([], capsys, parser_kwargs={"default_env": True, "env_prefix": "EMBER_TEST"})
    assert '"model.anything"' in err and "names no class to build" in err
    # A model given by class_path: its arguments are checked by the same rule.
    capsys.readouterr()
    model = {"class_path": f"{__name__}.OpenModule", "init_args": {"anything": spec}}
    with pytest.raises(SystemExit):
        EmberCLI(ember.TrainModule, subclass_mode_model=True, run=False, args=[f"--model={json.dumps(model)}"])
    err = capsys.readouterr().err
    assert "model" in err and "anything" in err and "names no class to build" in err
    # Where the type is a class, the path must name a subclass: checked before anything is built.
    err = _refused([f"--trainer.callbacks={json.dumps([payloads['subprocess.Popen']])}"], capsys)
    assert '"trainer.callbacks"' in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix not in (".py", ".yaml")) == []


def test_a_callable_that_returns_no_class_takes_functions_not_classes(capsys):
    cli = EmberCLI(OpenModule, run=False, args=["--trainer.logger=false", "--model.fn=torch.nn.functional.gelu"])
    assert cli.model.hparams.fn is torch.nn.functional.gelu
    err = _refused(["--model.fn=subprocess.Popen"], capsys)
    assert '"model.fn"' in err and "is a class" in err


def test_types_that_name_classes_still_build_and_plain_data_passes(tmp_path):
    class Optimized(ember.TrainModule):
        def __init__(self, optimizer: Callable[[Iterable], torch.optim.Optimizer] = torch.optim.SGD) -> None:
            super().__init__()
            self.optimizer = optimizer
            self.net = torch.nn.Linear(4, 1)

    config = {
        "trainer": {
            "logger": False,
            "max_time": {"hours": 2},
            "callbacks": [{"class_path": "ember.callbacks.ModelCheckpoint", "init_args": {"monitor": "val/x"}}],
        },
        "model": {"optimizer": {"class_path": "torch.optim.Adam", "init_args": {"lr": 0.5}}},
    }
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = EmberCLI(Optimized, run=False, args=["--config", str(path)])
    assert any(type(cb).__name__ == "ModelCheckpoint" and cb.monitor == "val/x" for cb in cli.trainer.callbacks)
    optimizer = cli.model.optimizer(cli.model.parameters())
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["lr"] == 0.5
    assert cli.config["trainer"]["max_time"] == {"hours": 2}
    # Values of the open types: plain data, as before (strings on the command line read as YAML).
    cli = EmberCLI(
        OpenModule,
        run=False,
        args=[
            "--trainer.logger=false",
            "--trainer.max_time=00:00:01:00",
            "--model.anything=[1, two, {three: 3}]",
            '--model.options={"a": {"b": [1, 2]}}',
            "--model.untyped=7",
            "--model.items=[1, x]",
        ],
    )
    hp = cli.model.hparams
    assert cli.config["trainer"]["max_time"] == "00:00:01:00"
    assert hp.anything == [1, "two", {"three": 3}] and hp.options == {"a": {"b": [1, 2]}}
    assert hp.untyped == 7 and hp["items"] == [1, "x"]


def test_confine_rewrites_only_what_accepts_anything():
    from ember.cli.confined import AnyCallable, AnyList, AnyMapping, AnyValue, confine

    class Proto(typing.Protocol):
        def wait(self) -> int: ...

    assert confine(Any) is AnyValue and confine(object) is AnyValue and confine(Proto) is AnyValue
    assert confine(int | None) == int | None and confine(Union[int, Any]) == Union[int, AnyValue]  # noqa: UP007
    assert confine(dict) is AnyMapping and confine(dict[str, Any]) is AnyMapping and confine(Mapping) is AnyMapping
    assert confine(list) is AnyList and confine(list[Any]) == list[AnyValue]
    assert confine(Callable) is AnyCallable and confine(Callable[..., Any]) is AnyCallable
    for kept in (int, str, dict[str, int], list[int], ember.callbacks.Callback, Callable[..., torch.optim.Optimizer]):
        assert confine(kept) is kept
    assert confine(list[ember.callbacks.Callback] | ember.callbacks.Callback | None) == (
        list[ember.callbacks.Callback] | ember.callbacks.Callback | None
    )


def test_a_misspelt_key_anywhere_in_a_config_is_an_error_naming_it(tmp_path, capsys):
    checkpoint = {"class_path": "ember.callbacks.ModelCheckpoint", "init_args": {"monitr": "x"}}
    cases = {
        "trainr": {"trainr": {"max_epochs": 1}},
        "model.hiden": {"model": {"hiden": 3}},
        "seed_everythin": {"seed_everythin": 3},
        "monitr": {"trainer": {"callbacks": [checkpoint]}},
    }
    for key, config in cases.items():
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(config))
        capsys.readouterr()
        with pytest.raises(SystemExit):
            EmberCLI(OpenModule, args=["fit", "--config", str(path)])
        assert key in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_the_reported_config_run_as_a_user_runs_it(tmp_path):
    """``python examples/cli_digits.py fit --config bad.yaml`` (the subcommand, in its own process)."""
    root = Path(__file__).resolve().parent.parent.parent
    bad = tmp_path / "bad.yaml"
    command = {"class_path": "os.system", "init_args": {"command": f"touch '{tmp_path / 'pwned'}'"}}
    bad.write_text(yaml.safe_dump({"trainer": {"max_time": command}}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    for extra in ([], ["--print_config"]):
        proc = subprocess.run(
            [sys.executable, str(root / "examples" / "cli_digits.py"), "fit", "--config", str(bad), *extra],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert 'Parser key "trainer.max_time"' in proc.stderr and "names no class to build" in proc.stderr
        assert not (tmp_path / "pwned").exists() and not (tmp_path / "ember_logs").exists()
