"""Running a documentation code block as a user runs it: written to ``script.py`` and started with
``python script.py`` in a fresh directory, the repository's ``src`` layout importable as installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.jobs import complete_job, start_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(directory: Path, source: str, timeout: float) -> subprocess.CompletedProcess:
    script = directory / "script.py"
    script.write_text(source)
    # The checkout's own src first: the blocks test this tree's ember, not whichever one is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}
    # Past the timeout, the failure shows the script's output so far and its stacks (tests/helpers/jobs.py).
    return complete_job(start_job([sys.executable, str(script)], cwd=directory, env=env, split=True), timeout)
