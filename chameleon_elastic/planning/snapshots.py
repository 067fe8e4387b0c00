"""In-memory snapshots, the planner's side: where they go, what they hold, what they cost.

Every K committed steps each working device copies the state of its layers (weights and
optimizer state) into its own host memory and sends a second copy to one **partner**: a working
device on another node that holds none of its layers (on a single node, another device's
process). A layer's state then outlives every device that holds it as long as one partner of a
holder lives, and a loss that takes every replica of some layers costs the steps since the
last snapshot instead of a disk read (or the job). The runtime takes the copies
(``runtime/state/snapshots.py``); this module decides, as pure functions of the job and the plan:

- :func:`partners`: who keeps whose copy. Devices are walked node-interleaved (local index
  first, then node: ``0, 2, 1, 3`` on 2 nodes of 2), and each sends to the next one in that
  order on another node that holds none of its layers (any node when no other node can), so
  on a layout without shared layers every device keeps exactly one partner's copy;
- :func:`host_bytes`: what that places in each node's host memory, two snapshots deep (the
  newest one is complete everywhere only once the next step's vote has passed, so the one
  before is kept until the next begins), checked against ``cluster.host_memory_bytes``;
- :func:`default_every`: K from the job's figures, the least interval at which a snapshot's
  copy and send, counted as if none of it overlapped the step, cost at most ``BUDGET`` (2%) of
  the step time;
- :func:`from_snapshots`: a re-plan that would load layers from the checkpoint takes them from a
  live partner's snapshot instead, and is priced with the steps it trains again (on average
  half an interval).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import replace

from chameleon_elastic.plan import ExecutionPlan, Transfer
from chameleon_elastic.spec import JobSpec

__all__ = ["BUDGET", "HOST_COPY_BYTES_PER_S", "SLOTS", "default_every", "device_bytes",
           "every", "from_snapshots", "host_bytes", "host_memory_problem", "partners",
           "redone_s", "snapshot_s", "why_none"]

#: the share of the fault-free step time snapshots may take at their default interval
BUDGET = 0.02
#: bytes per second of a copy into host memory (a device-to-host copy over PCIe 4.0 x16 is
#: ~25 GB/s; a CPU's memcpy under load 2-10 GB/s): the conservative end
HOST_COPY_BYTES_PER_S = 2e9
#: snapshots a device keeps at once at most: the newest and the one before it
SLOTS = 2


def every(spec: JobSpec) -> int:
    """The job's snapshot interval as resolved (0: off). ``None`` in the spec (the default,
    not yet resolved by a CLI) counts as off here; so do a relaunch, whose new processes
    have none of the old ones' memory, and tensor parallelism (not yet supported)."""
    k = spec.recovery.snapshot_every
    return 0 if k is None or why_none(spec) else k


def why_none(spec: JobSpec) -> str | None:
    """Why the job can take no snapshots whatever its interval (None: it can)."""
    if spec.cluster.recovery == "relaunch":
        return "cluster.recovery = relaunch restarts every process, and their memory with them"
    if spec.training.tp > 1:
        return "not yet under tensor parallelism"
    return None


def _stage_layers(plan: ExecutionPlan) -> dict[int, tuple[int, int]]:
    dead = set(plan.failed_devices)
    return {d: rng for p in plan.pipelines for d, rng in zip(p.devices, p.layers)
            if d not in dead}


def partners(plan: ExecutionPlan, devices_per_node: int | None) -> dict[int, int]:
    """Working device -> the working device that keeps its snapshot (none where every other
    device holds some of its layers, as under pure data parallelism: a replica is there).
    ``devices_per_node``: the plan's devices per node (None: one node)."""
    ranges = _stage_layers(plan)
    per_node = devices_per_node or max(ranges, default=0) + 1
    order = sorted(ranges, key=lambda d: (d % per_node, d // per_node))
    n = len(order)
    disjoint = {a: any(b[1] <= a[0] or a[1] <= b[0] for b in set(ranges.values()))
                for a in set(ranges.values())}
    out: dict[int, int] = {}
    for i, d in enumerate(order):
        mine = ranges[d]
        if not disjoint[mine]:
            continue
        fallback = None
        for step in range(1, n):
            c = order[(i + step) % n]
            theirs = ranges[c]
            if not (theirs[1] <= mine[0] or mine[1] <= theirs[0]):
                continue
            if c // per_node != d // per_node:
                out[d] = c
                break
            if fallback is None:
                fallback = c
        else:
            if fallback is not None:
                out[d] = fallback
    return out


def _per_node(spec: JobSpec) -> int | None:
    return spec.cluster.devices_per_node


def device_bytes(spec: JobSpec, plan: ExecutionPlan) -> dict[int, float]:
    """Working device -> bytes of one snapshot of its layers (weights and optimizer state)."""
    size = spec.model.transfer_bytes
    return {d: math.fsum(size(x) for x in range(*rng))
            for d, rng in _stage_layers(plan).items()}


def host_bytes(spec: JobSpec, plan: ExecutionPlan) -> dict[int, float]:
    """Node -> host memory its devices' snapshots take at most (their own and their
    partners', ``SLOTS`` deep); empty when the job takes none."""
    if not every(spec):
        return {}
    own = device_bytes(spec, plan)
    held = dict(own)
    for d, p in partners(plan, _per_node(spec)).items():
        held[p] += own[d]
    out: dict[int, float] = {}
    for d, nbytes in held.items():
        node = spec.cluster.node_of(d)
        out[node] = out.get(node, 0.0) + SLOTS * nbytes
    return out


def host_memory_problem(spec: JobSpec, plan: ExecutionPlan) -> str | None:
    """Why ``plan``'s snapshots do not fit a node's host memory (None when they do, or
    when ``cluster.host_memory_bytes`` is not given)."""
    limit = spec.cluster.host_memory_bytes
    if limit is None:
        return None
    for node, nbytes in sorted(host_bytes(spec, plan).items()):
        if nbytes > limit:
            return (f"node {node} would keep {nbytes / 1e9:.2f} GB of snapshots in host memory "
                    f"but cluster.host_memory_bytes is {limit / 1e9:.2f} GB")
    return None


def snapshot_s(spec: JobSpec, plan: ExecutionPlan) -> float:
    """Seconds one snapshot takes on the busiest device: its copy into host memory and its
    send to the partner, one after the other."""
    busiest = max(device_bytes(spec, plan).values(), default=0.0)
    return busiest / HOST_COPY_BYTES_PER_S + busiest / spec.cluster.bandwidth_bytes_per_s


def default_every(spec: JobSpec, plan: ExecutionPlan) -> int:
    """The least K for which a snapshot every K steps costs at most ``BUDGET`` of the step
    time of ``plan`` (estimated), as if the snapshot did not overlap the step at all."""
    step = plan.estimate.step_time_s if plan.estimate is not None else 0.0
    cost = snapshot_s(spec, plan)
    if step <= 0:
        return 1
    return max(1, math.ceil(cost / (BUDGET * step) - 1e-9))


def redone_s(spec: JobSpec, step_s: float) -> float:
    """Expected training time lost to a restore from a snapshot: the steps since the last
    one, on average half an interval, trained again at ``step_s`` each."""
    return every(spec) / 2.0 * step_s


def from_snapshots(spec: JobSpec, current: ExecutionPlan, failed: Collection[int],
                   plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` with its checkpoint transfers taken from snapshots where a live partner of a
    lost holder keeps one (``Transfer.snapshot``); unchanged when none does or the job takes
    no snapshots. ``failed``: the devices this event lost. The estimate of a changed plan is
    made again by the caller."""
    if not every(spec) or not plan.checkpoint_layers:
        return plan
    keeper = _keepers(spec, current, set(failed), set(plan.live_devices))
    if not keeper:
        return plan
    size = spec.model.transfer_bytes
    transfers: list[Transfer] = []
    for t in plan.transfers:
        if not t.from_checkpoint:
            transfers.append(t)
            continue
        rest = [x for x in t.layers if x not in keeper]
        if rest:
            transfers.append(Transfer(t.src, t.dst, tuple(rest), math.fsum(map(size, rest))))
        by_src: dict[int, list[int]] = {}
        for x in t.layers:
            if x in keeper:
                by_src.setdefault(keeper[x], []).append(x)
        for src, layers in sorted(by_src.items()):
            moved = 0.0 if src == t.dst else math.fsum(map(size, layers))
            transfers.append(Transfer(src, t.dst, tuple(layers), moved, snapshot=True))
    return replace(plan, transfers=tuple(transfers), estimate=None)


def _keepers(spec: JobSpec, current: ExecutionPlan, failed: set[int],
             live: set[int]) -> dict[int, int]:
    """Layer -> the live device keeping a snapshot of it, for the layers of ``current``'s
    devices lost in ``failed`` (the lowest lost holder's partner first)."""
    ranges = _stage_layers(current)
    keeper: dict[int, int] = {}
    for d, p in sorted(partners(current, _per_node(spec)).items()):
        if d in failed and p in live:
            for x in range(*ranges[d]):
                keeper.setdefault(x, p)
    return keeper
