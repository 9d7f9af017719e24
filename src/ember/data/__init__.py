"""The data side: the DataModule a user writes, and the samplers the strategies put in loaders.

``datamodule.py`` holds :class:`DataModule`; ``sampler.py`` the seeded sampler that shards a dataset
across ddp ranks; ``resumable.py`` how a loader is rebuilt around a sampler that can resume in the
middle of an epoch. None of it imports the Trainer or a strategy.
"""

from ember.data.datamodule import DataModule

__all__ = ["DataModule"]
