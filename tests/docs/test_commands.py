"""The commands CONTRIBUTING.md and the measured figures (docs/measured.md, README's Measured) name, checked
without running them: they are the suite itself, a re-recording with Lightning installed, a GPU check, or
benchmarks that take minutes.

CONTRIBUTING.md's blocks are all ``bash``: the list of what ``.ci/test`` runs is ``.ci/test``'s own command
lines; every file a block names exists, and every pytest mark it selects is registered. Every benchmark
command beside a measured figure names a script that exists and only options that script defines. Every
relative link of the project's Markdown leads to a file, and to a heading of it when it names one.
"""

from __future__ import annotations

import glob
import os
import re

from tests.docs.links import broken_links

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONTRIBUTING = open(os.path.join(ROOT, "CONTRIBUTING.md")).read()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", CONTRIBUTING, flags=re.S)
BASH = [code for lang, code in BLOCKS if lang == "bash"]
# A path inside the repository, as the blocks name them.
PATH = re.compile(r"(?<![\w/.-])(?:\.ci|tests|benchmarks|examples|src|docs)/[\w./-]*\w")


def _lines(block: str) -> list[str]:
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_contributing_has_the_blocks_this_file_knows():
    assert [lang for lang, _ in BLOCKS] == ["bash"] * 4


def test_what_ci_test_runs_is_ci_test():
    """The first block lists ``.ci/test``'s commands, in its order: mypy there runs in the background (``&``),
    and the pytest status is kept (``|| status=$?``) while mypy finishes."""
    lines = open(os.path.join(ROOT, ".ci", "test")).read().splitlines()
    ci = [
        line.removesuffix(" &").removesuffix(" || status=$?")
        for line in lines
        if line.startswith(("python3 -m ", "lint-imports"))
    ]
    assert _lines(BASH[0]) == ci


def test_the_files_the_blocks_name_exist():
    named = [path for block in BASH for path in PATH.findall(block)]
    assert "benchmarks/device_check.sh" in named and "tests/compat/record_lightning.py" in named
    assert [path for path in named if not os.path.exists(os.path.join(ROOT, path))] == []


def test_the_marks_the_blocks_select_are_registered():
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()  # (tomllib is Python 3.11+; we support 3.10)
    markers = re.search(r"^markers = \[(.*?)^\]", pyproject, flags=re.S | re.M).group(1)
    registered = set(re.findall(r'^\s*"(\w+): ', markers, flags=re.M))
    assert "processes" in registered, registered
    selections = re.findall(r'(?<!python3 )(?<!python )-m (?:"([^"]+)"|(\w+))', CONTRIBUTING)  # not python's -m
    assert selections, "CONTRIBUTING.md selects the tiers with -m"
    for quoted, bare in selections:
        marks = set((quoted or bare).split()) - {"not", "and", "or"}
        assert marks <= registered, (quoted or bare, registered)


def _benchmark_commands() -> list[tuple[str, str]]:
    """(script, arguments) of every ``python benchmarks/<script>.py ...`` in a code span of the measured
    figures' tables."""
    text = open(os.path.join(ROOT, "docs", "measured.md")).read() + open(os.path.join(ROOT, "README.md")).read()
    commands = []
    for span in re.findall(r"`([^`\n]+)`", text):
        for script, arguments in re.findall(r"python3? (benchmarks/[\w]+\.py)((?: [^`]*)?)", span):
            commands.append((script, arguments))
    return commands


def test_the_measured_figures_commands_exist():
    commands = _benchmark_commands()
    headline = {"benchmarks/overhead.py", "benchmarks/ddp.py", "benchmarks/dp.py", "benchmarks/recovery.py"}
    assert headline <= {script for script, _ in commands}, commands
    for script, arguments in commands:
        path = os.path.join(ROOT, script)
        assert os.path.exists(path), script
        source = open(path).read()
        for option in re.findall(r"(?<![\w-])--[a-z][\w-]*", arguments):
            assert f'"{option}"' in source, f"{script} defines no {option}"


def test_every_markdown_link_leads_somewhere():
    pages = ["README.md", "CONTRIBUTING.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md"))]
    assert {page: broken_links(os.path.join(ROOT, page)) for page in pages} == dict.fromkeys(pages, [])
