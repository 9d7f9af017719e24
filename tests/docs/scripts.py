"""Running a documentation code block as a user runs it: written to ``script.py`` and started with
``python script.py`` in a fresh directory, the repository's ``src`` layout importable as installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(directory: Path, source: str, timeout: float) -> subprocess.CompletedProcess:
    script = directory / "script.py"
    script.write_text(source)
    # The checkout's own src first: the blocks test this tree's ember, not whichever one is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}
    return subprocess.run(
        [sys.executable, str(script)], cwd=directory, capture_output=True, text=True, timeout=timeout, env=env
    )
