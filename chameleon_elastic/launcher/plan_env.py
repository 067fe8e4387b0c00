"""From an execution plan to what each worker process is told: ranks and ``CHAMELEON_*``.

Device ids are fixed by the initial world: ``device = node * nproc_per_node + local_rank``. A plan
names the devices that work; only they get a worker. ``RANK`` / ``WORLD_SIZE`` are renumbered
densely over the working devices in device order, so every agent computes the same numbering from
the same plan without talking to the others, and an unmodified script sees an ordinary world.

Everything here is a pure function of its arguments (tested without processes).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from chameleon_elastic.channel import CHAMELEON_VARS, chameleon_env
from chameleon_elastic.plan import DeviceRole, ExecutionPlan

__all__ = [
    "CHAMELEON_VARS",
    "LocalAssignment",
    "chameleon_env",
    "device_id",
    "local_assignments",
    "write_plan_file",
]


@dataclass(frozen=True)
class LocalAssignment:
    """One worker this node starts: its device slot and its dense global rank."""

    local_rank: int
    device: int
    global_rank: int
    world_size: int
    role: DeviceRole


def device_id(node: int, local_rank: int, nproc_per_node: int) -> int:
    return node * nproc_per_node + local_rank


def local_assignments(plan: ExecutionPlan, node: int, nproc_per_node: int,
                      world: tuple[int, ...] | None = None) -> tuple[LocalAssignment, ...]:
    """Working devices of ``node`` under ``plan``, in local-rank order (spare / dead slots
    skipped), ranked by their place in ``world`` (default: the working devices, sorted; an
    in-place generation appends the spares that keep a live worker)."""
    roles = {r.device: r for r in plan.roles()}
    world = tuple(sorted(roles)) if world is None else world
    rank_of = {d: i for i, d in enumerate(world)}
    out = []
    for local_rank in range(nproc_per_node):
        d = device_id(node, local_rank, nproc_per_node)
        if d in roles:
            out.append(LocalAssignment(local_rank, d, rank_of[d], len(world), roles[d]))
    return tuple(out)


def write_plan_file(plan: ExecutionPlan, directory: str | Path) -> str:
    """Write ``plan-gen<N>.json`` atomically (temp file + rename); returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"plan-gen{plan.generation}.json"
    fd, tmp = tempfile.mkstemp(prefix=".plan-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(plan.to_json())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return str(target)
