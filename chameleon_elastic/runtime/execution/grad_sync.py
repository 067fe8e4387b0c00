"""Gradient synchronisation by the plan's colour rounds (or, as a baseline, layer by layer).

After an asymmetric re-plan, layer ``l`` lives on devices at different stages of different
pipelines, so one world-wide all-reduce cannot serve it. The planner groups layers with the
same holder set into a bucket (:class:`~chameleon_elastic.plan.AllReduceGroup`) and colours the
buckets so that no device is in two buckets of one round. Each device issues its buckets in
round order, each cut into chunks (:func:`sum_order`); a chunk's gradients are flattened into
one buffer and summed by an asynchronous SUM all-reduce on the bucket's process group. The
chunks start during the device's last backward of the step, each as soon as its gradients are
final and the chunks before it have started (:class:`GradientSums`, DDP's overlap), and are
awaited after the backward. Buckets of one round run concurrently on disjoint devices.

Why this cannot deadlock: every holder of a bucket issues its chunks in one order, and every
wait comes after every start, so no rank waits on a sum a peer has not been able to start.

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
clipping): each layer's gradients are counted by one holder only (:func:`norm_holder`), each
tie once, by the lowest device holding a copy; the trainer sums the shares in its vote.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from chameleon_elastic.plan import AllReduceGroup

from ..errors import PeerLost
from ..model import PipelineModel, tied_parameter
from ..tensor_parallel import aligned, local, replicated
from ..topology import RankMap
from ..world.groups import GroupTable

__all__ = ["CHUNK_BYTES", "FIRST_CHUNK_BYTES", "OVERLAP_MIN_BYTES", "Bound", "Chunk",
           "GradientSums", "SyncMode", "TiedCopies", "bind_flat", "bucket_rank_sets",
           "group_by_kind", "layer_holder_rank_sets", "norm_holder", "overlap_pays",
           "plan_sums", "square_share", "sum_order", "sync_gradients", "tied_copies"]

SyncMode = Literal["rounds", "serial"]

#: largest all-reduce a bucket is cut into (DDP's default bucket size)
CHUNK_BYTES = 25 * 2**20
#: largest first chunk of a bucket (DDP's first bucket): small, so that a sum starts while
#: most of the backward is still to run
FIRST_CHUNK_BYTES = 2**20
#: fewest gradient bytes per parameter for which starting the sums during the backward pays:
#: each parameter's hook costs 10-20 us of Python a step (registered, then called from
#: autograd), what a sum over gloo's loopback takes for 30-60 KB; the tiny GPT (13 KB per
#: parameter) lost 2-3% of its step to them, the 8 x 256 GPT (188 KB) does not
OVERLAP_MIN_BYTES = 64 * 2**10


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


def _squares(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of the squared norms of ``grads`` (float64): each norm in the gradient's own dtype,
    as ``torch.nn.utils.clip_grad_norm_`` computes it, squared and summed in float64. Not the
    norms in float64: converting every element on the way cost 40% more than torch's clipping
    on CPU. One ``_foreach_norm`` per (device, dtype), as torch's clipping: a norm per
    parameter from Python cost 2-3x torch's clipping on the tiny GPT's ~100 small
    parameters."""
    total = torch.zeros((), dtype=torch.float64)
    for group in group_by_kind(grads):
        norms = torch._foreach_norm(group)   # widened after stacking: the same values
        total += torch.stack(norms).double().square().sum().cpu()
    return total


def group_by_kind(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` split by (device, dtype), each in its order: what one ``_foreach`` call
    takes. A ``DTensor`` goes alone (foreach refuses plain tensors and shards mixed)."""
    kinds: dict[tuple, list[torch.Tensor]] = {}
    for x in tensors:
        alone = id(x) if local(x) is not x else None
        kinds.setdefault((x.device, x.dtype, alone), []).append(x)
    return list(kinds.values())


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
    if len(grads) == 1 and flat.data_ptr() == grads[0].data_ptr():
        return  # summed in place
    parts = flat.split([g.numel() for g in grads])
    torch._foreach_copy_(grads, [x.view_as(g) for x, g in zip(parts, grads, strict=True)])


@dataclass(frozen=True)
class Chunk:
    """One all-reduce of a step: these ``(layer, parameter name)`` gradients, flattened, summed
    over the process group of ``ranks``."""

    ranks: tuple[int, ...]
    params: tuple[tuple[int, str], ...]


def sum_order(layers: Mapping[int, nn.Module], device: int, ranks: RankMap,
              rounds: Sequence[Sequence[AllReduceGroup]], ties: Sequence[TiedCopies] = (),
              tp_rank: int = 0, cap_bytes: int = CHUNK_BYTES,
              first_cap_bytes: int = FIRST_CHUNK_BYTES) -> tuple[Chunk, ...]:
    """This device's all-reduces, in the order it issues them: its buckets in colour-round
    order, each cut into chunks of at most ``cap_bytes`` (its first at most ``first_cap_bytes``;
    a parameter larger than that is a chunk of its own), walking its layers and parameters
    backwards, which is the order the backward makes them final. Every holder of a bucket
    holds the same layers, so it cuts the same chunks in the same order: collectives on a
    group are issued in one order everywhere."""
    tied = _tied_names(ties)
    out: list[Chunk] = []
    for rnd in rounds:
        for bucket in rnd:
            if device not in bucket.devices or len(bucket.devices) < 2:
                continue
            group = ranks.ranks(bucket.devices, tp_rank)
            chunk: list[tuple[int, str]] = []
            size, cap = 0, min(first_cap_bytes, cap_bytes)
            for layer in sorted(bucket.layers, reverse=True):
                for name, p in reversed(list(layers[layer].named_parameters())):
                    if name in tied.get(layer, ()):
                        continue
                    nbytes = local(p).numel() * local(p).element_size()
                    if chunk and size + nbytes > cap:
                        out.append(Chunk(group, tuple(chunk)))
                        chunk, size, cap = [], 0, cap_bytes
                    chunk.append((layer, name))
                    size += nbytes
            if chunk:
                out.append(Chunk(group, tuple(chunk)))
    return tuple(out)


def _chunk_params(layers: Mapping[int, nn.Module],
                  chunks: Sequence[Chunk]) -> dict[tuple[int, str], torch.Tensor]:
    named = {x: dict(layers[x].named_parameters()) for x in {x for c in chunks
                                                              for x, _ in c.params}}
    return {(x, n): named[x][n] for c in chunks for x, n in c.params}


def overlap_pays(params: Iterable[torch.Tensor]) -> bool:
    """Whether starting sums during the backward can win more than its hooks cost: at least
    :data:`OVERLAP_MIN_BYTES` of gradient per parameter that gets one."""
    watched = [local(p) for p in params if p.requires_grad]
    return bool(watched) and sum(
        p.numel() * p.element_size() for p in watched) >= OVERLAP_MIN_BYTES * len(watched)


def plan_sums(layers: Mapping[int, nn.Module], device: int, ranks: RankMap,
              rounds: Sequence[Sequence[AllReduceGroup]], groups: GroupTable,
              buffers: dict[Chunk, Bound] | None = None, ties: Sequence[TiedCopies] = (),
              tp_rank: int = 0) -> GradientSums:
    """This device's :class:`GradientSums` under a plan, over :func:`sum_order`. Where the
    overlap does not pay (:func:`overlap_pays`), a bucket's first chunk is as large as the
    others: a small one is there to start early, and would only add an all-reduce."""
    order = sum_order(layers, device, ranks, rounds, ties, tp_rank)
    if not overlap_pays(_chunk_params(layers, order).values()):
        order = sum_order(layers, device, ranks, rounds, ties, tp_rank,
                          first_cap_bytes=CHUNK_BYTES)
    return GradientSums(layers, order, groups, buffers)


#: a chunk's flat buffer and the views of it its gradients were bound to
Bound = tuple[torch.Tensor, tuple[torch.Tensor, ...]]


def bind_flat(params: Sequence[torch.Tensor], bound: Bound | None) -> Bound | None:
    """One flat buffer holding ``params``' gradients, each ``.grad`` a view into it (DDP's
    ``gradient_as_bucket_view``): the chunk's all-reduce then sums the gradients in place. It
    saves flattening them into a new buffer every step and copying the sums back: for the
    comm-heavy case's 100 MB of gradients that was 60 ms (mostly the new buffer's page faults)
    and 20 ms of a 0.9 s step. ``bound``: what was bound last step, kept when every gradient
    is still its view (one identity test each: comparing data pointers cost 2 ms a step on
    the tiny GPT); a gradient that is not (replaced, or not made yet) is copied in and
    rebound. None (keep flattening) for ``DTensor`` shards and chunks that mix dtypes or
    devices."""
    if bound is not None and len(bound[1]) == len(params) and all(
            p.grad is v for p, v in zip(params, bound[1], strict=True)):
        return bound
    if not params or any(local(p) is not p for p in params) or len(
            {(p.dtype, p.device) for p in params}) > 1:
        return None
    total = sum(p.numel() for p in params)
    first = params[0]
    buffer = bound[0] if bound is not None else None
    if buffer is None or buffer.numel() != total or (buffer.dtype, buffer.device) != (
            first.dtype, first.device):
        buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
    views, offset = [], 0
    for p in params:
        view = buffer[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view
        views.append(view)
    return buffer, tuple(views)


class GradientSums:
    """The all-reduces of a device's steps under one plan, over :func:`sum_order`, each
    started as soon as its gradients are final and every chunk before it has started (DDP's
    overlap, in the rounds' order).

    Built once per plan: which parameters each chunk holds and the hooks that watch them do
    not change between steps (building them every step cost 0.6-0.7 ms of the tiny GPT's ~0.19 s
    step). :meth:`restart` readies it for the next step; the constructor does the first.
    Parameters are taken from ``layers`` as they are when it is built: replacing a layer's
    parameter object needs a new one (as it needs a new optimizer).

    Inside :meth:`armed` (the device's last backward of the step: a gradient is final only
    after its last micro-batch's backward here) a hook on each parameter marks it final once
    autograd has accumulated it, and starts every chunk that is then ready, in order.
    :meth:`finish` starts whatever is left (parameters no backward reached, and everything
    when nothing was armed), waits for all, and writes the sums back. A chunk that cannot
    start inside a hook is remembered and raised by :meth:`finish`, as
    :class:`~.errors.PeerLost`, outside autograd. ``overlaps``: whether arming pays, by the
    gradient bytes per parameter (:data:`OVERLAP_MIN_BYTES`); the trainer arms only then, and
    otherwise starts every sum right after the backward.

    ``buffers`` (chunk -> its :data:`Bound`, kept by the caller from plan to plan): bind each
    chunk's gradients into one (:func:`bind_flat`) before the backward, so that it is summed
    in place; buffers of chunks no longer issued are dropped from it.
    """

    def __init__(self, layers: Mapping[int, nn.Module], chunks: Sequence[Chunk],
                 groups: GroupTable, buffers: dict[Chunk, Bound] | None = None) -> None:
        self._params = _chunk_params(layers, chunks)
        self._chunks = tuple(chunks)
        self._groups = groups
        self._index = {k: i for i, c in enumerate(self._chunks) for k in c.params}
        self._members = [[self._params[k] for k in c.params] for c in self._chunks]
        self._hooks = [(p, functools.partial(self._final, key))
                       for key, p in self._params.items()]
        #: whether hooks in the last backward (:meth:`armed`) can win more than they cost
        self.overlaps = overlap_pays(self._params.values())
        self._buffers = buffers
        if buffers is not None:
            for gone in set(buffers) - set(self._chunks):
                del buffers[gone]
        self.restart()

    def restart(self) -> None:
        """Ready for a new step: no chunk started, each chunk's gradients bound to its flat
        buffer (rebound where something replaced one; one identity test each otherwise)."""
        self._unready: list[set[tuple[int, str]]] = []   # per chunk, set by armed()
        self._flat: list[torch.Tensor | None] = [None] * len(self._chunks)
        if self._buffers is not None:
            for i, c in enumerate(self._chunks):
                bound = bind_flat(self._members[i], self._buffers.get(c))
                if bound is not None:
                    self._buffers[c], self._flat[i] = bound, bound[0]
        self._next = 0
        self._pending: list[tuple[object, torch.Tensor, list[torch.Tensor]]] = []
        self._error: PeerLost | None = None

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        # a frozen parameter never gets a gradient: it is final from the start
        self._unready = [{k for k in c.params if self._params[k].requires_grad}
                         for c in self._chunks]
        handles = [p.register_post_accumulate_grad_hook(hook) for p, hook in self._hooks
                   if p.requires_grad]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _final(self, key: tuple[int, str], _param: torch.Tensor) -> None:
        self._unready[self._index[key]].discard(key)
        self._start_ready(everything=False)

    def _start_ready(self, everything: bool) -> None:
        while self._next < len(self._chunks) and self._error is None and (
                everything or not self._unready[self._next]):
            chunk, flat = self._chunks[self._next], self._flat[self._next]
            self._next += 1
            group = self._groups.get(chunk.ranks)
            # with a flat buffer the gradients are its views: it is summed in place
            grads = ([flat] if flat is not None
                     else [local(_grad(self._params[k])) for k in chunk.params])
            try:
                self._pending.append(_start(grads, group))
            except PeerLost as exc:
                self._error = exc

    @property
    def started(self) -> int:
        """The chunks started so far."""
        return self._next

    def finish(self) -> int:
        """Start what is left, wait for every sum and write it back; the all-reduces issued."""
        self._start_ready(everything=True)
        if self._error is not None:
            raise self._error
        for item in self._pending:
            _finish(*item)
        return len(self._pending)


def sync_gradients(layers: Mapping[int, nn.Module], device: int, ranks: RankMap,
                   groups: GroupTable, rounds: Sequence[Sequence[AllReduceGroup]] = (),
                   holders: Mapping[int, Sequence[int]] | None = None,
                   mode: SyncMode = "rounds", ties: Sequence[TiedCopies] = (),
                   tp_rank: int = 0, sums: GradientSums | None = None) -> int:
    """Sum each held layer's gradients over its holders, then each tie's over its copies'
    holders; returns the all-reduces issued here.

    ``layers`` maps global layer index -> module for the layers this device holds. ``rounds``
    are the plan's colour rounds (mode ``rounds``); ``sums``: this step's
    :class:`GradientSums`, some of them maybe started during the backward (default: none
    started yet, over :func:`sum_order`). ``holders`` maps layer -> holder devices (mode
    ``serial``); ``ties``: :func:`tied_copies` under the plan. Under tensor parallelism this
    card sums with the cards of rank ``tp_rank`` of the other holders.
    """
    tied = _tied_names(ties)
    issued = 0
    if mode == "rounds":
        if sums is None:
            sums = GradientSums(layers, sum_order(layers, device, ranks, rounds, ties, tp_rank),
                                groups)
        issued = sums.finish()
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


def norm_holder(layer: int, holders: Sequence[int]) -> int:
    """The holder that counts ``layer`` in the job-wide norm: after the sums every holder has
    the same gradients, so the layers are dealt round the holders (layer ``l`` to the
    ``l mod n``-th), which splits the work as evenly as the layers allow; one holder, the
    lowest, doing it all made the others wait for it at the vote (5 ms of the tiny GPT's
    data-parallel step)."""
    ordered = sorted(holders)
    return ordered[layer % len(ordered)]


def square_share(layers: Mapping[int, nn.Module], device: int,
                 holders: Mapping[int, Sequence[int]], ties: Sequence[TiedCopies] = (),
                 tp_rank: int = 0) -> float:
    """This card's part of the squared job-wide gradient norm (float64; inf or nan when a
    gradient is not finite): each layer by one holder (:func:`norm_holder`), each tie by its
    lowest device; inside a unit each card counts its shards, card 0 alone the replicated
    parameters."""

    def counts(p: torch.Tensor) -> bool:
        return tp_rank == 0 or not replicated(p)

    tied = _tied_names(ties)
    params = []
    for t in ties:
        if t.devices and t.devices[0] == device:
            x, name = next((x, n) for x, n in t.members if x in layers)
            params.append(tied_parameter(layers[x], x, name))
    for layer, module in layers.items():
        if norm_holder(layer, holders[layer]) == device:
            params += [p for name, p in module.named_parameters()
                       if name not in tied.get(layer, ())]
    return float(_squares([local(_grad(p)) for p in params if counts(p)]))
