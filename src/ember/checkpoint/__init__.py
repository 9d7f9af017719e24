"""Checkpoint files: writing, contents, validation and restore, automatic resume, the writers.

==================  ======================================================================
``io.py``           files only: atomic durable writes, the directory lock, temporary files,
                    validated loading (ember's format and Lightning's), weights for a module
``files.py``        file operations of ModelCheckpoint's rotation: links, removal inside a directory
``writer.py``       ``CheckpointWriter`` (synchronous, the strategy's default) and ``BackgroundSave``
``background.py``   ``BackgroundWriter``: the same file, written by a thread after one copy
``contents.py``     what a checkpoint holds (``dump``) and ``save``: state -> dict -> the strategy's writer
``validation.py``   every entry checked against the resuming run before anything changes
``optimizers.py``   each optimizer's state checked against the optimizer it would go into
``restore.py``      resuming a fit in Lightning's three parts, all or nothing
``locate.py``       ``ckpt_path="last"`` / ``"best"`` / ``"auto"`` -> a file
``auto_resume.py``  a restarted torchrun or SLURM job resumes from its own latest checkpoint
==================  ======================================================================

The package sits below the callbacks, the strategies and the trainer (they import it; it imports
none of them): what it needs of them it gets as arguments, the fit's state through
``trainer.fit_state`` (``ember/trainer/state.py``).
"""

from ember.checkpoint.io import (
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointNotFoundError,
    DirectoryLock,
    check_plain_data,
    check_state_dict,
    fsync_dir,
    is_lightning_checkpoint,
    load,
    load_lightning_checkpoint,
    match_compiled_keys,
    read_for_module,
    remove_stale_temporaries,
    temporary_prefix,
    unwritable,
    verify,
    write_atomic,
)
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
