"""Peak memory: what each device holds at its busiest under a plan, and whether that fits.

The estimator prices how fast a plan trains; before that, the planner must know whether the plan
can run at all. A stage that does not fit its device rules out a layer split, decides which
stages and which peers of a reroute must recompute, and rules out a baseline's template. That
question has its own figures (bytes, not seconds: resident state, activations, micro-batches in
flight) and its own callers (the search's recomputation choice, the simulator's baselines), so
it lives here; ``estimator.evaluate`` reads ``peak_memory`` from it. It sits below the
estimator, so it also holds what both check with: ``EstimatorError``, a layer range inside the
model, a plan made for the job it is priced with.

Peak memory of a working device: resident ``2 * param + optimizer`` bytes per held layer, plus
its layers' activations times the most micro-batches in flight on it: ``min(N_pp - i, N_m)``
at stage ``i`` under plain 1F1B (the paper's ``(N_pp - i) N_l_i m_a``), and counted from its
merged order for a peer that also serves a dead device's micro-batches
(``schedule.streams_in_flight_peak``, memoised per pattern of served streams).

Recomputation and precision (docs/estimator.md has the formulas). A device whose stage
recomputes (``Pipeline.recompute``) keeps per micro-batch in flight only its input, the
boundary bytes of the layer before its first (nothing at layer 0: the input is data), plus
one micro-batch's full activations while it recomputes before a backward. The flag is the
device's, so a peer holds the micro-batches it absorbs with its own flag. Parameters,
gradients and optimizer state are fp32 master copies as given; activation and boundary bytes
scale by the element size of ``training.precision`` over that of ``model.precision``; below
fp32 a device also holds autocast's half-size copy of its weights.

Like the estimator's, every figure here is a pure function of its arguments, memoised where a
search asks for the same few layer ranges thousands of times.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import lru_cache

from ..plan import ExecutionPlan
from ..spec import ELEMENT_BYTES, JobSpec, ModelProfile
from .schedule import Stream, streams_in_flight_peak

__all__ = [
    "EstimatorError",
    "fits_in_memory",
    "in_flight",
    "peak_memory",
    "pipeline_fits",
    "stage_memory",
]


class EstimatorError(ValueError):
    """A plan the estimator cannot price (it does not fit the job spec)."""


# --------------------------------------------------------------------------- a stage


def stage_memory(spec: JobSpec, start: int, end: int, in_flight: int,
                 recompute: bool = False) -> float:
    """Peak bytes of a device holding layers ``[start, end)`` with ``in_flight`` micro-batches.

    Layer state ``2 * param + optimizer`` (plus autocast's weight copy below fp32) and then,
    without recomputation, the activations of ``in_flight`` micro-batches; stage ``i`` of a
    plain 1F1B pipeline has ``min(N_pp - i, N_m)`` in flight, which gives the paper's
    ``N_l (m_p + m_o + m_g) + (N_pp - i) N_l m_a`` when ``N_m >= N_pp``. With recomputation,
    only the stage's input (``boundary_bytes`` of layer ``start - 1``) per micro-batch in
    flight, plus one micro-batch's activations rebuilt for the backward under way.
    """
    resident, activation, boundary = _stage_bytes(spec.model, spec.training.precision,
                                                  start, end)
    if not recompute:
        return resident + in_flight * activation
    return resident + in_flight * boundary + (activation if in_flight > 0 else 0.0)


def pipeline_fits(spec: JobSpec, layers: Sequence[tuple[int, int]], micro_batches: int,
                  recompute: Sequence[bool] | None = None) -> bool:
    """True if every stage of a plain 1F1B pipeline holding ``layers`` fits in device memory
    (stage ``i`` holds ``min(N_pp - i, N_m)`` micro-batches in flight); ``recompute`` gives the
    stages' flags (None: no stage recomputes)."""
    memory = spec.cluster.device_memory_bytes
    n = len(layers)
    flags = recompute if recompute is not None else (False,) * n
    return all(stage_memory(spec, a, b, min(n - i, micro_batches), r) <= memory
               for i, ((a, b), r) in enumerate(zip(layers, flags)))


# --------------------------------------------------------------------------- a whole plan


def peak_memory(spec: JobSpec, plan: ExecutionPlan) -> dict[int, float]:
    """Peak bytes per working device (spares and dead devices are absent), each device with its
    own stage's recomputation flag."""
    _check_plan(spec, plan)
    memo: dict[tuple[int, int, int, bool], float] = {}  # a few distinct stages, many devices

    def memory(layers: tuple[int, int], in_flight: int, recompute: bool) -> float:
        key = (*layers, in_flight, recompute)
        if key not in memo:
            memo[key] = stage_memory(spec, *layers, in_flight, recompute)
        return memo[key]

    # Per pipeline shape. Keyed by the identity of the split and flag tuples, which the
    # pipelines of one layout share (the plan keeps them alive): hashing their contents for
    # each of thousands of pipelines would cost more than the rest of this loop.
    plain: dict[tuple[int, int, int], list[float]] = {}
    shapes = [(id(pipe.layers), pipe.micro_batches, id(pipe.recompute)) for pipe in plan.pipelines]
    for pipe, shape in zip(plan.pipelines, shapes):  # plain 1F1B: min(N_pp - s, N_m) in flight
        if shape not in plain:
            n = pipe.num_stages
            plain[shape] = [memory(rng, min(n - s, pipe.micro_batches), r)
                            for s, (rng, r) in enumerate(zip(pipe.layers, pipe.recompute))]
    chain = itertools.chain.from_iterable
    out = dict(zip(chain(pipe.devices for pipe in plan.pipelines), chain(map(plain.get, shapes))))
    # A peer's foreign activations are of its own layers: count its micro-batches in flight.
    for d, (layers, recompute, streams) in _served_streams(plan).items():
        out[d] = memory(layers, streams_in_flight_peak(streams), recompute)
    for d in plan.failed_devices:
        out.pop(d, None)
    order = sorted(out)
    return out if order == list(out) else {d: out[d] for d in order}


def in_flight(plan: ExecutionPlan) -> dict[int, int]:
    """Most micro-batches in flight on each working device: ``min(N_pp - i, N_m)`` at stage
    ``i`` of plain 1F1B, counted from the merged order for a peer serving a dead device. The
    planner uses it to decide which peers of a reroute must recompute to fit."""
    out = {d: min(p.num_stages - s, p.micro_batches)
           for p in plan.pipelines for s, d in enumerate(p.devices)}
    out.update({d: count for d, (_, _, count) in _peer_loads(plan).items()})
    for d in plan.failed_devices:
        out.pop(d, None)
    return {d: out[d] for d in sorted(out)}


def fits_in_memory(spec: JobSpec, plan: ExecutionPlan) -> bool:
    """True if no working device's estimated peak exceeds the device memory."""
    limit = spec.cluster.device_memory_bytes
    return all(m <= limit for m in peak_memory(spec, plan).values())


# --------------------------------------------------------------------------- helpers


@lru_cache(maxsize=1 << 16)
def _stage_bytes(model: ModelProfile, precision: str, start: int, end: int
                 ) -> tuple[float, float, float]:
    """``(resident, activations per micro-batch, input per micro-batch)`` bytes of layers
    [start, end) when training at ``precision``.

    Resident: the fp32 state ``2 * param + optimizer`` and, below fp32, autocast's copy of the
    weights at the training precision (``param * element / 4``; ``param_bytes`` are fp32).
    Activations and the input (``boundary_bytes`` of layer ``start - 1``; 0 at layer 0, whose
    input is data) scale from the model's precision to the training one.
    """
    _check_range(model, start, end)
    element = ELEMENT_BYTES[precision]
    scale = element / ELEMENT_BYTES[model.precision]
    resident = math.fsum(model.state_bytes(layer) for layer in range(start, end))
    if element < ELEMENT_BYTES["fp32"]:
        resident += math.fsum(model.param_bytes[start:end]) * element / ELEMENT_BYTES["fp32"]
    boundary = model.boundary_figures[start - 1] if start > 0 else 0.0
    return resident, scale * math.fsum(model.activation_bytes[start:end]), scale * boundary


def _check_range(model: ModelProfile, start: int, end: int) -> None:
    if not 0 <= start < end <= model.layers:
        raise EstimatorError(
            f"layer range [{start}, {end}) is not a non-empty part of the model's "
            f"{model.layers} layers; use 0 <= start < end <= {model.layers}."
        )


def _check_plan(spec: JobSpec, plan: ExecutionPlan) -> None:
    if plan.num_layers != spec.model.layers:
        raise EstimatorError(
            f"the plan splits {plan.num_layers} layers but the job's model has "
            f"{spec.model.layers}; plan with the same job spec you estimate with."
        )


def _peer_loads(plan: ExecutionPlan) -> dict[int, tuple[tuple[int, int], bool, int]]:
    """Per peer device serving a dead device: its layers, its own recomputation flag (which it
    applies to the micro-batches it absorbs too) and its most micro-batches in flight."""
    return {d: (layers, flag, streams_in_flight_peak(streams))
            for d, (layers, flag, streams) in _served_streams(plan).items()}


def _served_streams(plan: ExecutionPlan
                    ) -> dict[int, tuple[tuple[int, int], bool, tuple[Stream, ...]]]:
    """Per peer device, its layers, its recomputation flag and its streams: its own stage plus
    the parts of the dead stages it serves.

    Pipelines are ranked among those the device touches (ties in nominal start go by pipeline
    index), which makes equal patterns at different places share ``streams_in_flight_peak``.
    """
    parts: dict[int, dict[int, list[int]]] = {}  # peer -> reroute index -> its positions
    for i, r in enumerate(plan.reroute):
        for j, share in enumerate(r.peers):
            parts.setdefault(share.device, {}).setdefault(i, []).append(j)
    pipes = plan.pipelines
    dead_stage = [(r.pipeline, (pipes[r.pipeline].num_stages, r.stage,
                                pipes[r.pipeline].micro_batches, len(r.peers)))
                  for r in plan.reroute]
    out: dict[int, tuple[tuple[int, int], bool, tuple[Stream, ...]]] = {}
    for p, pipe in enumerate(pipes):
        if parts.keys().isdisjoint(pipe.devices):  # most pipelines serve nobody
            continue
        for s, d in enumerate(pipe.devices):
            mine = parts.get(d)
            if mine is None:
                continue
            own = (pipe.num_stages, s, pipe.micro_batches, 1, (0,))
            if len(mine) == 1:  # the usual peer: its own stage and one dead stage
                ((i, positions),) = mine.items()
                q, shape = dead_stage[i]
                other = (*shape, tuple(positions))
                if p != q:
                    out[d] = (pipe.layers[s], pipe.recompute[s],
                              ((0, *own), (1, *other)) if p < q else ((0, *other), (1, *own)))
                    continue
            found = [(p, *own)]
            found.extend((dead_stage[i][0], *dead_stage[i][1], tuple(js))
                         for i, js in mine.items())
            found.sort()
            ranked: list[Stream] = []
            rank, previous = -1, -1
            for q, *rest in found:  # pipeline index -> rank among the ones found
                if q != previous:
                    rank, previous = rank + 1, q
                ranked.append((rank, *rest))
            out[d] = (pipe.layers[s], pipe.recompute[s], tuple(ranked))
    return out
