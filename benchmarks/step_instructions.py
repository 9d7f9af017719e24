"""Instructions per training step, counted by valgrind's callgrind: the per-step cost of each
``benchmarks/overhead.py`` configuration, free of this machine's noise.

On a shared 2-core machine the paired wall or CPU medians of ``overhead.py`` spread by several percent
between runs, as much as the goals they check (a bare trainer within +2% of the plain loop, the bar with
per-step ``self.log`` and TensorBoard within +5%). Instruction counts repeat exactly for the same
interpreter, inputs and environment, whatever else the machine runs. Each configuration runs once in a
fresh process under callgrind at two step counts (``overhead.py --once``), which counts the run alone
(a switch built here with the C compiler turns counting on and off around it): not the imports, the
batches' making, or the interpreter's exit, whose frees depend on the heap's state and so differ between
two runs by more than a step's cost. The difference of the two counts, divided by the difference in
steps, is what one step costs: the fit's setup cancels out. Instructions
are not time (a cache miss costs more than an add), so this is a bound on the work the trainer adds,
beside the timed medians, not a replacement for them. Run (valgrind, with its headers, from your
package manager, and a C compiler):

    python benchmarks/step_instructions.py [--steps 100,600] [--jobs 2]

About 35 minutes on 2 cores: each run imports torch and runs a warm-up fit under callgrind.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
#: overhead.py's configurations: "module step" is its plain loop calling the module's training_step (no trainer),
#: "plain+thread" the plain loop in a process with one idle thread more, as a fit's process has (overhead.py's
#: ``_idle_thread``: glibc's malloc then takes its locks).
CONFIGS = ["plain", "plain+thread", "module step", "bare", "bar+log", "bar+log+tensorboard"]
#: The names overhead.py --once knows them by, where they differ.
ONCE_NAMES = {"module step": "no trainer: module.training_step", "plain+thread": "plain, one idle thread"}
LABELS = {
    "plain": "plain PyTorch loop",
    "plain+thread": "plain loop, one idle thread",
    "module step": "no trainer: module.training_step",
}


#: Callgrind's switch, for ``overhead.py --once`` to count only the run (built with the C compiler here).
TOGGLE_SOURCE = """
#include <valgrind/callgrind.h>
void ember_callgrind_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""


def build_toggle(out_dir: str) -> str:
    """The shared library whose ``ember_callgrind_toggle`` turns callgrind's counting on and off."""
    source, lib = os.path.join(out_dir, "toggle.c"), os.path.join(out_dir, "toggle.so")
    with open(source, "w") as f:
        f.write(TOGGLE_SOURCE)
    cc = os.environ.get("CC", "cc")
    done = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", lib, source], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"could not build the callgrind switch with {cc} (a C compiler and valgrind's headers, "
            f"valgrind/callgrind.h, are needed):\n{done.stderr[-2000:]}"
        )
    return lib


def count(config: str, steps: int, out_dir: str, toggle: str) -> int:
    """Instructions callgrind counts in one run of ``config`` with ``steps`` steps (a fresh process; only
    the run itself is counted, from ``overhead.py --once``'s switch on to its switch off)."""
    out = os.path.join(out_dir, f"callgrind.{config.replace(' ', '-')}.{steps}")
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--collect-atstart=no",
        f"--callgrind-out-file={out}",
        sys.executable,
        os.path.join(HERE, "overhead.py"),
        "--once",
        ONCE_NAMES.get(config, config),
        "--steps",
        str(steps),
    ]
    # A fixed hash seed: with a random one, set and dict orders (and so the one-time work of lazy
    # initialisation inside torch) differ between the two runs, by millions of instructions.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "EMBER_CALLGRIND_TOGGLE": toggle}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{config} with {steps} steps failed under callgrind:\n{done.stderr[-3000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", default="100,600", help="the two step counts, low,high")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {CONFIGS}")
    args = parser.parse_args()
    low, high = (int(s) for s in args.steps.split(","))
    if not 0 < low < high:
        parser.error(f"--steps {args.steps}: give two step counts, the smaller first")
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {CONFIGS}")
    if "plain" not in configs:
        configs.insert(0, "plain")  # the reference every ratio is taken against
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind, or your platform's package)")
    with tempfile.TemporaryDirectory() as out_dir, ThreadPoolExecutor(args.jobs) as pool:
        toggle = build_toggle(out_dir)
        runs = {(c, s): pool.submit(count, c, s, out_dir, toggle) for c in configs for s in (low, high)}
        per_step = {c: (runs[c, high].result() - runs[c, low].result()) / (high - low) for c in configs}
    print(f"instructions per training step (callgrind; runs of {high} and {low} steps, the difference / {high - low})")
    plain, threaded = per_step["plain"], per_step.get("plain+thread")
    if threaded is not None:
        print("  (and against the plain loop in a process with one idle thread, as a fit's process has)")
    for c in configs:
        label = LABELS.get(c, f"ember {c}")
        line = f"  {label:32s} {per_step[c]:12,.0f}   {per_step[c] / plain:.4f}x  ({per_step[c] - plain:+,.0f} a step)"
        if threaded is not None and c not in ("plain", "plain+thread"):
            line += f"   {per_step[c] / threaded:.4f}x  ({per_step[c] - threaded:+,.0f})"
        print(line)


if __name__ == "__main__":
    main()
