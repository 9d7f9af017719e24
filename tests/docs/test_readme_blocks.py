"""Every code block of README.md runs, or says here why it is checked instead.

Python blocks run as a user would run them: written into a script (after a prelude that defines
the names a fragment leaves to the reader: the loaders) and started with ``python script.py`` in a
fresh directory. Bash blocks: the example command runs; the test command is the suite itself, so it
is compared with ``.ci/run`` instead of run; the CPU-index install needs the internet, so only its
form is checked. The README's links lead to files and headings that exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.docs.links import broken_links
from tests.docs.scripts import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(ROOT, "README.md")).read()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
BASH = [code.strip() for lang, code in BLOCKS if lang == "bash"]

# What the example leaves to the reader: the loaders (digits-shaped: 8x8 images, 10 classes).
PRELUDE = textwrap.dedent("""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    def _loader(n):
        g = torch.Generator().manual_seed(n)
        return DataLoader(TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)),
                          batch_size=16)

    train_loader, val_loader = _loader(64), _loader(32)
""")
# After the fit: what each rank ends with.
# The line in one write: both ranks write to the same pipe, and the pieces print writes (the text, then the
# newline) of two processes can interleave.
EPILOGUE = textwrap.dedent("""
    fitted = f"FITTED {trainer.global_rank} {trainer.global_step} {sorted(trainer.callback_metrics)}"
    print(fitted + "\\n", end="", flush=True)
""")


def test_readme_has_the_blocks_this_file_knows():
    assert len(PYTHON) == 1 and len(BASH) == 3


def test_readme_links_lead_somewhere():
    assert broken_links(os.path.join(ROOT, "README.md")) == []


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_what_you_write_runs(tmp_path):
    """README's "What you write": the module and the Trainer call, run as a script (``ddp`` starts a second rank)."""
    done = run_script(tmp_path, PRELUDE + PYTHON[0] + EPILOGUE, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    # Every fit ends with the line saying where things went (logger and checkpointing on by default).
    assert "ember: logs in ember_logs/version_0" in done.stdout, done.stdout[-2000:]
    # "What you write" under ddp on 2 ranks: 32 samples each, 2 steps per epoch for 5 epochs; both ranks end
    # with the metrics the module logs.
    # Not anchored to line starts: the other rank's lines may be written in pieces around this one.
    ranks = re.findall(r"FITTED (\d) 10 \['train/loss', 'val/acc'\]", done.stdout)
    assert sorted(ranks) == ["0", "1"], done.stdout[-2000:]


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_the_example_command_runs(tmp_path):
    install, _, run = BASH[0].rpartition("&&")
    assert 'pip install -e ".[examples]"' in install  # the install part: what .ci/run's clean clone proves
    command = run.strip().split()
    assert command[:2] == ["python3", "examples/digits.py"]
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, *command[1].split("/")), *command[2:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=170,
        # As a user's shell starts it: without the one-thread OMP_NUM_THREADS the suite sets (tests/conftest.py).
        env={**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "PYTHONPATH": ROOT},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = float(re.search(r"validation accuracy ([0-9.]+) after 10 epochs", done.stdout).group(1))
    assert accuracy > 0.95


def _normalized(command: str) -> str:
    return " ".join(command.replace("python3 -m ", "").replace(" -q", "").split())


def test_the_test_command_is_what_ci_runs():
    """Not run here (it is this suite): the README's command and .ci/run's lines are the same commands."""
    readme = [_normalized(c) for part in BASH[1].split("&&") for c in part.split(";")]
    lines = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    ci = [_normalized(line) for line in lines if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert readme == ci


def test_the_cpu_install_names_pytorchs_cpu_index():
    assert BASH[2] == "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
