"""A process forked after ember joined the process group (a DataLoader worker, say) drops its copies
of the group's connections, so a rank killed with SIGKILL is seen gone by its peers at once rather
than when its orphaned loader workers exit; the parent's group keeps working."""

from __future__ import annotations

import datetime
import json
import os
import stat

import pytest
import torch
import torch.distributed as dist

from ember.strategies.launchers import launcher, processes
from tests.helpers.dist import run_ranks

pytestmark = pytest.mark.processes


def _is_socket(fd: int) -> bool:
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:
        return False


def _fork_and_look(rank: int, world_size: int) -> tuple[list[int], list[int], float]:
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()  # the helper's own group; join again the way ember's ddp does
    world = launcher.World(rank, world_size, rank, world_size, 0, "127.0.0.1", 0, "torchrun")
    launcher.Launcher(world, datetime.timedelta(seconds=30), store=dist.PrefixStore("again", store)).init_process_group(
        "gloo"
    )
    ours = sorted(processes._group_sockets)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: which of the group's descriptors are still sockets here?
        os.write(w, json.dumps([fd for fd in ours if _is_socket(fd)]).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    in_child = json.loads(os.read(r, 65536).decode())
    os.close(r)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # the parent's connections are untouched
    return [fd for fd in ours if _is_socket(fd)], in_child, t.item()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="descriptors are listed from /proc (Linux)")
def test_forked_children_drop_the_groups_connections_and_the_parent_keeps_them() -> None:
    for in_parent, in_child, total in run_ranks(_fork_and_look, 2):
        assert in_parent, "the process group opened no socket that ember recorded"
        assert in_child == []
        assert total == 3.0
