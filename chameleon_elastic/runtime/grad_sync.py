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

Tied weights (:class:`~.model.Tie`) stay out of the buckets. After the rounds, each tie's copies
are summed over every device that holds any of them, straight from the micro-batch sums each
device accumulated: every micro-batch's use of the weight happened on exactly one device, so
this SUM is the whole gradient of the one shared weight, counted once, and every copy receives
it (copies stay equal). Ties go in model order after all rounds on every rank, so they cannot
deadlock either.

:func:`square_share` is this device's part of the job-wide squared gradient norm (for
clipping): each layer's gradients are counted by one holder only (the lowest device), each tie
once, by the lowest device holding a copy; the trainer sums the shares in its vote.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from chameleon_elastic.plan import AllReduceGroup

from .errors import PeerLost
from .groups import GroupTable
from .model import PipelineModel, tied_parameter
from .tensor_parallel import aligned, local, replicated
from .topology import RankMap

__all__ = ["SyncMode", "TiedCopies", "bucket_rank_sets", "layer_holder_rank_sets",
           "square_share", "sync_gradients", "tied_copies"]

SyncMode = Literal["rounds", "serial"]


@dataclass(frozen=True)
class TiedCopies:
    """One tie under a plan: its ``(layer, name)`` members and every live device holding any."""

    members: tuple[tuple[int, str], ...]
    devices: tuple[int, ...]


def _tied_names(ties: Sequence[TiedCopies]) -> dict[int, frozenset[str]]:
    """Layer -> names of its parameters that are tied copies (kept out of the buckets and of
    the layer's own norm share)."""
    out: dict[int, frozenset[str]] = {}
    for t in ties:
        for layer, name in t.members:
            out[layer] = out.get(layer, frozenset()) | {name}
    return out


def tied_copies(model: PipelineModel,
                holders: Mapping[int, Sequence[int]]) -> tuple[TiedCopies, ...]:
    return tuple(
        TiedCopies(tie.members, tuple(sorted({d for x in tie.layers for d in holders.get(x, ())})))
        for tie in model.tied)


def bucket_rank_sets(rounds: Sequence[Sequence[AllReduceGroup]],
                     ranks: RankMap) -> list[tuple[int, ...]]:
    """Every bucket's group, once per tensor-parallel rank (every rank creates every group)."""
    return [rs for rnd in rounds for g in rnd for rs in ranks.every_tp_rank(g.devices)]


def layer_holder_rank_sets(holders: Mapping[int, Sequence[int]],
                           ranks: RankMap) -> list[tuple[int, ...]]:
    return [rs for devs in holders.values() for rs in ranks.every_tp_rank(tuple(devs))]


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient, laid out as ``p`` is (torch's embedding backward returns a replicated
    gradient for a row-sharded table: this card keeps its rows, no communication)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    else:
        p.grad = aligned(p.grad, p)
    return p.grad


def _grads(layers: Mapping[int, nn.Module], layer_ids: Sequence[int],
           tied: Mapping[int, frozenset[str]]) -> list[torch.Tensor]:
    """The untied gradients of ``layer_ids`` (this card's shards), in a fixed order every
    holder shares."""
    return [local(_grad(p)) for i in layer_ids for name, p in layers[i].named_parameters()
            if name not in tied.get(i, ())]


def _squares(p: torch.Tensor) -> torch.Tensor:
    """Sum of squares of this card's part of ``p``'s gradient, in float64, without a float64
    copy of the gradient (this runs over every parameter at every step)."""
    return torch.linalg.vector_norm(local(_grad(p)), dtype=torch.float64).square()


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
                   mode: SyncMode = "rounds", ties: Sequence[TiedCopies] = (),
                   tp_rank: int = 0) -> int:
    """Sum each held layer's gradients over its holders, then each tie's over its copies'
    holders; returns the all-reduces issued here.

    ``layers`` maps global layer index -> module for the layers this device holds. ``rounds``
    are the plan's colour rounds (mode ``rounds``); ``holders`` maps layer -> holder devices
    (mode ``serial``); ``ties``: :func:`tied_copies` under the plan. Under tensor
    parallelism this card sums with the cards of rank ``tp_rank`` of the other holders.
    """
    tied = _tied_names(ties)
    issued = 0
    if mode == "rounds":
        for rnd in rounds:
            pending = []
            for bucket in rnd:
                if device not in bucket.devices or len(bucket.devices) < 2:
                    continue
                grads = _grads(layers, bucket.layers, tied)
                if grads:
                    group = groups.get(ranks.ranks(bucket.devices, tp_rank))
                    pending.append(_start(grads, group))
                    issued += 1
            for item in pending:
                _finish(*item)
    elif mode == "serial":
        if holders is None:
            raise ValueError("serial gradient sync needs the holders of every layer")
        for layer in sorted(layers):
            devs = holders[layer]
            if len(devs) < 2:
                continue
            grads = _grads(layers, [layer], tied)
            if grads:
                _finish(*_start(grads, groups.get(ranks.ranks(tuple(devs), tp_rank))))
                issued += 1
    else:
        raise ValueError(f"unknown gradient sync mode {mode!r}; expected 'rounds' or 'serial'")
    for t in ties:
        if device not in t.devices:
            continue
        copies = [local(_grad(tied_parameter(layers[x], x, name))) for x, name in t.members
                  if x in layers]
        total = copies[0].clone()
        for g in copies[1:]:
            total += g
        if len(t.devices) > 1:
            _finish(*_start([total], groups.get(ranks.ranks(t.devices, tp_rank))))
            issued += 1
        for g in copies:
            g.copy_(total)
    return issued


def square_share(layers: Mapping[int, nn.Module], device: int,
                 holders: Mapping[int, Sequence[int]], ties: Sequence[TiedCopies] = (),
                 tp_rank: int = 0) -> float:
    """This card's part of the squared job-wide gradient norm (float64; inf or nan when a
    gradient is not finite): each layer by its lowest holder, each tie by its lowest device;
    inside a unit each card counts its shards, card 0 alone the replicated parameters."""

    def counts(p: torch.Tensor) -> bool:
        return tp_rank == 0 or not replicated(p)

    tied = _tied_names(ties)
    total = torch.zeros((), dtype=torch.float64)
    for t in ties:
        if t.devices and t.devices[0] == device:
            x, name = next((x, n) for x, n in t.members if x in layers)
            param = tied_parameter(layers[x], x, name)
            if counts(param):
                total += _squares(param)
    for layer, module in layers.items():
        if min(holders[layer]) != device:
            continue
        for name, p in module.named_parameters():
            if name not in tied.get(layer, ()) and counts(p):
                total += _squares(p)
    return float(total)
