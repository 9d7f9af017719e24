"""Where this process sits in a ddp job: read from the environment that torchrun, SLURM or ember's own
launcher (``launcher.py``) started it with; a plain ``python script.py`` sits in none."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["World", "detect_world", "first_host", "PARENT_ENV"]

PARENT_ENV = "EMBER_DDP_PARENT_PID"  # set in processes ember starts: they die with that parent


@dataclass(frozen=True)
class World:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "ember"


def detect_world(env: dict[str, str] | None = None) -> World | None:
    """The world this process was started into, or None for a plain ``python script.py``."""
    env = dict(os.environ if env is None else env)
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
        return World(
            rank,
            world,
            local,
            int(env.get("LOCAL_WORLD_SIZE", world)),
            int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            "ember" if PARENT_ENV in env else "torchrun",
        )
    ntasks = int(env.get("SLURM_NTASKS", "1") or 1)
    if "SLURM_PROCID" in env and ntasks > 1 and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        per_node = re.match(r"\d+", env.get("SLURM_NTASKS_PER_NODE", "") or "")
        job = int(re.sub(r"\D", "", env.get("SLURM_JOB_ID", "0")) or 0)
        return World(
            int(env["SLURM_PROCID"]),
            ntasks,
            int(env.get("SLURM_LOCALID", 0)),
            int(per_node.group()) if per_node else ntasks,
            int(env.get("SLURM_NODEID", 0)),
            env.get("MASTER_ADDR") or first_host(env.get("SLURM_NODELIST", "127.0.0.1")),
            int(env.get("MASTER_PORT") or 15000 + job % 20000),
            "slurm",
        )
    return None


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``"gpu[03-05,9],cpu1"`` (-> ``"gpu03"``)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return "127.0.0.1"
    prefix, ranges = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix
