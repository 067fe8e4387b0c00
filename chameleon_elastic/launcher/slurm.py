"""``chameleon-run`` under Slurm: the lines every torchrun sbatch script writes by hand, taken
from the allocation instead.

Inside a job step (``srun chameleon-run ...``, one task per node), Slurm tells each task the
job's id, its node count, its node's index and the job's node list. ``--slurm on`` (or
``auto``, the default, inside a step) fills in what the command line left at torchrun's
defaults, and says so in one line:

==================  =============================================  =========================
flag                from                                           when not given
==================  =============================================  =========================
``--nnodes``        ``SLURM_JOB_NUM_NODES`` (``SLURM_NNODES``)      ``1:1``
``--rdzv-id``       ``slurm-<SLURM_JOB_ID>``, ``-r<N>`` added on    ``none``
                    the N-th requeue (``SLURM_RESTART_COUNT``), so
                    a requeued job never meets its predecessor's
                    closed rendezvous
``--rdzv-backend``  ``c10d`` for more than one node                ``static``
``--rdzv-endpoint`` c10d: the first host of ``SLURM_JOB_NODELIST``  empty
                    (port 29400); etcd-v3: must be given (a
                    usage error otherwise)
``--node-rank``     ``SLURM_NODEID`` (the static backend only)      ``0``
==================  =============================================  =========================

Everything here is pure: the environment in, the values out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["SlurmAllocation", "SlurmError", "expand_hostlist", "from_allocation"]

C10D_PORT = 29400
_DEFAULTS = {"nnodes": "1:1", "rdzv_id": "none", "rdzv_backend": "static",
             "rdzv_endpoint": "", "node_rank": 0}


class SlurmError(ValueError):
    """The allocation cannot give what the launch needs (one sentence)."""


@dataclass(frozen=True)
class SlurmAllocation:
    job_id: str
    nnodes: int
    node_rank: int
    hosts: tuple[str, ...]
    in_step: bool          # inside an ``srun`` step (one task per node is what we expect)
    restarts: int = 0      # times the job was requeued

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlurmAllocation | None:
        """The allocation this process runs in, or None outside Slurm."""
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job:
            return None
        nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
        hosts = tuple(expand_hostlist(env.get("SLURM_JOB_NODELIST")
                                      or env.get("SLURM_NODELIST") or ""))
        return cls(job, int(nodes), int(env.get("SLURM_NODEID", "0")), hosts,
                   in_step="SLURM_STEP_ID" in env or "SLURM_STEPID" in env,
                   restarts=int(env.get("SLURM_RESTART_COUNT") or 0))


def from_allocation(alloc: SlurmAllocation, given: Mapping[str, object],
                    standalone: bool) -> dict[str, object]:
    """The flag values (argparse ``dest`` -> value) to take from ``alloc``: only those whose
    ``given`` value is still torchrun's default."""
    if standalone:
        return {}
    taken: dict[str, object] = {}

    def default(dest: str) -> bool:
        return given.get(dest) == _DEFAULTS[dest]

    if default("nnodes"):
        taken["nnodes"] = str(alloc.nnodes)
    if default("rdzv_id"):
        taken["rdzv_id"] = f"slurm-{alloc.job_id}" + (
            f"-r{alloc.restarts}" if alloc.restarts else "")
    backend = str(given.get("rdzv_backend"))
    if default("rdzv_backend") and alloc.nnodes > 1:
        backend = taken["rdzv_backend"] = "c10d"
    if default("rdzv_endpoint"):
        if backend == "etcd-v3":
            raise SlurmError("under Slurm the etcd-v3 rendezvous needs the etcd cluster's "
                             "address: pass --rdzv-endpoint host:2379 (or set "
                             "PET_RDZV_ENDPOINT), as examples/slurm/train.sbatch does")
        if backend != "static":
            if not alloc.hosts:
                raise SlurmError("SLURM_JOB_NODELIST is empty, so the rendezvous endpoint "
                                 "cannot be its first host; pass --rdzv-endpoint")
            taken["rdzv_endpoint"] = f"{alloc.hosts[0]}:{C10D_PORT}"
    if backend == "static" and default("node_rank"):
        taken["node_rank"] = alloc.node_rank
    return taken


_GROUP = re.compile(r"\[([^\]]*)\]")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (``node[01-03,07],gpu5``) as host names, in order (what
    ``scontrol show hostnames`` prints)."""
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(item: str) -> list[str]:
    match = _GROUP.search(item)
    if match is None:
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    names = []
    for piece in match.group(1).split(","):
        low, _, high = piece.partition("-")
        if not high:
            names.append(low)
            continue
        width = len(low)
        names.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return [head + name + rest for name in names for rest in _expand_one(tail)]
