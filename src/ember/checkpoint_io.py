"""The old home of ember's checkpoint file API, kept so that ``ember.checkpoint_io.CheckpointError``
and the other names below keep working; the code is in ``ember.checkpoint.io``."""

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

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointNotFoundError",
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
