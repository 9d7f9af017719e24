"""``AdvancedProfiler``: a cProfile per action, reported by cumulative time, as Lightning's.

Actions nest (``run_training_batch`` holds ``training_step``). Only one cProfile may be enabled at a
time (Python 3.12 refuses a second), so the active action's profile is paused while a nested one
runs and resumed when it stops; each function call is counted in the innermost action only.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats

from ember.profilers.base import Profiler


class AdvancedProfiler(Profiler):
    """Python's cProfile per action: which functions each action spends its time in.

    Args:
        dirpath, filename: where the report goes (see ``Profiler``).
        line_count_restriction: functions listed per action: an int count, or a fraction in (0, 1].
        dump_stats: also write each action's raw stats to ``<report name>-<action>.prof`` (for
            ``snakeviz`` or ``pstats``); needs ``dirpath`` (or the trainer's log folder).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = None,
        line_count_restriction: float = 1.0,
        dump_stats: bool = False,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.profiled_actions: dict[str, cProfile.Profile] = {}
        self.line_count_restriction = line_count_restriction
        self.dump_stats = dump_stats
        self._active: list[str] = []

    def start(self, action_name: str) -> None:
        if self._active:
            self.profiled_actions[self._active[-1]].disable()
        profile = self.profiled_actions.get(action_name)
        if profile is None:
            profile = self.profiled_actions[action_name] = cProfile.Profile()
        self._active.append(action_name)
        profile.enable()

    def stop(self, action_name: str) -> None:
        if action_name not in self._active:
            raise ValueError(f"Attempted to stop {action_name!r}, which was never started.")
        self.profiled_actions[action_name].disable()
        self._active.remove(action_name)
        if self._active:
            self.profiled_actions[self._active[-1]].enable()

    def summary(self) -> str:
        stats = {}
        for action, profile in self.profiled_actions.items():
            if self.dump_stats:
                path = self.report_path(action, ".prof") or os.path.join(self.dirpath or ".", f"{action}.prof")
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                profile.dump_stats(path)
            out = io.StringIO()
            pstats.Stats(profile, stream=out).strip_dirs().sort_stats("cumulative").print_stats(
                self.line_count_restriction
            )
            stats[action] = out.getvalue()
        return self._stats_to_str(stats)

    def teardown(self, stage: str | None = None) -> None:
        super().teardown(stage)
        for profile in self.profiled_actions.values():
            profile.disable()
        self.profiled_actions = {}
        self._active = []
