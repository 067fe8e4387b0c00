"""Gradient synchronisation by the plan's colour rounds (or, as a baseline, layer by layer).

After an asymmetric re-plan, layer ``l`` lives on devices at different stages of different
pipelines, so one world-wide all-reduce cannot serve it. The planner groups layers with the
same holder set into a bucket (:class:`~chameleon_elastic.plan.AllReduceGroup`) and colours the
buckets so that no device is in two buckets of one round. Each device walks the rounds in
order: for the bucket it is in, it flattens the gradients of the bucket's layers into one
buffer, starts an asynchronous SUM all-reduce on that bucket's process group, and waits for it
at the end of the round. Buckets of one round run concurrently on disjoint devices.

Why this cannot deadlock: every rank issues its buckets in round order, so the pending bucket
with the lowest round is, for each of its members, the next one it waits on.

Weighting happens in the loss (each micro-batch's loss is divided by the global micro-batch
count), so a SUM over the holders yields the mean over the global batch whatever the quotas.
The serial baseline (``mode="serial"``) issues one blocking all-reduce per layer in layer order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from chameleon_elastic.plan import AllReduceGroup

from .errors import PeerLost
from .groups import GroupTable
from .topology import RankMap

__all__ = ["SyncMode", "bucket_rank_sets", "layer_holder_rank_sets", "sync_gradients"]

SyncMode = Literal["rounds", "serial"]


def bucket_rank_sets(rounds: Sequence[Sequence[AllReduceGroup]],
                     ranks: RankMap) -> list[tuple[int, ...]]:
    return [ranks.ranks(g.devices) for rnd in rounds for g in rnd]


def layer_holder_rank_sets(holders: Mapping[int, Sequence[int]],
                           ranks: RankMap) -> list[tuple[int, ...]]:
    return [ranks.ranks(tuple(devs)) for devs in holders.values()]


def _grads(layers: Mapping[int, nn.Module], layer_ids: Sequence[int]) -> list[torch.Tensor]:
    out = []
    for i in layer_ids:
        for p in layers[i].parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
    return out


def _start(grads: list[torch.Tensor], group) -> tuple[object, torch.Tensor, list[torch.Tensor]]:
    flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
    try:
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    except RuntimeError as exc:
        raise PeerLost(f"a gradient all-reduce could not start: {exc}") from exc
    return work, flat, grads


def _finish(work, flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        raise PeerLost(f"a gradient all-reduce broke: {exc}") from exc
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def sync_gradients(layers: Mapping[int, nn.Module], device: int, ranks: RankMap,
                   groups: GroupTable, rounds: Sequence[Sequence[AllReduceGroup]] = (),
                   holders: Mapping[int, Sequence[int]] | None = None,
                   mode: SyncMode = "rounds") -> int:
    """Sum each held layer's gradients over its holders; returns the all-reduces issued here.

    ``layers`` maps global layer index -> module for the layers this device holds. ``rounds``
    are the plan's colour rounds (mode ``rounds``); ``holders`` maps layer -> holder devices
    (mode ``serial``).
    """
    issued = 0
    if mode == "rounds":
        for rnd in rounds:
            pending = []
            for bucket in rnd:
                if device not in bucket.devices or len(bucket.devices) < 2:
                    continue
                grads = _grads(layers, bucket.layers)
                if grads:
                    group = groups.get(ranks.ranks(bucket.devices))
                    pending.append(_start(grads, group))
                    issued += 1
            for item in pending:
                _finish(*item)
        return issued
    if mode == "serial":
        if holders is None:
            raise ValueError("serial gradient sync needs the holders of every layer")
        for layer in sorted(layers):
            devs = holders[layer]
            if len(devs) < 2:
                continue
            grads = _grads(layers, [layer])
            if grads:
                _finish(*_start(grads, groups.get(ranks.ranks(tuple(devs)))))
                issued += 1
        return issued
    raise ValueError(f"unknown gradient sync mode {mode!r}; expected 'rounds' or 'serial'")
