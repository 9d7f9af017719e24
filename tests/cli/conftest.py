"""The CLI tests build ``EmberCLI`` in pytest's process with ``args=``, as a program run with those words
would: ``sys.argv`` holds only the program's name, not pytest's own arguments (which EmberCLI would
warn about, as Lightning's CLI does, since it parses only ``args``)."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _program_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
