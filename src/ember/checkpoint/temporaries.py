"""Temporary files of checkpoint writes: how they are named, and removing those whose writer died.

Temporary files (and the directories of sharded checkpoints, ``sharded.py``) are named
``.<target>~<host>~<pid>~<random>.tmp``, so that a later run can tell whether their writer is still alive:
``remove_stale_temporaries`` deletes only those whose writer was on this host and no longer exists. Another
live job's file in flight is never touched.
"""

from __future__ import annotations

import os
import re
import shutil
import socket

_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
# .<name>~<host>~<pid>~<random>.tmp (a write) and .<name>~<host>~<pid>~link.tmp (a hard link)
_TEMPORARY = re.compile(r"^\.(?P<name>.+)~(?P<host>[A-Za-z0-9_-]+)~(?P<pid>\d+)~[^~/]+\.tmp$")
# What ember 0.1 named its hard-link temporaries: <name>.<pid>.link.tmp
_OLD_LINK = re.compile(r"^(?P<name>.+\.ckpt)\.(?P<pid>\d+)\.link\.tmp$")


def temporary_prefix(path: str) -> str:
    """The start of the name of a temporary file written by this process on the way to ``path``."""
    return f".{os.path.basename(path)}~{_HOST}~{os.getpid()}~"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(directory: str) -> list[str]:
    """Delete the temporary files in ``directory`` whose writer provably died; return their names.

    A file is stale only when its name says it was written on this host by a process that no
    longer exists. Files of live processes, and of other hosts (whose processes cannot be checked
    from here), are left alone.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _TEMPORARY.match(name)
        host = m.group("host") if m else _HOST
        m = m or _OLD_LINK.match(name)
        if m is None or host != _HOST or int(m.group("pid")) == os.getpid() or _pid_alive(int(m.group("pid"))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):  # a sharded checkpoint's directory
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(name)
        except OSError:
            pass
    return removed
