"""Checkpoint files in their directory: where a name may point, ``last`` as a link made atomically, and
removal of a checkpoint only inside the directory this run writes to (never another run's file).

What ModelCheckpoint decides (which files, when) is ``ember/callbacks/checkpoint_rotation.py``; the file
operations and the rules on names are here, with no callback or trainer in sight.
"""

from __future__ import annotations

import os
import re
import shutil

from ember.checkpoint import sharded
from ember.checkpoint.atomic import fsync_dir
from ember.checkpoint.temporaries import temporary_prefix

FILE_EXTENSION = ".ckpt"


def check_template(what: str, template: str, field: re.Pattern[str]) -> None:
    """Raise unless the file names ``template`` makes stay inside the checkpoint directory: not
    absolute, no ``..`` above it (a folder such as ``"sub/{epoch}"`` is fine). Outside it, top-k
    rotation would never remove them, ``"last"``/``"auto"`` would never find them, and they might land
    among another run's files."""
    name = field.sub("x", template)
    if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == os.pardir:
        raise ValueError(
            f"ModelCheckpoint({what}={template!r}) names a file outside the checkpoint directory. "
            "Checkpoints are rotated (save_top_k) and found again (ckpt_path='last' / 'auto') only "
            "inside that directory. Choose the directory with dirpath= and keep the name relative to "
            "it, without '..' (folders inside it, such as 'sub/{epoch}', are fine)."
        )


def check_inside(path: str, dirpath: str | None, template: str) -> str:
    """``path`` (normalised) when it is inside ``dirpath``; else an error naming the logged values' fault."""
    path = os.path.normpath(path)
    if dirpath and not inside(path, dirpath):
        raise ValueError(
            f"ModelCheckpoint(filename={template!r}) with this save's values names {path}, outside the "
            f"checkpoint directory {dirpath}: a logged value in the name contains '..' or a path "
            "separator. Leave that value out of the file name, or log a number instead."
        )
    return path


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
    """Delete ``path`` (a file, or a sharded checkpoint's directory) unless it is outside ``dirpath`` (never
    delete another run's file; its sub-folders, which ``filename="sub/{epoch}"`` writes into, are inside) or
    ``protected``."""
    if not path:
        return
    path = os.path.abspath(path)
    if dirpath is None or not inside(path, dirpath) or path in protected:
        return
    if os.path.isdir(path) and not os.path.islink(path):
        if sharded.is_sharded(path):  # a sharded checkpoint's directory; never any other directory
            shutil.rmtree(path, ignore_errors=True)
            fsync_dir(os.path.dirname(path))
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
