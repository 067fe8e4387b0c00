"""Restorer: who takes which new slot, and who sends which layer.

A re-plan hands the restorer a *layout* (pipelines whose ``devices`` are slot numbers
``0 .. n-1``) and the set of live devices. Turning that into a runnable plan takes two decisions,
both made here; the third one that every asymmetric plan needs afterwards, its gradient
all-reduce rounds, depends on the new layout alone and is ``allreduce``'s.

1. **Assignment (Kuhn-Munkres optimum).** What a device holds now is the layer range of its
   stage in the current plan (spares, rejoined and failed devices hold nothing; dead devices are
   gone). ``Cost[i][j]`` is the bytes live device ``i`` must receive to hold slot ``j``'s layers
   (weights + optimizer state of the layers it lacks; surplus layers are dropped for free);
   devices left over become spares. The paper solves this N x N matrix with the Hungarian
   method. Rows of devices holding the same range are identical, and so are columns of slots
   needing the same range, so we solve the same problem between those few classes as a
   min-cost flow: the optimum total is identical (the tests check it against
   ``linear_sum_assignment`` and brute force), and it takes milliseconds at 2048 devices where
   the Hungarian method took 1.7 s. Inside a class, devices keep their own pipeline and stage
   when that slot is theirs to take, then take slots in id order; a working device is left
   spare only when that costs no byte more.

2. **Sources (busiest link).** Every (receiver, layer) pair may be served by any live device
   that holds the layer *now*, before anyone moves. The paper minimises only the total; we also
   minimise the makespan, the time of the busiest device, where a device's time is
   ``max(bytes sent, bytes received)`` over a full-duplex link. The receive side is fixed by the
   assignment, so only the send side is chosen, and that is a makespan-scheduling problem on
   the holders of each layer: greedy LPT (largest layers first, each to the holder whose time
   afterwards is least; ties go to the holder whose time grows least, i.e. one that can send
   under its own receive volume for free, then the one that has sent least, then the lowest
   id). Good enough because the makespan can never drop below the largest receive volume,
   which the assignment fixed, so sends only have to be spread under that floor; with one
   holder per surviving pipeline most layers have several holders, LPT is within 4/3 of optimal
   when every holder may serve every item, and in practice it meets the receive floor. A layer
   that no live device holds (every replica died) cannot come from a peer: each receiver of it
   gets a transfer whose source is ``CHECKPOINT`` (it loads the layer from the last checkpoint).
   Those bytes count in the receiver's volume, as the estimator prices them, but load no
   device's send side. Such a placement is an ordinary re-plan;
   ``ExecutionPlan.checkpoint_layers`` names those layers for consumers that treat lost state
   differently.

Everything here is a pure function of its arguments: the same inputs give the same placement.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np

from chameleon_elastic.plan import CHECKPOINT, ExecutionPlan, Pipeline, Transfer
from chameleon_elastic.spec import JobSpec

__all__ = [
    "Placement",
    "RestoreError",
    "choose_sources",
    "holdings",
    "place",
    "transfer_cost_matrix",
]

#: A range ``[start, end)`` of layers; ``(0, 0)`` holds nothing.
LayerRange = tuple[int, int]

_NOTHING: LayerRange = (0, 0)
# The whole tie-break penalty of an assignment stays below this fraction of the smallest layer.


class RestoreError(ValueError):
    """A placement that cannot be made from the given layout and live devices."""


@dataclass(frozen=True)
class Placement:
    """The layout with real device ids, the devices left over, and the weight moves to make."""

    pipelines: tuple[Pipeline, ...]
    spare_devices: tuple[int, ...]
    transfers: tuple[Transfer, ...]

    @property
    def total_bytes(self) -> float:
        return float(sum(t.bytes for t in self.transfers))


# --------------------------------------------------------------------------- what is held


def holdings(current: ExecutionPlan, live: Sequence[int]) -> dict[int, LayerRange]:
    """Layer range each live device holds now: its stage's range if it works in ``current``."""
    where = _positions(current)
    return {d: where[d][2] if d in where else _NOTHING for d in live}


def _positions(current: ExecutionPlan) -> dict[int, tuple[int, int, LayerRange]]:
    """(pipeline, stage, layer range) of every working device of ``current``: one pass over
    the plan that both the holdings and the assignment's tie-break read."""
    dead = set(current.failed_devices)
    return {
        d: (i, s, layer_range)
        for i, p in enumerate(current.pipelines)
        for s, (d, layer_range) in enumerate(zip(p.devices, p.layers))
        if d not in dead
    }


def _slot_table(layout: Sequence[Pipeline], num_layers: int) -> list[tuple[int, int, LayerRange]]:
    """(pipeline, stage, layer range) per slot number, checking the slots are 0 .. n-1."""
    slots: dict[int, tuple[int, int, LayerRange]] = {}
    for i, p in enumerate(layout):
        if len(p.devices) != len(p.layers) or not p.devices:
            raise RestoreError(
                f"layout pipeline {i} has {len(p.devices)} slots and {len(p.layers)} layer "
                "ranges; give every pipeline at least one slot and one range per slot."
            )
        for s, (slot, (start, end)) in enumerate(zip(p.devices, p.layers)):
            if slot in slots:
                raise RestoreError(
                    f"slot {slot} appears twice in the layout; number the slots 0 .. n-1, "
                    "each once."
                )
            if not 0 <= start < end <= num_layers:
                raise RestoreError(
                    f"layout pipeline {i} stage {s} holds layers [{start}, {end}), which is "
                    f"not a non-empty range inside [0, {num_layers}); fix the layer split."
                )
            slots[slot] = (i, s, (start, end))
    n = len(slots)
    if sorted(slots) != list(range(n)):
        raise RestoreError(
            f"layout slots {sorted(slots)} are not numbered 0 .. {n - 1}; number the slots "
            "0 .. n-1, each once."
        )
    return [slots[j] for j in range(n)]


# --------------------------------------------------------------------------- assignment


def _prefix_bytes(spec: JobSpec, num_layers: int) -> np.ndarray:
    per_layer = [spec.model.transfer_bytes(layer) for layer in range(num_layers)]
    return np.concatenate(([0.0], np.cumsum(per_layer)))


def _check_model(spec: JobSpec, current: ExecutionPlan) -> int:
    num_layers = current.num_layers
    if num_layers != spec.model.layers:
        raise RestoreError(
            f"the current plan covers {num_layers} layers but the job spec has model.layers = "
            f"{spec.model.layers}; pass the spec the plan was made for."
        )
    return num_layers


def transfer_cost_matrix(spec: JobSpec, current: ExecutionPlan, layout: Sequence[Pipeline],
                         live: Sequence[int]) -> np.ndarray:
    """``Cost[i][j]``: bytes ``live[i]`` must receive to hold slot ``j``'s layers.

    One row per live device (in the given order), one column per slot; no spare padding.
    """
    num_layers = _check_model(spec, current)
    slots = _slot_table(layout, num_layers)
    held = holdings(current, live)
    prefix = _prefix_bytes(spec, num_layers)
    a = np.array([held[d][0] for d in live], dtype=np.int64)[:, None]
    b = np.array([held[d][1] for d in live], dtype=np.int64)[:, None]
    c = np.array([r[0] for _, _, r in slots], dtype=np.int64)[None, :]
    e = np.array([r[1] for _, _, r in slots], dtype=np.int64)[None, :]
    lo, hi = np.maximum(a, c), np.minimum(b, e)
    whole = prefix[e] - prefix[c]
    # Sum the two uncovered pieces rather than subtracting the overlap: a full overlap is 0.0
    # exactly, with no rounding residue.
    missing = (prefix[lo] - prefix[c]) + (prefix[e] - prefix[hi])
    return np.where(lo < hi, missing, np.broadcast_to(whole, missing.shape))


@dataclass(frozen=True)
class _Cells:
    """Pipeline, stage and held layer range ``[start, end)`` per entry, as arrays: the slots
    of a layout (entry = slot number) or the live devices (entry = position in ``live``;
    pipeline -1 and range [0, 0) for a device that works nowhere now)."""

    pipeline: np.ndarray
    stage: np.ndarray
    start: np.ndarray
    end: np.ndarray


def _flat(pipelines: Sequence[Pipeline]) -> tuple[np.ndarray, _Cells]:
    """Every stage of ``pipelines`` in order: (its device or slot, its cell)."""
    lengths = np.fromiter((len(p.devices) for p in pipelines), np.int64, len(pipelines))
    total = int(lengths.sum())
    chain = itertools.chain.from_iterable
    ids = np.fromiter(chain(p.devices for p in pipelines), np.int64, total)
    ranges = np.fromiter(chain(chain(p.layers) for p in pipelines), np.int64, 2 * total)
    which = np.repeat(np.arange(len(pipelines)), lengths)
    stage = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return ids, _Cells(which, stage, ranges[0::2], ranges[1::2])


def _slot_cells(layout: Sequence[Pipeline], num_layers: int) -> _Cells:
    """``_slot_table`` as arrays indexed by slot number; a malformed layout gets
    ``_slot_table``'s own error."""
    if not layout or any(len(p.devices) != len(p.layers) or not p.devices for p in layout):
        _slot_table(layout, num_layers)
    ids, cells = _flat(layout)
    n = len(ids)
    if n and (ids.min() < 0 or ids.max() >= n or np.bincount(ids, minlength=n).max() > 1
            or (cells.start < 0).any() or (cells.end <= cells.start).any()
            or (cells.end > num_layers).any()):
        _slot_table(layout, num_layers)  # raises, naming the first problem
    order = np.argsort(ids)
    return _Cells(*(getattr(cells, f)[order] for f in ("pipeline", "stage", "start", "end")))


def _live_cells(current: ExecutionPlan, live: np.ndarray) -> _Cells:
    """Where each live device works in ``current`` and what it holds (``_positions``)."""
    ids, cells = _flat(current.pipelines)
    keep = ~np.isin(ids, np.asarray(current.failed_devices, dtype=np.int64))
    ids = ids[keep]
    size = int(max(ids.max(initial=-1), live.max(initial=-1))) + 1
    out = []
    for field, missing in (("pipeline", -1), ("stage", -1), ("start", 0), ("end", 0)):
        table = np.full(size, missing, dtype=np.int64)
        table[ids] = getattr(cells, field)[keep]
        out.append(table[live])
    return _Cells(*out)


def _in_order_of_appearance(keys: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """(first entry of each distinct key, in order of first appearance; the entries of each
    such class, ascending)."""
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first, kind="stable"), kind="stable")
    label = rank[inverse]
    grouped = np.argsort(label, kind="stable")
    return np.sort(first), np.split(grouped, np.cumsum(np.bincount(label))[:-1])


def _assign(spec: JobSpec, slots: _Cells, devices: _Cells, n_layers: int) -> np.ndarray:
    """Slot number taken by each live device (``devices``, in ``live`` order), -1 for a spare.

    Devices that hold the same range are interchangeable for the cost, and so are slots that
    need the same range, so the N x N assignment collapses to a transportation problem between
    a handful of *classes* (at most one per distinct range), solved exactly as a min-cost flow.
    Its optimum total equals the full Kuhn-Munkres optimum (the flow polytope is integral) at a
    fraction of the cost: O(N^3) Hungarian took 1.7 s at 2048 devices, this takes milliseconds.
    The tie penalty then decides which devices of a class take which slots of a class: first
    every device whose own pipeline and stage is such a slot, then the rest in id order. Both
    steps run on arrays, a class at a time: at 16k devices a loop per device took 0.1 s.
    """
    n_live, n_slots = len(devices.start), len(slots.start)
    if n_live < n_slots:
        raise RestoreError(
            f"the layout has {n_slots} slots but only {n_live} live devices; plan a layout "
            "with at most as many slots as live devices."
        )
    if n_slots == 0:
        return np.full(n_live, -1, dtype=np.int64)
    working = devices.pipeline >= 0
    dev_first, dev_members = _in_order_of_appearance(
        (devices.start * (n_layers + 1) + devices.end) * 2 + working)
    dev_keys = [((int(devices.start[i]), int(devices.end[i])), bool(working[i])) for i in dev_first]
    slot_first, slot_members = _in_order_of_appearance(slots.start * (n_layers + 1) + slots.end)
    slot_keys = [(int(slots.start[j]), int(slots.end[j])) for j in slot_first]
    flow = _class_flow(spec, dev_keys, [len(m) for m in dev_members], slot_keys,
                       [len(m) for m in slot_members], n_layers)
    slot_class = np.empty(n_slots, dtype=np.int64)
    for r, members in enumerate(slot_members):
        slot_class[members] = r
    # A device's own (pipeline, stage) in the layout, if that is a slot there.
    grid = np.full((int(slots.pipeline.max()) + 1, int(slots.stage.max()) + 1), -1, np.int64)
    grid[slots.pipeline, slots.stage] = np.arange(n_slots)
    fits = working & (devices.pipeline < grid.shape[0]) & (devices.stage < grid.shape[1])
    home = np.full(n_live, -1, dtype=np.int64)
    home[fits] = grid[devices.pipeline[fits], devices.stage[fits]]
    taken = np.full(n_live, -1, dtype=np.int64)
    free = np.ones(n_slots, dtype=bool)
    for c, members in enumerate(dev_members):
        quota = np.array(flow[c], dtype=np.int64)
        own = home[members]
        stays = own >= 0
        stays[stays] = free[own[stays]]
        # Of the devices whose own slot is free, the first quota[r] of each slot class r stay.
        can = members[stays]
        wanted = slot_class[home[can]]
        by_class = np.argsort(wanted, kind="stable")
        ranked = wanted[by_class]
        rank = np.arange(len(ranked)) - np.searchsorted(ranked, ranked)  # place in its class
        keep = can[by_class[rank < quota[ranked]]]
        taken[keep] = home[keep]
        free[home[keep]] = False
        quota -= np.bincount(slot_class[home[keep]], minlength=len(quota))
        rest = members[taken[members] < 0]
        used = 0
        for r, want in enumerate(quota.tolist()):  # the rest take the least free slots in turn
            if want:
                pool = slot_members[r]
                chosen = pool[free[pool]][:want]
                taken[rest[used:used + want]] = chosen
                free[chosen] = False
                used += want
    return taken


def _class_flow(spec: JobSpec, dev_keys: Sequence[tuple[LayerRange, bool]],
                dev_sizes: Sequence[int], slot_keys: Sequence[LayerRange],
                slot_sizes: Sequence[int], n_layers: int) -> list[list[int]]:
    """How many devices of each device class take slots of each slot class: the min-cost flow
    of ``_assign`` (classes in order of first appearance; the order is part of the result
    when several flows cost the same)."""
    prefix = _prefix_bytes(spec, n_layers)
    n_live, n_slots = sum(dev_sizes), sum(slot_sizes)

    def missing(have: LayerRange, need: LayerRange) -> float:
        lo, hi = max(have[0], need[0]), min(have[1], need[1])
        covered = (prefix[hi] - prefix[lo]) if lo < hi else 0.0
        return float(prefix[need[1]] - prefix[need[0]] - covered)

    # Network simplex wants integer weights: bytes are scaled to 1e12 units of the largest cost
    # (exact to 1e-12 relative), then multiplied so that the tie units (a working device left
    # idle as a spare costs 1), which sum to at most n_live, never outweigh one unit of bytes.
    top = max((missing(k[0], r) for k in dev_keys for r in slot_keys), default=0.0) or 1.0
    scale = n_live + 1

    def weight(cost: float) -> int:
        return round(cost / top * 1e12) * scale
    graph = nx.DiGraph()
    graph.add_node("src", demand=-n_live)
    graph.add_node("sink", demand=n_live)
    graph.add_edge("spare", "sink", capacity=n_live - n_slots, weight=0)
    for key, size in zip(dev_keys, dev_sizes):
        graph.add_edge("src", ("d", key), capacity=size, weight=0)
        graph.add_edge(("d", key), "spare", weight=1 if key[1] else 0)
        for rng in slot_keys:
            graph.add_edge(("d", key), ("s", rng), weight=weight(missing(key[0], rng)))
    for rng, size in zip(slot_keys, slot_sizes):
        graph.add_edge(("s", rng), "sink", capacity=size, weight=0)
    flow = nx.min_cost_flow(graph)
    return [[flow[("d", key)].get(("s", rng), 0) for rng in slot_keys] for key in dev_keys]


# --------------------------------------------------------------------------- sources


@dataclass
class _SourceGroup:
    """Layers of one size held by the same holders: the busy holders' lazy heap of
    (key, holder) and the cursor at the lowest-id holder that may still be idle."""

    size: float
    busy: list[tuple[tuple[float, float, float, int], int]]
    walk: Iterator[int]
    idle: int | None


def choose_sources(transfer_bytes: Callable[[int], float], held: dict[int, LayerRange],
                   needs: dict[int, Sequence[int]],
                   members: dict[LayerRange, list[int]] | None = None) -> tuple[Transfer, ...]:
    """Pick a holder for every (receiver, layer) so that the busiest device finishes first.

    ``transfer_bytes``: bytes that move per layer (``ModelProfile.transfer_bytes``), so callers
    without a job spec can use it; ``held``: what every live device holds now; ``needs``: layers
    each receiver lacks; ``members``: ``held``'s devices by range (``_by_range``), when the
    caller has them at hand (``place`` has them as arrays: 16k devices grouped in a loop
    here cost a tenth of a placement). Returns one ``Transfer`` per (src, dst), sorted by (src, dst), then
    one per receiver of layers no live device holds, source ``CHECKPOINT``, sorted by dst;
    layers sorted.

    Each item goes to the holder with the least LPT key (see the module docstring), exactly as
    a scan over all its holders would choose, but without looking at most of them: at 2048
    devices a layer has hundreds of holders and only a few of them ever send. A holder that has
    neither sent nor received anything (*idle*) has the key ``(b, b, 0, id)``, so among idle
    holders the least is simply the lowest id. Every layer group therefore keeps a lazy
    min-heap of its *busy* holders only, plus a cursor walking its holders in id order to the
    first idle one; the choice is the lesser of the two. A holder joins the heaps of its
    groups when it turns busy (on its first send; receivers are busy from the start).
    Holders are kept per distinct held range (a handful of classes), never per device x layer.
    """
    size = {layer: transfer_bytes(layer) for layers in needs.values() for layer in layers}
    items = sorted(
        ((dst, layer) for dst, layers in needs.items() for layer in layers),
        key=lambda item: (-size[item[1]], item[1], item[0]),
    )
    received: dict[int, float] = {}
    for dst, layer in items:
        received[dst] = received.get(dst, 0.0) + size[layer]
    picker = _SourcePicker(held, received, members if members is not None else _by_range(held))
    moves: dict[tuple[int, int], list[int]] = {}
    from_checkpoint: dict[int, list[int]] = {}
    for dst, layer in items:
        group = picker.group(layer, size[layer])
        if group is None:  # every replica died: no device sends it, no heap is touched
            from_checkpoint.setdefault(dst, []).append(layer)
            continue
        moves.setdefault((picker.pick(group), dst), []).append(layer)
    sources = [*sorted(moves.items()),
               *(((CHECKPOINT, dst), layers) for dst, layers in sorted(from_checkpoint.items()))]
    return tuple(Transfer(src, dst, tuple(sorted(layers)), float(sum(size[x] for x in layers)))
                 for (src, dst), layers in sources)


def _by_range(held: Mapping[int, LayerRange]) -> dict[LayerRange, list[int]]:
    """Devices (ascending) per held range, ranges in order of their lowest device."""
    members: dict[LayerRange, list[int]] = {}
    for d in sorted(held):
        members.setdefault(held[d], []).append(d)
    return members


class _SourcePicker:
    """The LPT choice of ``choose_sources``, one item at a time: the bytes each device has
    sent and will receive, its holders per held range, and the layer groups with their heaps.
    Kept apart from the loop over items so that the bookkeeping that makes the choice fast
    (lazy heaps, idle cursors) reads on its own."""

    def __init__(self, held: dict[int, LayerRange], received: dict[int, float],
                 members: dict[LayerRange, list[int]]) -> None:
        self.held = held
        self.received = received
        self.sent: dict[int, float] = {}
        self.members = members
        self.busy: dict[LayerRange, list[int]] = {}
        for d, r in received.items():
            if r and d in held:
                self.busy.setdefault(held[d], []).append(d)
        # Layers held by the same ranges (the same holders) and of the same size share a
        # group: the key depends on nothing else, so a send goes stale in few heaps.
        self.group_of: dict[int, _SourceGroup] = {}
        self.groups: dict[tuple[tuple[LayerRange, ...], float], _SourceGroup] = {}
        self.groups_of_range: dict[LayerRange, list[_SourceGroup]] = {}

    def key(self, h: int, b: float) -> tuple[float, float, float, int]:
        """The LPT key of holder ``h`` sending ``b`` bytes more; the least key sends."""
        s, r = self.sent.get(h, 0.0), self.received.get(h, 0.0)
        after = max(s + b, r)  # the holder's time afterwards (LPT)
        return (after, after - max(s, r), s, h)

    def group(self, layer: int, b: float) -> _SourceGroup | None:
        """The group of ``layer`` (``b`` bytes), made on first use; None when no live device
        holds the layer (it comes from the checkpoint)."""
        group = self.group_of.get(layer)
        if group is not None:
            return group
        ranges = tuple(r for r in self.members if r[0] <= layer < r[1])
        if not ranges:
            return None
        group = self.groups.get((ranges, b))
        if group is None:
            heap = [(self.key(h, b), h) for r in ranges for h in self.busy.get(r, ())]
            heapq.heapify(heap)
            walk = heapq.merge(*(self.members[r] for r in ranges))
            group = self.groups[(ranges, b)] = _SourceGroup(b, heap, walk, next(walk, None))
            for r in ranges:
                self.groups_of_range.setdefault(r, []).append(group)
        self.group_of[layer] = group
        return group

    def pick(self, group: _SourceGroup) -> int:
        """The holder of ``group`` that sends its next item, charged with the bytes: the least
        of the lowest-id idle holder and the top of the busy heap."""
        b, heap = group.size, group.busy
        while heap:  # lazy heap: keys only grow, so refresh stale tops until one is current
            stored, h = heap[0]
            fresh = self.key(h, b)
            if fresh == stored:
                break
            heapq.heapreplace(heap, (fresh, h))
        sent, received = self.sent, self.received
        while group.idle is not None and (sent.get(group.idle) or received.get(group.idle)):
            group.idle = next(group.walk, None)  # busy ones are in the heap already
        if group.idle is not None and (not heap or self.key(group.idle, b) < heap[0][0]):
            src = group.idle
            sent[src] = sent.get(src, 0.0) + b
            if b:  # now busy: it joins the heap of every group it belongs to
                self.busy.setdefault(self.held[src], []).append(src)
                for other in self.groups_of_range[self.held[src]]:
                    heapq.heappush(other.busy, (self.key(src, other.size), src))
        else:
            src = heap[0][1]
            sent[src] = sent.get(src, 0.0) + b
            heapq.heapreplace(heap, (self.key(src, b), src))
        return src


# --------------------------------------------------------------------------- placement


def place(spec: JobSpec, current: ExecutionPlan, layout: Sequence[Pipeline],
          live: Sequence[int]) -> Placement:
    """Assign live devices to the layout's slots moving the fewest bytes, then plan the moves.

    ``layout``: pipelines whose ``devices`` are slot numbers ``0 .. n-1``; ``live``: the devices
    alive now (at least ``n``). Devices left over become spares. Layers nobody holds come from
    the checkpoint (``choose_sources``). Raises ``RestoreError`` (a ``ValueError``) for a
    malformed layout or too few live devices.
    """
    num_layers = _check_model(spec, current)
    live_sorted = sorted(set(live))
    if len(live_sorted) != len(live):
        raise RestoreError(f"live devices {list(live)} name a device twice; list each once.")
    slots = _slot_cells(layout, num_layers)
    live_ids = np.asarray(live_sorted, dtype=np.int64)
    devices = _live_cells(current, live_ids)
    taken = _assign(spec, slots, devices, num_layers)
    placed = taken >= 0
    device_of = np.empty(len(slots.start), dtype=np.int64)  # slot -> position in live
    device_of[taken[placed]] = np.flatnonzero(placed)
    have_start, have_end = devices.start[device_of], devices.end[device_of]
    short = np.flatnonzero((have_start > slots.start) | (slots.end > have_end))
    needs: dict[int, list[int]] = {}
    for d, a, b, start, end in zip(  # only the receivers, in slot order
            live_ids[device_of[short]].tolist(), have_start[short].tolist(),
            have_end[short].tolist(), slots.start[short].tolist(), slots.end[short].tolist()):
        needs[d] = [x for x in range(start, end) if not a <= x < b]
    by_slot = live_ids[device_of].tolist()
    pipelines = tuple(
        Pipeline(tuple(by_slot[s] for s in p.devices), tuple(p.layers), p.micro_batches,
                 p.recompute)
        for p in layout
    )
    held = dict(zip(live_sorted, zip(devices.start.tolist(), devices.end.tolist())))
    firsts, groups = _in_order_of_appearance(devices.start * (num_layers + 1) + devices.end)
    members = {held[live_sorted[i]]: live_ids[g].tolist() for i, g in zip(firsts.tolist(), groups)}
    spares = tuple(live_ids[~placed].tolist())
    return Placement(pipelines, spares,
                     choose_sources(spec.model.transfer_bytes, held, needs, members))
