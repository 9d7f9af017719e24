"""The hparams.yaml emitter (ember.yaml)."""

from __future__ import annotations

import pytest
import torch

from ember.yaml import to_yaml


def test_yaml_emitter():
    text = to_yaml(
        {
            "lr": 1e-3,
            "layers": [64, 32],
            "name": "mlp",
            "quoted": "a: b",
            "flag": True,
            "none": None,
            "yes": "yes",
            "num_str": "12",
            "empty": "",
            "inf": float("inf"),
            "nested": {"opt": {"beta": [0.9, 0.99]}, "list": [{"k": 1}, "x"]},
            "dtype": torch.float32,
            "empty_dict": {},
            "newline": "a\nb",
        }
    )
    assert text == (
        "lr: 0.001\n"
        "layers: [64, 32]\n"
        "name: mlp\n"
        'quoted: "a: b"\n'
        "flag: true\n"
        "none: null\n"
        '"yes": "yes"\n'
        'num_str: "12"\n'
        'empty: ""\n'
        "inf: .inf\n"
        "nested:\n"
        "  opt:\n"
        "    beta: [0.9, 0.99]\n"
        "  list:\n"
        "    -\n"
        "      k: 1\n"
        "    - x\n"
        "dtype: torch.float32\n"
        "empty_dict: {}\n"
        'newline: "a\\nb"\n'
    )
    assert to_yaml({}) == "{}\n"


def test_yaml_emitter_output_parses_with_pyyaml_when_installed():
    yaml = pytest.importorskip("yaml")
    data = {"a": [1, {"b": "c: d"}], "e": "no", "f": 1.5, "g": None, "h": {"i": "x\ty"}}
    assert yaml.safe_load(to_yaml(data)) == data
