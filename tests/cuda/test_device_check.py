"""The GPU tooling on a machine without CUDA: the suite skips cleanly, the device check stops at once.

``benchmarks/device_check.sh`` installs and runs the CUDA suite and ``benchmarks/gpu.py`` on a GPU
machine; here (no GPU) it must fail fast, before installing anything, with a clear message and a
non-zero status. On a machine with CUDA these tests are skipped: there the script runs for real.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: the check runs for real there"),
    pytest.mark.timeout(60),
]


def _run(args: list[str], **env: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=50, env={**os.environ, **env})
    return done, time.monotonic() - start


def test_device_check_without_a_gpu_stops_at_once_with_a_clear_message():
    done, seconds = _run(["bash", "benchmarks/device_check.sh"])
    assert done.returncode == 2, done.stdout + done.stderr
    # Either probe may be what finds no GPU: no NVIDIA device, or a torch that cannot use one.
    assert "no NVIDIA GPU on this machine" in done.stderr or "torch.cuda.is_available() is False" in done.stderr
    assert "pip install" not in done.stdout  # nothing was installed
    assert seconds < 20


def test_device_check_with_a_cpu_only_torch_says_what_to_install():
    done, seconds = _run(["bash", "benchmarks/device_check.sh"], EMBER_DEVICE_CHECK_SKIP_PROBE="1")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"torch {torch.__version__}" in done.stderr and "torch.cuda.is_available() is False" in done.stderr
    assert "install a CUDA build" in done.stderr
    assert seconds < 30


def test_gpu_benchmark_refuses_to_run_without_cuda():
    done, _ = _run([sys.executable, "benchmarks/gpu.py", "--quick"])
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr


def test_the_cuda_suite_is_collected_and_skipped_cleanly():
    done, _ = _run(
        [sys.executable, "-m", "pytest", "tests/cuda", "-p", "no:cacheprovider", "-o", "addopts=", "-q", "-rs"]
        # This file runs (and passes) without CUDA; everything else in tests/cuda must skip.
        + [f"--ignore={Path(__file__).relative_to(ROOT)}"]
    )
    assert done.returncode == 0, done.stdout[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert "skipped" in last and "passed" not in last and "error" not in last, last
    assert "needs CUDA" in done.stdout
