"""Per-step overhead of two ember source trees, paired: is a change free on the step path?

    python benchmarks/compare_trees.py --a <tree before> --b <tree after> [--rounds 15] [--steps 400] [--clock cpu]

Each round starts one process per tree (in a shuffled order), with ``PYTHONPATH=<tree>/src``; each
process times overhead.py's "bare" configuration (no bar, no logger, no checkpoints) and the plain
PyTorch loop on the same batches, alternately, three times, and reports the median ember/plain ratio.
The two trees' ratios of the same round are compared, so machine load that shifts both cancels; the
median and quartiles of b/a over the rounds are printed. ``--clock cpu`` times with the process's CPU
time instead of wall time (see overhead.py).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def child(steps: int, clock: str) -> None:
    import torch

    sys.path.insert(0, HERE)
    import overhead

    overhead.use_clock(clock)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(steps)]
    stdout = sys.stdout
    ratios = []
    with tempfile.TemporaryDirectory() as root, open(os.devnull, "w") as devnull:
        for i in range(3):
            plain = overhead.plain_loop(batches)
            sys.stdout = devnull
            try:
                ember_t = overhead.ember_loop(batches, overhead.CONFIGS["bare"], root)
            finally:
                sys.stdout = stdout
            if i:  # the first is a warm-up
                ratios.append(ember_t / plain)
    print(statistics.median(ratios))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", help="the tree before (a folder holding src/ember)")
    parser.add_argument("--b", help="the tree after")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="wall time, or the CPU time")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.steps, args.clock)
        return
    trees = {"a": args.a, "b": args.b}
    rng = random.Random(0)
    ratios: dict[str, list[float]] = {"a": [], "b": []}
    for _ in range(args.rounds):
        order = list(trees)
        rng.shuffle(order)
        for name in order:
            env = dict(os.environ, PYTHONPATH=os.path.join(trees[name], "src"))
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--steps", str(args.steps), "--clock", args.clock],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            ratios[name].append(float(out.strip().splitlines()[-1]))
        print(
            f"round {len(ratios['a'])}: a {ratios['a'][-1]:.3f}x  b {ratios['b'][-1]:.3f}x  "
            f"b/a {ratios['b'][-1] / ratios['a'][-1]:.3f}",
            flush=True,
        )
    paired = [b / a for a, b in zip(ratios["a"], ratios["b"])]
    q1, q2, q3 = statistics.quantiles(paired, n=4)
    print(f"ember 'bare' per step / plain loop, median of {args.rounds} rounds x {args.steps} steps:")
    print(f"  a: {statistics.median(ratios['a']):.3f}x   b: {statistics.median(ratios['b']):.3f}x")
    print(f"  paired b/a: {q2:.3f} [{q1:.3f}, {q3:.3f}] (median [quartiles])")


if __name__ == "__main__":
    main()
