"""Every code block of the guides in docs/ runs, or says here why it is checked instead (issue 13).

Python blocks run as a user would run them: each written alone into a script in a fresh directory
and started with ``python script.py`` (PYTHONPATH at the repository root), so every block must be
self-contained. What each block prints is checked against what its guide says it prints. Blocks
marked ``text`` are output, layouts or commands for GPUs and clusters; they are not code.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
GUIDES = ["quickstart.md", "from-lightning.md", "strategies.md", "checkpoints.md"]


def _blocks(guide: str) -> list[tuple[str, str]]:
    return re.findall(r"```(\w*)\n(.*?)```", open(os.path.join(DOCS, guide)).read(), flags=re.S)


def _python(guide: str) -> list[str]:
    return [code for lang, code in _blocks(guide) if lang == "python"]


# What each Python block must print (regular expressions searched in its stdout), by guide and index.
EXPECT: dict[tuple[str, int], list[str]] = {
    ("quickstart.md", 0): [
        r"Epoch 1/1 done .*val_acc=0\.\d+",
        r"ember: logs in ember_logs/version_0; checkpoint ember_logs/version_0/checkpoints/epoch=1-step=48\.ckpt; "
        r"last checkpoint ember_logs/version_0/checkpoints/last\.ckpt",
        r"\[\{'val_acc': 0\.\d+\}\]",
        r"\[\{'test_acc': 0\.\d+\}\]",
        r"\n2 48 \{'epoch': 1, 'step': 48, 'train_loss': [0-9.]+, 'val_acc': [0-9.]+\}",
    ],
    ("from-lightning.md", 0): [
        r"ember: logs in ember_logs/version_0; best val_loss checkpoint "
        r"ember_logs/version_0/checkpoints/epoch=1-step=48",
        r"\[\{'test_acc': 0\.\d+\}\]",
        r"best: \S+ember_logs/version_0/checkpoints/epoch=1-step=48\.ckpt hidden = 32",
    ],
    ("strategies.md", 0): [r"SingleDeviceStrategy rank 0 of 1: 30 steps, val_acc 0\.\d+"],
    ("strategies.md", 1): [r"DataParallelStrategy rank 0 of 1: 30 steps, val_acc 0\.\d+"],
    # Both ranks print, with the same (reduced) metric.
    ("strategies.md", 2): [r"DDPStrategy rank 0 of 2: 16 steps, val_acc 0\.\d+",
                           r"DDPStrategy rank 1 of 2: 16 steps"],
    ("checkpoints.md", 0): [
        r"\['epoch=1-step=58\.ckpt', 'epoch=2-step=87\.ckpt', 'last\.ckpt'\]",
        r"best: epoch=\d-step=\d+\.ckpt 0\.\d+",
        r"\[\{'val_loss': 0\.\d+\}\]",
        r"hidden = 32\nstep \d+\n",
        r"bitwise equal: True",
    ],
    # The second run of the preemption script (the first one is in FIRST_RUN).
    ("checkpoints.md", 1): [r"^starting at step 20\n", r"finished at step 58"],
}
# Blocks run twice in the same directory: what the first run exits with and prints (stdout, stderr).
FIRST_RUN: dict[tuple[str, int], tuple[int, str, str]] = {
    ("checkpoints.md", 1): (143, r"^starting at step 0\n$",
                            r"Preempted by SIGTERM: saved \S+ember_logs/version_0/checkpoints/last\.ckpt; exiting with "
                            r"status 143"),
}
# Files each block leaves in its directory (paths relative to it).
FILES: dict[tuple[str, int], list[str]] = {
    ("quickstart.md", 0): ["ember_logs/version_0/hparams.yaml", "ember_logs/version_0/checkpoints/last.ckpt",
                           "ember_logs/version_0/checkpoints/epoch=1-step=48.ckpt"],
}
# Blocks that start processes of their own: a longer limit.
SLOW = {("strategies.md", 2)}
CASES = [(guide, i) for guide in GUIDES for i in range(len(_python(guide)))]


def _run_script(tmp_path, source: str, timeout: float) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_docs_index_lists_every_guide_in_reading_order():
    index = open(os.path.join(DOCS, "README.md")).read()
    linked = re.findall(r"\]\(([\w-]+\.md)\)", index)
    assert [g for g in linked if g in GUIDES] == GUIDES
    for guide in GUIDES:
        for target in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)", open(os.path.join(DOCS, guide)).read()):
            assert os.path.exists(os.path.join(DOCS, target)), f"{guide} links to missing {target}"


def test_every_block_is_known():
    """A new block needs its expectations here; a block without a language must be ``text``."""
    for guide in GUIDES:
        langs = {lang for lang, _ in _blocks(guide)}
        assert langs <= {"python", "text"}, (guide, langs)
    assert set(EXPECT) == set(CASES)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("guide,index", CASES, ids=[f"{g[:-3]}-{i}" for g, i in CASES])
def test_python_block_runs(tmp_path, guide, index):
    timeout = 80 if (guide, index) in SLOW else 40
    if (guide, index) in FIRST_RUN:
        status, out, err = FIRST_RUN[(guide, index)]
        first = _run_script(tmp_path, _python(guide)[index], timeout=timeout)
        assert first.returncode == status, first.stderr[-3000:]
        assert re.search(out, first.stdout) and re.search(err, first.stderr), (first.stdout, first.stderr[-3000:])
    done = _run_script(tmp_path, _python(guide)[index], timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    for pattern in EXPECT[(guide, index)]:
        assert re.search(pattern, done.stdout), (pattern, done.stdout[-3000:])
    if (guide, index) in SLOW:  # a job of two ranks: both report the same reduced value
        values = re.findall(r"rank \d of 2: \d+ steps, val_acc (\S+)", done.stdout)
        assert len(values) == 2 and values[0] == values[1], done.stdout[-2000:]
    for path in FILES.get((guide, index), []):
        assert (tmp_path / path).exists(), path
