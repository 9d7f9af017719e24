"""Recovery time of a torchrun job whose rank 1 is killed: from the SIGKILL to the first training step
of the restarted attempt.

    python benchmarks/recovery.py [--rounds 5] [--workers 0] [--nproc 2]

Each round runs ``torchrun --standalone --nproc-per-node N --max-restarts 1`` on the restart tests'
script (tests/trainer/elastic_script.py: default logger, a checkpoint every 3 steps), kills rank 1
with SIGKILL at step 7 of the first attempt, and reads two timestamps the script writes: just before
the kill, and at the first ``training_step`` the restarted attempt runs (after torchrun noticed the
failure, stopped the other rank, started new processes that imported torch and ember, joined a new
process group and restored the checkpoint). Also reported: the part spent before torchrun started
the new attempt (the surviving rank noticing and exiting), and whether the job ended with status 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "trainer", "elastic_script.py")


def one_round(workers: int, nproc: int) -> tuple[float, float, int]:
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_"))}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(nproc),
                "--max-restarts",
                "1",
                "--monitor-interval",
                "0.1",
                SCRIPT,
                out,
                "--kill-at",
                "7",
                "--workers",
                str(workers),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        with open(os.path.join(out, "killed")) as f:
            killed = float(f.read().split()[0])
        with open(os.path.join(out, "restarted1")) as f:
            first_step = float(f.read().split()[0])
        with open(os.path.join(out, "attempts")) as f:
            restart_started = float(f.read().splitlines()[1].split()[1])
        return first_step - killed, restart_started - killed, proc.returncode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    totals, downs, codes = [], [], []
    for r in range(args.rounds):
        total, down, code = one_round(args.workers, args.nproc)
        totals.append(total)
        downs.append(down)
        codes.append(code)
        print(
            f"round {r}: kill -> first step of the restart {total:6.2f} s "
            f"(kill -> restarted attempt's first process start {down:5.2f} s), exit status {code}",
            flush=True,
        )
    print(
        f"\nrecovery time, median of {args.rounds}: {statistics.median(totals):.2f} s "
        f"(min {min(totals):.2f}, max {max(totals):.2f}); until the new attempt started: "
        f"{statistics.median(downs):.2f} s; all finished with status 0: {all(c == 0 for c in codes)}"
    )
    print(f"({time.strftime('%Y-%m-%d')}, {args.nproc} ranks over gloo, {args.workers} loader workers per rank)")


if __name__ == "__main__":
    main()
