"""``SimpleProfiler``: wall time per action (mean, calls, total, share of the run), as Lightning's table.

Nested actions are timed independently (``run_training_batch`` contains ``training_step``), so the
percentages of nested rows add up to more than 100 %: each row answers "how much of the run was
spent inside this action".
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict

from ember.profilers.base import Profiler


class SimpleProfiler(Profiler):
    """Records each action's durations and reports mean, number of calls, total and percentage.

    Args:
        dirpath, filename: where the report goes (see ``Profiler``).
        extended: add the number of calls and the percentage of the run to the table.
    """

    def __init__(
        self, dirpath: str | os.PathLike | None = None, filename: str | None = None, extended: bool = True
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.current_actions: dict[str, float] = {}
        self.recorded_durations: dict[str, list[float]] = defaultdict(list)
        self.extended = extended
        self.start_time = time.perf_counter()

    def start(self, action_name: str) -> None:
        if action_name in self.current_actions:
            raise ValueError(f"Attempted to start {action_name!r}, which has already started; stop it first.")
        self.current_actions[action_name] = time.perf_counter()

    def stop(self, action_name: str) -> None:
        end = time.perf_counter()
        begun = self.current_actions.pop(action_name, None)
        if begun is None:
            raise ValueError(f"Attempted to stop {action_name!r}, which was never started.")
        self.recorded_durations[action_name].append(end - begun)

    def summary(self) -> str:
        sep = os.linesep
        title = (f"{self._stage.upper()} " if self._stage else "") + "Profiler Report" + sep
        if not self.recorded_durations:
            return ""
        total = time.perf_counter() - self.start_time
        rows = []
        for action, durations in self.recorded_durations.items():
            s = math.fsum(durations)
            rows.append((action, s / len(durations), len(durations), s, 100.0 * s / total))
        width = max(len(r[0]) for r in rows)

        def row(*cells: str) -> str:
            return f"{sep}|  {cells[0]:<{width}s}\t|" + "".join(f"  {c:<15}\t|" for c in cells[1:])

        if self.extended:
            rows.sort(key=lambda r: r[4], reverse=True)
            header = row("Action", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %")
            line = sep + "-" * len(header.expandtabs())
            out = line + header + line + row("Total", "-", str(sum(r[2] for r in rows)), f"{total:.5}", "100 %") + line
            out += "".join(row(a, f"{m:.5}", str(n), f"{s:.5}", f"{p:.5}") for a, m, n, s, p in rows)
        else:
            rows.sort(key=lambda r: r[1], reverse=True)
            header = row("Action", "Mean duration (s)", "Total time (s)")
            line = sep + "-" * len(header.expandtabs())
            out = line + header + line + "".join(row(a, f"{m:.5}", f"{s:.5}") for a, m, _, s, _ in rows)
        return title + out + line + sep

    def teardown(self, stage: str | None = None) -> None:
        super().teardown(stage)
        # The next run reports its own actions (as Lightning, the clock keeps the first run's start).
        self.recorded_durations = defaultdict(list)
        self.current_actions = {}
