"""Every code block of README.md runs, or says here why it is checked instead.

Python blocks run as a user would run them: written into a script (after a prelude that defines
the names a fragment leaves to the reader, such as ``MyModule`` and the loaders) and started with
``python script.py`` in a fresh directory. Bash blocks: the example command runs; the test command
is the suite itself, so it is compared with ``.ci/run`` instead of run; the CPU-index install needs
the internet, so only its form is checked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.docs.scripts import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(ROOT, "README.md")).read()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
BASH = [code.strip() for lang, code in BLOCKS if lang == "bash"]

# What a fragment leaves to the reader: a module and loaders (digits-shaped, so "What you write" fits).
PRELUDE = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import ember

    def _loader(n):
        g = torch.Generator().manual_seed(n)
        return DataLoader(TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)),
                          batch_size=16)

    train_loader, val_loader = _loader(64), _loader(32)

    class MyModule(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
""")
# After a block that only defines a module: use it the way the README's next sentences describe.
EPILOGUE = {
    "class Classifier": textwrap.dedent("""
        trainer = ember.Trainer(max_epochs=2, accelerator="cpu")
        trainer.fit(Classifier(), train_loader, val_loader)
        print("FITTED", trainer.global_step, sorted(trainer.callback_metrics))
    """),
}


def test_readme_has_the_blocks_this_file_knows():
    assert len(PYTHON) == 2 and len(BASH) == 3


@pytest.mark.processes
@pytest.mark.timeout(180)
@pytest.mark.parametrize("index", range(2))
def test_python_block_runs(tmp_path, index):
    block = PYTHON[index]
    epilogue = "".join(e for key, e in EPILOGUE.items() if key in block)
    done = run_script(tmp_path, PRELUDE + block + epilogue, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    # Every fit ends with the line saying where things went (logger and checkpointing on by default).
    assert "ember: logs in ember_logs/version_0" in done.stdout, done.stdout[-2000:]
    if epilogue:
        assert "FITTED 8 ['train/loss', 'val/acc']" in done.stdout


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
