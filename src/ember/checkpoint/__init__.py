"""Checkpoint files: writing, contents, validation and restore, automatic resume, the writers.

==================  ======================================================================
``format.py``       what a checkpoint is: format tag and version, plain data only, the errors
``atomic.py``       writing a file atomically and durably; the writability probe
``temporaries.py``  temporary files' names, and removing those whose writer died
``lock.py``         ``DirectoryLock``: one run at a time writes into a directory
``reading.py``      ``verify`` and ``load``: a whole file, of a format this version reads
``lightning.py``    PyTorch Lightning's checkpoints, read as they are
``weights.py``      a module's weights checked against it; ``load_from_checkpoint``'s reading
``files.py``        files in their directory: names, ``last`` links, removal inside a directory
``writer.py``       ``CheckpointWriter`` (synchronous, the strategy's default) and ``BackgroundSave``
``background.py``   ``BackgroundWriter``: the same file, written by a thread after one copy
``contents.py``     what a checkpoint holds (``dump``) and ``save``: state -> dict -> the strategy's writer
``validation.py``   the entries' form, and each part against the resuming run, before anything changes
``optimizers.py``   each optimizer's state checked against the optimizer it would go into
``restore.py``      ``Restore``: every part checked, snapshotted, loaded, put back on a failure
``auto_resume.py``  a restarted torchrun or SLURM job resumes from its own latest checkpoint
==================  ======================================================================

The package takes the fit's state (``ember.state.State``: named parts, each with ``state_dict`` /
``load_state_dict``) and the strategy, never the Trainer: it imports nothing of ``ember.trainer``
(pyproject.toml's import-linter contract and ruff's TID251 rule hold it to that), and sits below the
callbacks, the strategies and the trainer, which import it.
"""

from ember.checkpoint.atomic import fsync_dir, unwritable, write_atomic
from ember.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointNotFoundError,
    check_plain_data,
    is_lightning_checkpoint,
)
from ember.checkpoint.lightning import load_lightning_checkpoint
from ember.checkpoint.lock import DirectoryLock
from ember.checkpoint.reading import load, verify
from ember.checkpoint.sharded import consolidate
from ember.checkpoint.temporaries import remove_stale_temporaries, temporary_prefix
from ember.checkpoint.weights import check_state_dict, match_compiled_keys, read_for_module
from ember.checkpoint.writer import BackgroundSave, CheckpointWriter

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "BackgroundSave",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointWriter",
    "DirectoryLock",
    "check_plain_data",
    "check_state_dict",
    "consolidate",
    "fsync_dir",
    "is_lightning_checkpoint",
    "load",
    "load_lightning_checkpoint",
    "match_compiled_keys",
    "read_for_module",
    "remove_stale_temporaries",
    "temporary_prefix",
    "unwritable",
    "verify",
    "write_atomic",
]
