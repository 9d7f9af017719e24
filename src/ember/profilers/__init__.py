"""Profilers for ``Trainer(profiler=...)``: "simple" (wall time per action), "advanced" (cProfile per
action), "pytorch" (``torch.profiler`` with a TensorBoard trace), or a ``Profiler`` subclass of your own."""

from ember.profilers.advanced import AdvancedProfiler
from ember.profilers.base import PassThroughProfiler, Profiler
from ember.profilers.pytorch import PyTorchProfiler
from ember.profilers.simple import SimpleProfiler

__all__ = ["Profiler", "PassThroughProfiler", "SimpleProfiler", "AdvancedProfiler", "PyTorchProfiler"]

#: ``Trainer(profiler=<name>)``.
PROFILERS = {"simple": SimpleProfiler, "advanced": AdvancedProfiler, "pytorch": PyTorchProfiler}
