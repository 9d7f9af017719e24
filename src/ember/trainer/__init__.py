"""The Trainer and its parts: loops, metrics, optimizers, precision, progress, checkpoints."""

from ember.trainer.trainer import Trainer

__all__ = ["Trainer"]
