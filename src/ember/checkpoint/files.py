"""File operations of ModelCheckpoint's rotation: ``last`` as a link made atomically, and removal of a
checkpoint only inside the directory this run writes to (never another run's file)."""

from __future__ import annotations

import os

from ember.checkpoint.io import fsync_dir, temporary_prefix


def link_atomic(src: str, dst: str, symbolic: bool = False) -> bool:
    """Make ``dst`` another name of ``src`` atomically (link + rename); False where links are unsupported.

    A hard link is a second name of the same file; a symbolic one (``symbolic=True``) holds the path
    of ``src`` relative to ``dst``'s directory, so the directory can be moved as a whole.
    """
    tmp = os.path.join(os.path.dirname(dst), temporary_prefix(dst) + "link.tmp")
    try:
        if symbolic:
            os.symlink(os.path.relpath(src, os.path.dirname(os.path.abspath(dst))), tmp)
        else:
            os.link(src, tmp)
        os.replace(tmp, dst)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
    fsync_dir(os.path.dirname(os.path.abspath(dst)))
    return True


def inside(path: str, directory: str) -> bool:
    """Whether ``path`` names something inside ``directory`` (at any depth), by their names."""
    path, directory = os.path.abspath(path), os.path.abspath(directory)
    return path != directory and os.path.commonpath([path, directory]) == directory


def remove_checkpoint(path: str, dirpath: str | None, protected: set[str]) -> None:
    """Delete ``path`` unless it is outside ``dirpath`` (never delete another run's file; its sub-folders,
    which ``filename="sub/{epoch}"`` writes into, are inside) or ``protected``."""
    if not path:
        return
    path = os.path.abspath(path)
    if dirpath is None or not inside(path, dirpath) or path in protected:
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
