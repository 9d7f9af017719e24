"""ember: a lean PyTorch trainer in the style of Lightning, with in-house DP and DDP."""
from __future__ import annotations

from ember import callbacks, strategies
from ember.data import DataModule
from ember.module import TrainModule
from ember.seed import seed_everything
from ember.trainer import Trainer
from ember.version import __version__

__all__ = ["Trainer", "TrainModule", "DataModule", "seed_everything", "callbacks", "strategies", "__version__"]
