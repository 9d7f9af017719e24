"""Every code block of the guides in docs/ runs, or says here why it is checked instead.

Python blocks run as a user would run them: each written alone into a script in a fresh directory
and started with ``python script.py`` (PYTHONPATH at the repository root), so every block must be
self-contained. What each block prints is checked against what its guide says it prints. Blocks
marked ``text`` are output, layouts or commands for GPUs and clusters; they are not code.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.docs.links import broken_links
from tests.docs.scripts import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
GUIDES = [
    "quickstart.md",
    "from-lightning.md",
    "strategies.md",
    "checkpoints.md",
    "logging.md",
    "failures.md",
    "tuning-and-profiling.md",
    "measured.md",
]


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
    ("from-lightning.md", 1): [
        r"Trainer\(\) got 'gpus', a Lightning 1\.x argument removed in Lightning 2\.0: "
        r"use accelerator='cuda', devices=n\.",
        r"Trainer\(\) got 'resume_from_checkpoint', .*: pass ckpt_path= to trainer\.fit\.",
        r"Trainer\(\) got an unexpected keyword argument 'max_epoch'\. Did you mean 'max_epochs'\?",
    ],
    ("strategies.md", 0): [r"SingleDeviceStrategy rank 0 of 1: 30 steps, val_acc 0\.\d+"],
    ("strategies.md", 1): [r"DataParallelStrategy rank 0 of 1: 30 steps, val_acc 0\.\d+"],
    # Both ranks print, with the same (reduced) metric.
    ("strategies.md", 2): [r"DDPStrategy rank 0 of 2: 16 steps, val_acc 0\.\d+", r"DDPStrategy rank 1 of 2: 16 steps"],
    # Two ranks, each holding half of every weight; the last checkpoint is a directory of both ranks' shards.
    ("strategies.md", 3): [
        r"rank 0 of 2: 8 steps, holds \(32, 64\) of \(64, 64\); last checkpoint .*last\.ckpt",
        r"rank 1 of 2: 8 steps, holds \(32, 64\) of \(64, 64\)",
    ],
    ("checkpoints.md", 0): [
        r"\['epoch=1-step=58\.ckpt', 'epoch=2-step=87\.ckpt', 'last\.ckpt'\]",
        r"best: epoch=\d-step=\d+\.ckpt 0\.\d+",
        r"\[\{'val_loss': 0\.\d+\}\]",
        r"hidden = 32\nstep \d+\n",
        r"bitwise equal: True",
    ],
    # The second run of the preemption script (the first one is in FIRST_RUN).
    ("checkpoints.md", 1): [r"^starting at step 20\n", r"finished at step 58"],
    ("logging.md", 0): [
        r"ember: logs in logs/csv/version_0; checkpoint logs/csv/version_0/checkpoints/epoch=1-step=8\.ckpt",
        r"logs/csv/version_0 logs/tb/version_0\n",
        r"step 1 \['epoch', 'loss'\]\nstep 3 \['epoch', 'loss', 'loss_epoch_mean', 'max_logit', 'val_loss'\]\n"
        r"step 5 \['epoch', 'loss'\]\nstep 7 \['epoch', 'loss', 'loss_epoch_mean', 'max_logit', 'val_loss'\]\n",
        r"history 0 4 \['epoch', 'loss', 'loss_epoch_mean', 'max_logit', 'step', 'val_loss'\]\n"
        r"history 1 8 ",
    ],
    # The tuners' short fits print no profiler report; the real fit prints one.
    ("tuning-and-profiling.md", 0): [
        r"^batch size 64, \d+ rates tried, suggested lr [0-9.e+-]+\nFIT Profiler Report",
        r"\|  \[Strategy\]SingleDeviceStrategy\.backward\s+\|  [0-9.e-]+\s+\|  64 ",
    ],
    ("failures.md", 0): [],  # fails on purpose: see STATUS
    ("failures.md", 1): [],
    ("failures.md", 2): [
        r"CheckpointError: Checkpoint '\S+last\.ckpt' does not fit Model: shape mismatches: net\.weight: checkpoint "
        r"\(4, 8\) vs module \(3, 8\)",
        r"module untouched: True",
        r"CheckpointError: Checkpoint 'cut\.ckpt' \(1000 bytes\) cannot be read: it is truncated",
    ],
}
# Blocks that end the job on purpose: their exit status and what stderr must say.
STATUS: dict[tuple[str, int], tuple[int, list[str]]] = {
    ("failures.md", 0): (
        1,
        [
            r"\[rank1\]: ValueError: bad batch on rank 1\n"
            r"\[rank1\]: \[ember ddp\] raised on rank 1 of 2\.",
            r"\[ember ddp\] rank 0: stopping because another rank failed\.",
        ],
    ),
    ("failures.md", 1): (
        1,
        [
            r"\[ember ddp\] rank 0: stopping the job: rank 1 is stuck in training_step at step 3 "
            r"\(epoch 0, batch 3\)",
            r"The watchdog deadline was \d+ s",
            r"\[ember ddp\] rank 1: Python stack",
            r"script\.py\", line 14 in training_step",
        ],
    ),
}
# Blocks run twice in the same directory: what the first run exits with and prints (stdout, stderr).
FIRST_RUN: dict[tuple[str, int], tuple[int, str, str]] = {
    ("checkpoints.md", 1): (
        143,
        r"^starting at step 0\n$",
        r"Preempted by SIGTERM: saved \S+ember_logs/version_0/checkpoints/last\.ckpt; exiting with "
        r"status 143",
    ),
}
# Files each block leaves in its directory (paths relative to it).
FILES: dict[tuple[str, int], list[str]] = {
    ("quickstart.md", 0): [
        "ember_logs/version_0/hparams.yaml",
        "ember_logs/version_0/checkpoints/last.ckpt",
        "ember_logs/version_0/checkpoints/epoch=1-step=48.ckpt",
    ],
    ("strategies.md", 3): ["ember_logs/version_0/checkpoints/last.ckpt/meta.pt"],
}
# Blocks that start processes of their own: a longer limit.
SLOW = {("strategies.md", 2), ("strategies.md", 3), ("failures.md", 0), ("failures.md", 1)}
CASES = [(guide, i) for guide in GUIDES for i in range(len(_python(guide)))]


def test_docs_index_lists_every_guide_in_reading_order():
    index = open(os.path.join(DOCS, "README.md")).read()
    linked = re.findall(r"\]\(([\w-]+\.md)\)", index)
    assert [g for g in linked if g in GUIDES] == GUIDES
    for guide in GUIDES:
        assert broken_links(os.path.join(DOCS, guide)) == [], f"{guide} links to missing files or headings"


def test_every_block_is_known():
    """A new block needs its expectations here; a block without a language must be ``text``."""
    for guide in GUIDES:
        langs = {lang for lang, _ in _blocks(guide)}
        assert langs <= {"python", "text"}, (guide, langs)
    assert set(EXPECT) == set(CASES)


@pytest.mark.processes
@pytest.mark.timeout(90)
@pytest.mark.parametrize("guide,index", CASES, ids=[f"{g[:-3]}-{i}" for g, i in CASES])
def test_python_block_runs(tmp_path, guide, index):
    timeout = 80 if (guide, index) in SLOW else 40
    if (guide, index) in FIRST_RUN:
        status, out, err = FIRST_RUN[(guide, index)]
        first = run_script(tmp_path, _python(guide)[index], timeout=timeout)
        assert first.returncode == status, first.stderr[-3000:]
        assert re.search(out, first.stdout) and re.search(err, first.stderr), (first.stdout, first.stderr[-3000:])
    done = run_script(tmp_path, _python(guide)[index], timeout=timeout)
    status, errors = STATUS.get((guide, index), (0, []))
    assert done.returncode == status, done.stderr[-3000:]
    for pattern in errors:
        assert re.search(pattern, done.stderr), (pattern, done.stderr[-3000:])
    for pattern in EXPECT[(guide, index)]:
        assert re.search(pattern, done.stdout), (pattern, done.stdout[-3000:])
    if (guide, index) == ("strategies.md", 2):  # a job of two ranks: both report the same reduced value
        # (two processes share the pipe: one's line can land before the other's newline)
        values = re.findall(r"rank \d of 2: \d+ steps, val_acc (\d\.\d{4})", done.stdout)
        assert len(values) == 2 and values[0] == values[1], done.stdout[-2000:]
    for path in FILES.get((guide, index), []):
        assert (tmp_path / path).exists(), path
