"""Forming a generation's gloo world without the full mesh, once the world is large enough.

gloo's ``init_process_group`` builds a full mesh: every rank writes its pair addresses to the
store, reads every other rank's (N^2 store reads on the generation's one store server) and opens
a connection to every peer (N(N-1)/2 connections). At 1024 ranks that is about a million store
reads and half a million connections, per regroup (benchmarks/regroup_scale.py). A rank of a
pipeline x data-parallel plan talks to a handful of peers on the world group: its pipeline
neighbours and the ring of gloo's all-gather and all-reduce (the agree step, the loss vote);
its data-parallel peers are on the bucket groups (small, eager).

:func:`lazy_pairs` forms gloo groups with ``TORCH_GLOO_LAZY_INIT`` (torch >= 2.7, so it works
on 2.13): a rank writes its address and connects a pair the first time it talks to that peer
(two store reads per pair). :func:`connect_peers` then opens the pairs a rank will use
(:func:`join_peers`: the ring and the plan's pipeline neighbours), so that they exist while
join.py records the generation's sockets (``abort.new_sockets``): the watchdog shuts those
down to unblock a survivor waiting on a frozen peer, and a pair first connected later, outside
that record, could not be unblocked. What still connects on first use: a transfer's peer while
a plan is entered (covered then: the watchdog cuts every socket opened since the recovery
began, deadlines.py), and the pairs of a synchronous checkpoint (torch's checkpoint gathers to
rank 0, gloo's barrier talks to ranks 2^k away), which a frozen peer then holds up to the
collective timeout.

Where it is used (:func:`lazy_wins`): from :data:`LAZY_FROM` ranks, where the full mesh costs
half a second and grows as N^2 (docs/runtime.md, *The regroup at scale*, has the measurements).
A smaller world keeps the full mesh, whose every pair is recorded for the watchdog: lazy pairs
won there by tens of milliseconds only, and forced onto four workers they made a second loss
during the regroup leave a survivor stuck (2 of 9 runs of a double-kill test, against 0 of 7).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from chameleon_elastic.channel import Generation
from chameleon_elastic.plan import ExecutionPlan

__all__ = ["LAZY_ENV", "LAZY_FROM", "LAZY_FROM_ENV", "connect_peers", "join_peers", "lazy_pairs", "lazy_wins",
           "pipeline_peers", "ring_peers"]

LAZY_ENV = "TORCH_GLOO_LAZY_INIT"
#: the smallest world formed with lazy pairs (measured: docs/runtime.md, *The regroup at scale*)
LAZY_FROM = 64
#: overrides :data:`LAZY_FROM` (ranks): 2 runs a small job's regroups as a large one's would
LAZY_FROM_ENV = "CHAMELEON_LAZY_PAIRS_FROM"
_TAG = 0x7E5   # the connecting exchange's tag: apart from the runtime's own


@contextlib.contextmanager
def lazy_pairs(backend: str) -> Iterator[None]:
    """gloo groups formed inside connect each pair on first use; other backends, or a user
    who set ``TORCH_GLOO_LAZY_INIT`` themselves, are left as they are. torch reads the variable
    when each group is created, so groups formed after the block are full meshes again (the
    data-parallel bucket groups: small)."""
    if backend != "gloo" or LAZY_ENV in os.environ:
        yield
        return
    os.environ[LAZY_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(LAZY_ENV, None)


def lazy_wins(backend: str, world_size: int) -> bool:
    """Whether a world of ``world_size`` ranks on ``backend`` is formed with lazy pairs: gloo
    only (NCCL has its own bootstrap), from :data:`LAZY_FROM` ranks (``LAZY_FROM_ENV`` when
    set: so the in-place tests of a few workers can take the large world's path)."""
    least = os.environ.get(LAZY_FROM_ENV)
    return backend == "gloo" and world_size >= (LAZY_FROM if not least else int(least))


def ring_peers(rank: int, world_size: int) -> set[int]:
    """The peers of gloo's ring collectives (the all-gather the runtime agrees with)."""
    return {(rank + 1) % world_size, (rank - 1) % world_size} - {rank}


def connect_peers(peers: Iterable[int], group: object | None = None) -> None:
    """Open the pairs to ``peers`` now: one element each way with each of them. Every rank
    must name the peers that name it (a pair connects from both ends): the plan's neighbours
    and :func:`ring_peers` are symmetric."""
    rank = dist.get_rank(group)
    mine = torch.zeros(1)
    works = []
    for peer in sorted(set(peers) - {rank}):
        works.append(dist.isend(mine, peer, group=group, tag=_TAG))
        works.append(dist.irecv(torch.zeros(1), peer, group=group, tag=_TAG))
    for work in works:
        work.wait()


def pipeline_peers(plan: ExecutionPlan, device: int) -> set[int]:
    """The devices ``device`` sends activations to or receives gradients from on the world
    group: for every micro-batch of each pipeline it serves a stage of, the devices serving
    the neighbouring stages (a rerouted stage's micro-batch is served by the reroute's peer,
    ``plan.server``). Every device computes the same edges, so the relation is symmetric.
    Only the pipelines ``device`` is in or serves a reroute of are walked: at 16k devices
    walking them all would cost each rank a fraction of a second."""
    mine = {p for p, pipe in enumerate(plan.pipelines) if device in pipe.devices}
    mine |= {r.pipeline for r in plan.reroute if any(s.device == device for s in r.peers)}
    peers: set[int] = set()
    for p in sorted(mine):
        pipe = plan.pipelines[p]
        for m in range(pipe.micro_batches):
            servers = [plan.server(p, s, m) for s in range(pipe.num_stages)]
            for a, b in itertools.pairwise(servers):
                if device in (a, b) and a != b:
                    peers.add(b if a == device else a)
    return peers


def join_peers(plan: ExecutionPlan, gen: Generation, device: int, tp_rank: int = 0) -> set[int]:
    """The world ranks this card connects to as it joins ``gen``: its ring neighbours and the
    same tensor-parallel card of each pipeline neighbour (the executor's transfers), minus any
    device outside the generation's world."""
    rank = gen.rank(device, tp_rank)
    peers = ring_peers(rank, gen.world_size)
    peers |= {gen.rank(d, tp_rank) for d in pipeline_peers(plan, device) if d in gen.world}
    return peers - {rank}
