"""Sharded checkpoints: a directory of ``torch.distributed.checkpoint`` (DCP) shards beside one file of plain data.

A strategy whose weights are sharded across ranks (``fsdp``: each rank holds ``DTensor`` shards of the
parameters and of their optimizer states) saves a checkpoint as a directory at the checkpoint's path
(``last.ckpt/``, as Lightning's), which no rank ever gathers whole:

==================  ===========================================================================================
``.metadata``,      DCP's own files: every rank writes its shards; DCP's metadata says which piece of which
``__R_0.distcp``    tensor lies where, so a later run on any number of ranks (or one process without a process
                    group) reads exactly the pieces it holds
``meta.pt``         everything else of the checkpoint (``contents.py``'s table) as a ``torch.save`` file of
                    plain data, written by global rank zero, where each sharded tensor stands as a placeholder
                    ``{"ember.shard": key}`` naming its DCP key
==================  ===========================================================================================

:func:`write` is atomic as ember's files are: the directory is written under a temporary name beside the
target (``temporaries.py`` names it, so a later run removes it when its writer died), every file fsynced, then
rank zero swaps it with the previous checkpoint in one ``renameat2(RENAME_EXCHANGE)`` (Linux; elsewhere, or on
a filesystem without it, two renames, with the previous directory kept under a temporary name until the new
one is in place) and deletes the previous one. A crash at any moment leaves the previous checkpoint or the new
one under the checkpoint's name.

:func:`read` returns the checkpoint as one dict, the placeholders replaced by tensors: by default whole tensors
on the CPU, read without any process group (``load_from_checkpoint`` in a plain process, a resume under
another strategy); a sharded strategy passes a ``make_tensor`` that returns this rank's ``DTensor`` shard of the
saved shape, and DCP reads only those pieces (a run on another number of ranks reshards as it reads).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ember.checkpoint.atomic import fsync_dir, rename_over, write_atomic
from ember.checkpoint.format import SHARDED_META, CheckpointError

#: The file of plain data inside a sharded checkpoint directory.
META = SHARDED_META
#: A sharded tensor's placeholder in ``meta.pt``: ``{SHARD: key}``.
SHARD = "ember.shard"

MakeTensor = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def is_sharded(path: str) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (its ``meta.pt`` and DCP's ``.metadata`` inside)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META))


def split(checkpoint: Any, is_shard: Callable[[Any], bool]) -> tuple[Any, dict[str, torch.Tensor]]:
    """``checkpoint`` with every value for which ``is_shard`` holds replaced by a placeholder, and those values
    by key (the path of keys and indices to it, joined by ``/``). Dicts, lists and tuples are walked."""
    shards: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: tuple[str, ...]) -> Any:
        if is_shard(value):
            key = "/".join(path)
            shards[key] = value
            return {SHARD: key}
        if isinstance(value, dict):
            return {k: walk(v, (*path, str(k))) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, (*path, str(i))) for i, v in enumerate(value))
        return value

    return walk(checkpoint, ()), shards


def fill(plain: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``plain`` with each placeholder replaced by its tensor in ``tensors`` (the inverse of :func:`split`)."""
    if isinstance(plain, dict):
        if len(plain) == 1 and SHARD in plain:
            return tensors[plain[SHARD]]
        return {k: fill(v, tensors) for k, v in plain.items()}
    if isinstance(plain, (list, tuple)):
        return type(plain)(fill(v, tensors) for v in plain)
    return plain


def _placeholders(plain: Any, out: list[str]) -> list[str]:
    if isinstance(plain, dict):
        if len(plain) == 1 and isinstance(plain.get(SHARD), str):
            out.append(plain[SHARD])
        else:
            for v in plain.values():
                _placeholders(v, out)
    elif isinstance(plain, (list, tuple)):
        for v in plain:
            _placeholders(v, out)
    return out


def write(
    plain: Any,
    shards: dict[str, torch.Tensor],
    path: str,
    temporary: str,
    *,
    is_writer: bool,
    barrier: Callable[[str], None],
    process_group: Any = None,
    before_rename: Callable[[str], None] | None = None,
) -> None:
    """Write a sharded checkpoint directory at ``path``, atomically. Called on every rank, in step.

    Args:
        plain: the checkpoint with its shards replaced by placeholders (:func:`split`), written by the writer.
        shards: this rank's shards by key (``DTensor`` s; DCP writes each piece once).
        path: the directory to create or replace.
        temporary: the temporary directory's path beside ``path`` (the same on every rank: the writer's name).
        is_writer: whether this rank writes ``meta.pt`` and renames (global rank zero).
        barrier: waits for every rank.
        process_group: the group DCP coordinates on (None: the default group).
        before_rename: called with the temporary directory just before it takes the checkpoint's name (tests
            stop there).
    """
    import torch.distributed.checkpoint as dcp

    if is_writer:
        os.makedirs(temporary)
    barrier("sharded checkpoint: the temporary directory")
    dcp.save(shards, checkpoint_id=temporary, process_group=process_group)  # fsyncs its files (sync_files)
    if is_writer:
        write_atomic(plain, os.path.join(temporary, META))
        fsync_dir(temporary)
        if before_rename is not None:
            before_rename(temporary)
        rename_over(temporary, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    barrier("sharded checkpoint: in place")


def read_meta(path: str) -> dict[str, Any]:
    """The plain part of a sharded checkpoint (placeholders left in), checked to be whole first."""
    verify(path)
    return _plain(path)


def _plain(path: str) -> dict[str, Any]:
    try:
        plain = torch.load(os.path.join(path, META), map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"The sharded checkpoint {path!r} has an unreadable {META} ({type(err).__name__}: {err}). "
            "Use an earlier checkpoint."
        ) from None
    if not isinstance(plain, dict):
        raise CheckpointError(f"{path!r}: {META} holds a {type(plain).__name__}, not an ember checkpoint's dict.")
    return plain


def verify(path: str) -> Any:
    """Raise a ``CheckpointError`` unless the directory ``path`` holds every file its DCP metadata names, each
    at least as long as the pieces it holds say (a truncated or missing shard is found before any load);
    return that metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as err:
        raise CheckpointError(
            f"The sharded checkpoint {path!r} has no readable DCP metadata (.metadata: {type(err).__name__}: {err}): "
            "it was not written completely. Use an earlier checkpoint."
        ) from None
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        name = item.relative_path
        needed[name] = max(needed.get(name, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < size:
            what = "is missing" if have is None else f"has {have} bytes of the {size} its pieces need"
            raise CheckpointError(
                f"The sharded checkpoint {path!r} is incomplete: its shard file {name!r} {what}. "
                "Use an earlier checkpoint."
            )
    return metadata


def read(path: str, make_tensor: MakeTensor | None = None, process_group: Any = None) -> dict[str, Any]:
    """The whole checkpoint at the directory ``path`` as one dict.

    Args:
        path: a sharded checkpoint directory.
        make_tensor: ``(shape, dtype) -> tensor`` into which each sharded tensor is read: this rank's
            ``DTensor`` of a sharded run (then every rank calls this, in step). None: whole tensors on the
            CPU, read by this process alone (no process group is used, whether one exists or not).
        process_group: the group DCP coordinates on, with ``make_tensor`` (None: the default group).
    """
    import torch.distributed.checkpoint as dcp

    metadata = verify(path).state_dict_metadata  # (the DCP metadata is read once)
    plain = _plain(path)
    keys = _placeholders(plain, [])
    if not keys:
        return plain
    missing = [k for k in keys if k not in metadata]
    if missing:
        raise CheckpointError(
            f"The sharded checkpoint {path!r} names tensors its shards do not hold ({missing[:5]}): its files do "
            "not belong together. Use an earlier checkpoint."
        )
    targets: dict[str, torch.Tensor] = {}
    for key in keys:
        meta = metadata[key]
        shape, dtype = tuple(meta.size), meta.properties.dtype
        targets[key] = make_tensor(shape, dtype) if make_tensor is not None else torch.empty(shape, dtype=dtype)
    if make_tensor is None:
        with warnings.catch_warnings():  # (DCP says it assumes one process when no group exists: we asked for one)
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(targets, checkpoint_id=path, no_dist=True)
    else:
        dcp.load(targets, checkpoint_id=path, process_group=process_group)
    return fill(plain, targets)


def consolidate(directory: str, path: str) -> str:
    """Convert the sharded checkpoint ``directory`` into one ember checkpoint file at ``path`` (atomically;
    nothing is read into more than this one process, which needs the whole model's memory on the CPU).
    The file resumes and loads as the directory does; returns its absolute path."""
    directory, path = os.path.abspath(os.fspath(directory)), os.path.abspath(os.fspath(path))
    if not is_sharded(directory):
        raise CheckpointError(f"{directory!r} is not a sharded checkpoint directory (no {META} inside).")
    if path == directory or path.startswith(directory + os.sep):
        raise ValueError(f"Write the single file outside the directory it is made from, not at {path!r}.")
    write_atomic(read(directory), path)
    return path
