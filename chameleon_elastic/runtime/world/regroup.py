"""Forming a generation's gloo world without the full mesh (not wired in yet: see below).

gloo's ``init_process_group`` builds a full mesh: every rank writes its pair addresses to the
store, reads every other rank's (N^2 store reads on the generation's one store server) and opens
a connection to every peer (N(N-1)/2 connections). At 1024 ranks that is about a million store
reads and half a million connections, per regroup (benchmarks/regroup_scale.py). A rank of a
pipeline x data-parallel plan talks to a handful of peers: its pipeline neighbours and the
ring of the world's all-gather on the world group, its data-parallel peers on the bucket groups
(small, eager).

:func:`lazy_pairs` forms gloo groups with ``TORCH_GLOO_LAZY_INIT`` (torch >= 2.7, so it works
on 2.13): a rank writes its address and connects a pair the first time it talks to that peer
(two store reads per pair). :func:`connect_peers` then opens the pairs a rank will use, so that
they exist while the caller records the generation's sockets (``abort.new_sockets``): the
watchdog shuts those down to unblock a survivor waiting on a frozen peer, and a pair first
connected later, outside that record, could not be unblocked.

Wiring it into ``join.join_generation`` (the lead's module) is three lines, and one decision:
which peers. The pipeline neighbours and the all-gather ring are known from the plan; a
transfer's or a reroute's peer connects on first use unless named too, and is then not armed
in the watchdog: a transfer blocked on a frozen peer waits for the collective timeout instead.

    with regroup.lazy_pairs(backend), new_sockets() as sockets:
        dist.init_process_group(backend, store=..., rank=rank, world_size=size, timeout=...)
        regroup.connect_peers(peers)
    GroupSockets[dist.group.WORLD] = frozenset(sockets)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

__all__ = ["LAZY_ENV", "connect_peers", "lazy_pairs", "ring_peers"]

LAZY_ENV = "TORCH_GLOO_LAZY_INIT"
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
