"""Deprecated: the old home of ember's checkpoint file API. Import these names from ``ember.checkpoint``
(``from ember.checkpoint import CheckpointError``); this module re-exports them, with a
``DeprecationWarning`` when it is imported, and will be removed in a later release."""

import warnings

from ember.checkpoint import (
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

warnings.warn(
    "ember.checkpoint_io is deprecated and will be removed: import the same names from ember.checkpoint "
    "(for example `from ember.checkpoint import CheckpointError`).",
    DeprecationWarning,
    stacklevel=2,
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
