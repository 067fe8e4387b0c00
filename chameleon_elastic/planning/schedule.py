"""The 1F1B operation order of every working device, written once for the estimator and runtime.

Plain layouts. Pipeline ``p`` with ``N_pp`` stages and a quota of ``N_m`` micro-batches runs the
classic 1F1B (PipeDream-Flush) order: stage ``i`` first does ``min(N_pp - i - 1, N_m)`` warm-up
forwards, then alternates one forward and one backward, then drains the remaining backwards.
Micro-batch numbers are local to the pipeline (``0 .. N_m - 1``). Pipelines never exchange
activations, so asymmetric layouts (own length, own quota per pipeline) are just several such
orders side by side; they meet only at the gradient all-reduce, which is not part of the order.

Rerouted layouts. The dead device at stage ``s`` of pipeline ``p`` keeps its place in the
layout; its work for micro-batch ``m`` is done by ``plan.server(p, s, m)``, a live peer that
holds the same layers. The peer must interleave these foreign operations with its own. The
rule depends on the plan only:

1. Give every operation of every pipeline its *nominal start*: its start time when that
   pipeline runs failure-free 1F1B with one device per stage, a forward taking 1 unit and a
   backward 2 units (``NOMINAL_FORWARD`` / ``NOMINAL_BACKWARD``).
2. Each device runs the operations it serves sorted by ``(nominal start, pipeline, stage,
   micro-batch, kind)``.

A device that serves only its own stage gets exactly its 1F1B order back (nominal starts grow
along it). Why this cannot deadlock: every data dependency (``F(s-1,m) -> F(s,m)``,
``F(last,m) -> B(last,m)``, ``B(s+1,m) -> B(s,m)``) goes strictly forward in nominal time,
because durations are positive, and every device-order edge goes forward or sideways (ties) in
nominal time. A cycle in the union of both edge sets would have to return to its starting
nominal time while containing at least one strictly increasing data edge (device orders alone
are chains, so every cycle has one): impossible. Hence executing the orders with blocking
receives and non-blocking sends always finishes. Memory stays bounded like 1F1B: each foreign
stream is a subsequence of the dead stage's own 1F1B order, so a peer holds at most its own
``min(N_pp - s, N_m)`` in-flight micro-batches plus, per dead stage it serves, no more than that
stage's 1F1B bound.

Message order. ``link_messages`` lists, per directed device pair, the operations whose outputs
cross that link, in the sender's order. When pipelines share length and quota (every
symmetric layout, rerouted or not) the receiver consumes them in the same order, so plain FIFO
point-to-point matching (NCCL, HCCL) is correct. For rerouted asymmetric layouts the receiver
may consume them in another order: a runtime then matches by tag (gloo) or posts its receives
in ``link_messages`` order. ``fifo_violations`` says which links those are.

``simulate`` times fixed orders with the paper's recurrence
``start(op) = max(end(previous op on the device), end(op it depends on))`` and raises
``ScheduleError`` on a deadlock instead of looping forever.

The same argument gives the estimator a faster path. Sorting *all* operations of some pipelines
by the merge key lists every device order as a subsequence (a merged order is sorted by that
key, a device that serves only its own stage has strictly growing nominal starts) and puts
every operation after the one it depends on. One pass in that order therefore computes the
recurrence exactly, with no worklist and no ``Op`` objects: ``coupled_makespan`` for the
makespan and ``streams_in_flight_peak`` for a peer's in-flight micro-batches.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from ..plan import ExecutionPlan, Reroute

__all__ = [
    "NOMINAL_BACKWARD",
    "NOMINAL_FORWARD",
    "Lane",
    "Op",
    "OpKey",
    "ScheduleError",
    "Stream",
    "Timeline",
    "coupled_makespan",
    "dependency",
    "device_order",
    "device_orders",
    "fifo_violations",
    "in_flight_peak",
    "link_messages",
    "one_f_one_b",
    "orders_of_devices",
    "pipeline_end",
    "pipeline_end_floor",
    "pipeline_schedule",
    "simulate",
    "streams_in_flight_peak",
]

NOMINAL_FORWARD = 1.0
NOMINAL_BACKWARD = 2.0

OpKind = Literal["F", "B"]
OpKey = tuple[str, int, int, int]
"""``(kind, pipeline, micro_batch, stage)``: identifies an operation whoever runs it."""

Lane = tuple[tuple[tuple[float, float], ...], int, tuple[tuple[int, ...], ...]]
"""One pipeline for ``coupled_makespan``: ``(stage times, micro-batches, servers)``.

``servers[s]`` lists the devices that run stage ``s``, micro-batch ``m`` going to
``servers[s][m % len(servers[s])]``: the home device alone for a live stage, the reroute's
peers in order for a dead one. Devices are small non-negative integers."""

Stream = tuple[int, int, int, int, int, tuple[int, ...]]
"""Part of one stage's 1F1B operations, for ``streams_in_flight_peak``: ``(rank, num_stages,
stage, micro_batches, period, residues)`` keeps the micro-batches ``m`` with
``m % period in residues``; ``rank`` orders pipelines as their indices do in the plan."""


class ScheduleError(RuntimeError):
    """A set of device orders that cannot finish (a dependency cycle or a missing operation)."""


@dataclass(frozen=True)
class Op:
    """Forward or backward of one micro-batch through one stage, as one device runs it."""

    kind: OpKind
    pipeline: int
    micro_batch: int
    stage: int
    device: int
    source: int | None  # device the input comes from (F: previous stage, B: next stage)
    dest: int | None  # device the output goes to; None at the pipeline ends

    @property
    def key(self) -> OpKey:
        return (self.kind, self.pipeline, self.micro_batch, self.stage)


@dataclass(frozen=True)
class Timeline:
    """Start and end of every operation under given durations; ``makespan`` is the last end."""

    start: Mapping[OpKey, float]
    end: Mapping[OpKey, float]
    makespan: float


# --------------------------------------------------------------------------- one pipeline


@lru_cache(maxsize=4096)
def one_f_one_b(num_stages: int, stage: int, micro_batches: int) -> tuple[tuple[str, int], ...]:
    """``(kind, micro_batch)`` in the order stage ``stage`` of a plain 1F1B pipeline runs them."""
    if not 0 <= stage < num_stages or micro_batches < 0:
        raise ValueError(
            f"stage {stage} of a {num_stages}-stage pipeline with {micro_batches} micro-batches "
            "does not exist; use 0 <= stage < num_stages and micro_batches >= 0."
        )
    warm = min(num_stages - stage - 1, micro_batches)
    order: list[tuple[str, int]] = [("F", m) for m in range(warm)]
    for k in range(micro_batches - warm):
        order.append(("F", warm + k))
        order.append(("B", k))
    order.extend(("B", m) for m in range(micro_batches - warm, micro_batches))
    return tuple(order)


def pipeline_schedule(
    stage_times: Sequence[tuple[float, float]], micro_batches: int
) -> tuple[tuple[tuple[float, ...], tuple[float, ...]], ...]:
    """End times of one failure-free 1F1B pipeline, one device per stage.

    ``stage_times[s] = (T_f, T_b)`` of stage ``s``. Returns, per stage, ``(ends of F by
    micro-batch, ends of B by micro-batch)``; the makespan is stage 0's last backward end.
    O(N_pp * N_m): one pass over the operations in ``_sweep_order``.
    """
    n, nm = len(stage_times), micro_batches
    end = _sweep(stage_times, nm)
    size = n * nm
    return tuple((tuple(end[s * nm:(s + 1) * nm]), tuple(end[size + s * nm:size + (s + 1) * nm]))
                 for s in range(n))


def pipeline_end(stage_times: Sequence[tuple[float, float]], micro_batches: int) -> float:
    """Makespan of one failure-free 1F1B pipeline: ``pipeline_schedule``'s stage 0 last
    backward end, without building the per-stage tuples (the estimator's hot path)."""
    if micro_batches == 0:
        return 0.0
    n = len(stage_times)
    return _sweep(stage_times, micro_batches)[n * micro_batches + micro_batches - 1]


def pipeline_end_floor(stage_times: Sequence[tuple[float, float]], micro_batches: int) -> float:
    """A lower bound on ``pipeline_end``, in O(N_pp): the longest of two families of paths.

    Through stage ``k``'s whole order (micro-batch 0's forwards up to it, its ``N_m`` forwards
    and backwards, the last backward back to stage 0), and through micro-batch 0's round trip
    down to stage ``k``'s first backward, then what stage ``k`` still runs after it, then back.
    Both are chains of operations that wait for each other, so the makespan is at least each.
    The search uses it to skip simulating candidates that cannot win: compare it with a
    relative margin (1e-9), for it is summed in another order than the simulation's floats.
    """
    if micro_batches == 0:
        return 0.0
    n, nm = len(stage_times), micro_batches
    total = math.fsum(f + b for f, b in stage_times)
    before = best = 0.0
    for k, (f, b) in enumerate(stage_times):
        after_first_backward = max(nm - min(n - k - 1, nm) - 1, 0) * f + (nm - 1) * b
        best = max(best, before + nm * (f + b), total + after_first_backward)
        before += f + b
    return best


def _sweep(stage_times: Sequence[tuple[float, float]], nm: int) -> list[float]:
    """Every operation's end, laid out as in ``_nominal_groups`` (F of ``(s, m)`` at
    ``s * N_m + m``, B at ``N_pp N_m + s * N_m + m``), plus a last slot that stays 0.0.

    ``start = max(end of the input op, end of the previous op on the stage)`` evaluated once
    per operation in ``_sweep_order``: the same additions as any other valid order, so the
    same floats, with no worklist."""
    n = len(stage_times)
    if n == 0:
        raise ValueError("a pipeline needs at least one stage")
    if nm < 0:
        raise ValueError(f"a pipeline needs micro_batches >= 0, got {nm}.")
    durations = [t for pair in stage_times for t in pair]  # F of stage s at 2s, B at 2s + 1
    end = [0.0] * (2 * n * nm + 1)
    for own, ready, prev, kind in _sweep_order(n, nm):
        a, b = end[ready], end[prev]
        # Not max(): the call costs a third of this loop; equal values are equal floats.
        end[own] = (a if a > b else b) + durations[kind]  # noqa: FURB136
    return end


@lru_cache(maxsize=4096)
def _sweep_order(n: int, nm: int) -> tuple[tuple[int, int, int, int], ...]:
    """A 1F1B pipeline's operations as ``(own, ready, previous on the stage, duration index)``
    in an order where each comes after both operations it waits for.

    Stage ``s`` runs its ``2 N_m`` operations at positions ``0 .. 2 N_m - 1`` of its
    ``one_f_one_b`` order. The input of a forward (the previous stage's forward of the same
    micro-batch) and of a backward (the next stage's backward) always sits at the same or an
    earlier position of its own stage (warm-up counts fall by one per stage), so taking the
    positions in turn, forwards by rising stage and then backwards by falling stage, is a
    topological order: one pass, exact, and built once per (N_pp, N_m).
    """
    size = n * nm
    zero = 2 * size
    warm = [min(n - 1 - s, nm) for s in range(n)]
    prev = [zero] * n
    out: list[tuple[int, int, int, int]] = []
    for p in range(2 * nm):
        backwards = []
        for s in range(n):  # what one_f_one_b(n, s, nm)[p] is, by arithmetic
            w = warm[s]
            if p < w:
                m, forward = p, True
            elif p < 2 * nm - w:
                forward = not (p - w) & 1
                m = w + ((p - w) >> 1) if forward else (p - w) >> 1
            else:
                m, forward = p - nm, False
            cell = s * nm + m
            if forward:
                out.append((cell, cell - nm if s else zero, prev[s], 2 * s))
                prev[s] = cell
            else:
                backwards.append((s, cell))
        for s, cell in reversed(backwards):
            own = size + cell
            out.append((own, cell if s == n - 1 else own + nm, prev[s], 2 * s + 1))
            prev[s] = own
    return tuple(out)


@lru_cache(maxsize=1024)
def _nominal_starts(num_stages: int, micro_batches: int) -> tuple[tuple[tuple[float, ...], ...],
                                                                  tuple[tuple[float, ...], ...]]:
    """Nominal start times ``(F[s][m], B[s][m])`` of a failure-free pipeline (unit durations)."""
    times = ((NOMINAL_FORWARD, NOMINAL_BACKWARD),) * num_stages
    ends = pipeline_schedule(times, micro_batches)
    f = tuple(tuple(e - NOMINAL_FORWARD for e in ends[s][0]) for s in range(num_stages))
    b = tuple(tuple(e - NOMINAL_BACKWARD for e in ends[s][1]) for s in range(num_stages))
    return f, b


@lru_cache(maxsize=1024)
def _nominal_groups(num_stages: int, micro_batches: int
                    ) -> tuple[tuple[float, tuple[tuple[int, int, int], ...]], ...]:
    """A pipeline's operations grouped by nominal start, for ``coupled_makespan``.

    Groups come in time order, each sorted by the rest of the merge key (stage, micro-batch,
    F before B). An operation is ``(own, ready, cell)``, indices into the pipeline's flat
    arrays: ends of F at ``s * N_m + m``, of B at ``N_pp N_m + s * N_m + m``, and a last slot
    that stays 0.0 (the input of stage 0); ``cell = s * N_m + m`` picks the server.
    """
    nominal_f, nominal_b = _nominal_starts(num_stages, micro_batches)
    size = num_stages * micro_batches
    groups: dict[float, list[tuple[tuple[int, int, int], tuple[int, int, int]]]] = {}
    for s in range(num_stages):
        for m in range(micro_batches):
            cell = s * micro_batches + m
            ready_f = cell - micro_batches if s else 2 * size
            ready_b = cell if s == num_stages - 1 else size + cell + micro_batches
            groups.setdefault(nominal_f[s][m], []).append(((s, m, 0), (cell, ready_f, cell)))
            groups.setdefault(nominal_b[s][m], []).append(((s, m, 1), (size + cell, ready_b, cell)))
    return tuple((t, tuple(op for _, op in sorted(ops))) for t, ops in sorted(groups.items()))


@lru_cache(maxsize=1024)
def _flat_durations(stage_times: tuple[tuple[float, float], ...], micro_batches: int
                    ) -> tuple[float, ...]:
    """Duration of every operation of a pipeline, laid out as in ``_nominal_groups``."""
    forward = [tf for tf, _ in stage_times for _ in range(micro_batches)]
    backward = [tb for _, tb in stage_times for _ in range(micro_batches)]
    return tuple(forward + backward)


# --------------------------------------------------------------------------- a whole plan


_SortKey = tuple[float, int, int, int, int]


def device_orders(plan: ExecutionPlan, pipelines: Sequence[int] | None = None
                  ) -> dict[int, tuple[Op, ...]]:
    """Per working device, the operations it runs in order (see the module docstring).

    ``pipelines`` restricts the result to the operations of those pipelines (the estimator
    uses it for the pipelines that rerouting couples); devices then appear only if they serve
    one of them. By default every working device appears, with an empty order if its quota is 0.
    """
    dead = set(plan.failed_devices)
    reroutes = {r.device: r for r in plan.reroute}
    chosen = range(len(plan.pipelines)) if pipelines is None else pipelines
    keyed: dict[int, list[tuple[_SortKey, Op]]] = {}
    if pipelines is None:
        keyed = {d: [] for d in plan.working_devices}
    foreign: set[int] = {share.device for r in plan.reroute for share in r.peers}
    for p in chosen:
        servers = _servers(plan, p, dead, reroutes)
        for s in range(plan.pipelines[p].num_stages):
            for item in _stage_ops(plan, p, s, servers):
                keyed.setdefault(item[1].device, []).append(item)
    return {device: _merge(keyed[device], device in foreign) for device in sorted(keyed)}


def device_order(plan: ExecutionPlan, device: int) -> tuple[Op, ...]:
    """``device_orders(plan)[device]`` without building the other devices' orders."""
    try:
        p, s = plan.locate(device)
    except KeyError:
        p = s = -1
    if p < 0 or device in plan.failed_devices:
        raise ValueError(f"device {device} does not work under this plan (dead or spare).")
    return orders_of_devices(plan, {device: (p, s)})[device]


def orders_of_devices(plan: ExecutionPlan, where: Mapping[int, tuple[int, int]]
                      ) -> dict[int, tuple[Op, ...]]:
    """The orders of the live devices in ``where`` (device -> its (pipeline, stage)) only.

    Cheaper than ``device_orders`` when few devices serve foreign micro-batches: each order is
    built from the device's own stage plus the dead stages it serves.
    """
    dead = set(plan.failed_devices)
    reroutes = {r.device: r for r in plan.reroute}
    served: dict[int, list[Reroute]] = {}
    for r in plan.reroute:
        for device in dict.fromkeys(share.device for share in r.peers):  # a repeated peer once
            served.setdefault(device, []).append(r)
    servers: dict[int, list[list[int]]] = {}

    def servers_of(p: int) -> list[list[int]]:
        if p not in servers:
            servers[p] = _servers(plan, p, dead, reroutes)
        return servers[p]

    out: dict[int, tuple[Op, ...]] = {}
    for device, (p, s) in where.items():
        items = list(_stage_ops(plan, p, s, servers_of(p)))
        for r in served.get(device, ()):
            items.extend(item for item in _stage_ops(plan, r.pipeline, r.stage,
                                                     servers_of(r.pipeline))
                         if item[1].device == device)
        out[device] = _merge(items, device in served)
    return out


def _servers(plan: ExecutionPlan, p: int, dead: set[int],
             reroutes: Mapping[int, Reroute]) -> list[list[int]]:
    """``servers[s][m]``: the device running micro-batch ``m`` of pipeline ``p`` at stage ``s``."""
    pipe = plan.pipelines[p]
    nm = pipe.micro_batches
    return [[reroutes[d].peer_for(m) for m in range(nm)] if d in dead else [d] * nm
            for d in pipe.devices]


def _stage_ops(plan: ExecutionPlan, p: int, s: int,
               servers: list[list[int]]) -> Iterator[tuple[_SortKey, Op]]:
    """The 1F1B operations of stage ``s`` of pipeline ``p``, each with its merge key."""
    pipe = plan.pipelines[p]
    n, nm = pipe.num_stages, pipe.micro_batches
    nominal_f, nominal_b = _nominal_starts(n, nm)
    here = servers[s]
    before = servers[s - 1] if s > 0 else None
    after = servers[s + 1] if s + 1 < n else None
    for kind, m in one_f_one_b(n, s, nm):
        prev = None if before is None else before[m]
        nxt = None if after is None else after[m]
        if kind == "F":
            yield (nominal_f[s][m], p, s, m, 0), Op("F", p, m, s, here[m], prev, nxt)
        else:
            yield (nominal_b[s][m], p, s, m, 1), Op("B", p, m, s, here[m], nxt, prev)


def _merge(items: list[tuple[_SortKey, Op]], foreign: bool) -> tuple[Op, ...]:
    """A device's own 1F1B order as is; with foreign streams, sorted by nominal start."""
    if foreign:
        items = sorted(items, key=lambda item: item[0])
    return tuple(op for _, op in items)


def dependency(op: Op) -> OpKey | None:
    """The operation whose output ``op`` consumes, or None for a forward at stage 0."""
    if op.kind == "F":
        return None if op.source is None else ("F", op.pipeline, op.micro_batch, op.stage - 1)
    if op.source is None:  # last stage: the backward consumes its own forward's output
        return ("F", op.pipeline, op.micro_batch, op.stage)
    return ("B", op.pipeline, op.micro_batch, op.stage + 1)


def simulate(orders: Mapping[int, Sequence[Op]], duration: Callable[[Op], float]) -> Timeline:
    """Time fixed device orders: ``start = max(end of previous op on device, end of input op)``.

    Raises ``ScheduleError`` when the orders cannot finish (cyclic waits or an input that no
    device produces), naming the operations that are stuck.
    """
    start: dict[OpKey, float] = {}
    end: dict[OpKey, float] = {}
    pos = {d: 0 for d in orders}
    clock = {d: 0.0 for d in orders}
    waiting: dict[OpKey, list[int]] = {}
    pending = list(orders)
    makespan = 0.0
    while pending:
        d = pending.pop()
        order = orders[d]
        while pos[d] < len(order):
            op = order[pos[d]]
            dep = dependency(op)
            if dep is not None and dep not in end:
                waiting.setdefault(dep, []).append(d)
                break
            ready = 0.0 if dep is None else end[dep]
            key = op.key
            if key in end:
                raise ScheduleError(f"operation {key} is scheduled twice (again on device {d}).")
            begin = max(ready, clock[d])
            finish = begin + duration(op)
            start[key] = begin
            end[key] = clock[d] = finish
            makespan = max(makespan, finish)
            pos[d] += 1
            pending.extend(waiting.pop(key, ()))
    stuck = [orders[d][pos[d]] for d in orders if pos[d] < len(orders[d])]
    if stuck:
        shown = "; ".join(f"device {op.device} waits for {dependency(op)} before {op.key}"
                          for op in stuck[:4])
        raise ScheduleError(
            f"the device orders deadlock: {len(stuck)} device(s) are stuck ({shown}); the "
            "orders must come from device_orders(plan) for a validated plan."
        )
    return Timeline(start=start, end=end, makespan=makespan)


def coupled_makespan(lanes: Sequence[Lane], recompute: Collection[int] = ()) -> float:
    """Makespan of pipelines that share devices, timed in the orders ``device_orders`` gives.

    ``lanes`` in plan order (the order breaks ties between equal nominal starts). Equal to
    ``simulate(device_orders(plan, pipelines), duration).makespan`` for the same pipelines,
    float for float: the recurrence is evaluated once per operation in merge-key order (see
    the module docstring), where ``simulate`` needs ``Op`` objects, dictionaries and a
    worklist; the estimator calls this on every rerouted plan.

    ``recompute``: devices that recompute activations. A backward they run takes its stage's
    ``T_b + T_f`` (the forward runs again), whichever pipeline's micro-batch it is: the flag
    is a device's, so the micro-batches of one dead stage may take different times on
    different peers.
    """
    flagged = frozenset(recompute)
    shapes: dict[tuple[int, int], list[int]] = {}  # lanes of one shape share their groups
    states = []
    devices = 0
    for i, (times, nm, servers) in enumerate(lanes):
        shapes.setdefault((len(times), nm), []).append(i)
        server: list[int] = []
        for srv in servers:
            server.extend(srv * nm if len(srv) == 1 else [srv[m % len(srv)] for m in range(nm)])
        devices = max(devices, max(server, default=0))
        duration = _flat_durations(times, nm)
        if flagged and not flagged.isdisjoint(server):
            duration = _recomputed(duration, times, nm, server, flagged)
        states.append(([0.0] * (2 * len(times) * nm + 1), server, duration))
    by_start: dict[float, list[tuple[list[int], tuple[tuple[int, int, int], ...]]]] = {}
    for shape, members in shapes.items():
        for t, ops in _nominal_groups(*shape):
            by_start.setdefault(t, []).append((members, ops))
    clock = [0.0] * (devices + 1)
    for t in sorted(by_start):
        parts = by_start[t]
        if len(parts) == 1:
            members, ops = parts[0]
            work: Iterable[tuple[int, tuple[tuple[int, int, int], ...]]] = zip(
                members, itertools.repeat(ops))
        else:  # equal starts go in plan order (lane indices are distinct: ops never compared)
            work = sorted((i, ops) for members, ops in parts for i in members)
        for i, ops in work:
            end, server, duration = states[i]
            for own, ready, cell in ops:
                d = server[cell]
                ready_at, free_at = end[ready], clock[d]
                # Not max(): the call costs a third of this hot loop; equal values are equal floats.
                begin = free_at if free_at > ready_at else ready_at  # noqa: FURB136
                end[own] = clock[d] = begin + duration[own]
    return max(clock, default=0.0)


def _recomputed(duration: Sequence[float], times: Sequence[tuple[float, float]], nm: int,
                server: Sequence[int], recompute: Collection[int]) -> tuple[float, ...]:
    """``duration`` (laid out as in ``_flat_durations``) with ``T_f`` added to every backward
    that a recomputing device runs."""
    out = list(duration)
    size = len(times) * nm
    for cell, d in enumerate(server):
        if d in recompute:
            out[size + cell] += times[cell // nm][0]
    return tuple(out)


@lru_cache(maxsize=1 << 14)
def streams_in_flight_peak(streams: tuple[Stream, ...]) -> int:
    """Most micro-batches in flight on a device running these streams merged by nominal start.

    Equal to ``in_flight_peak`` of the device's merged order: a peer runs its own stage
    (period 1, residue 0) plus, per dead stage it serves, the micro-batches its reroute
    gives it. Memoised: thousands of peers share a handful of stream patterns.
    """
    items: list[tuple[float, int, int, int, int]] = []
    for rank, n, s, nm, period, residues in streams:
        nominal_f, nominal_b = _nominal_starts(n, nm)
        for kind, m in one_f_one_b(n, s, nm):
            if m % period in residues:
                if kind == "F":
                    items.append((nominal_f[s][m], rank, s, m, 0))
                else:
                    items.append((nominal_b[s][m], rank, s, m, 1))
    items.sort()
    held = peak = 0
    for *_, backward in items:
        held += -1 if backward else 1
        peak = max(peak, held)
    return peak


def in_flight_peak(order: Sequence[Op], weight: Callable[[Op], float] | None = None) -> float:
    """Most micro-batches (or, with ``weight``, activation bytes) held at once by one order.

    A forward stores its activations until the matching backward of the same stage frees them.
    """
    held = peak = 0.0
    for op in order:
        w = 1.0 if weight is None else weight(op)
        held += w if op.kind == "F" else -w
        peak = max(peak, held)
    return peak


def link_messages(orders: Mapping[int, Sequence[Op]]) -> dict[tuple[int, int], tuple[Op, ...]]:
    """Per ``(sender, receiver)``, the operations whose outputs cross that link, in send order."""
    links: dict[tuple[int, int], list[Op]] = {}
    for d in sorted(orders):
        for op in orders[d]:
            if op.dest is not None:
                links.setdefault((d, op.dest), []).append(op)
    return {k: tuple(v) for k, v in links.items()}


def fifo_violations(orders: Mapping[int, Sequence[Op]]) -> list[tuple[int, int]]:
    """Links on which the receiver consumes messages in another order than they were sent."""
    received: dict[tuple[int, int], list[OpKey]] = {}
    for d in sorted(orders):
        for op in orders[d]:
            dep = dependency(op)
            if op.source is not None and dep is not None:
                received.setdefault((op.source, d), []).append(dep)
    bad = []
    for link, sent in link_messages(orders).items():
        if [op.key for op in sent] != received.get(link, []):
            bad.append(link)
    return bad
