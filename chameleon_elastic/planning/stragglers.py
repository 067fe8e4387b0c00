"""Stragglers: a slow device is one more input to the same performance model.

A device at speed ``s`` (1.0 as profiled, 0.5 half speed) takes ``T / s`` for any work ``T``
(``estimator`` prices plans with such factors). When the measured factors change, the job
chooses among three options, priced by the same estimator and the same score as a failure
(throughput discounted by the transition, ``estimator.score``):

- ``keep``: the layout as it is, the slow device setting the pace; nothing to switch.
- ``reduce``: the same devices in the same pipelines, each pipeline's layers re-split and the
  micro-batch quotas re-allocated for the devices' speeds, so a slow device gets fewer layers
  and its pipeline fewer micro-batches; it costs the layers moved plus the switch.
- ``spare``: a re-plan without the slow devices (``search.replan``), which wait as spares.

A device whose speed is back at 1.0 is simply priced at 1.0 again: ``reduce`` then gives its
work back (a balanced split and quotas) when that beats keeping the reduced layout, and
``spare``, a re-plan over every live device at speed, takes a spared one back in. Whether a
speed change is worth asking about at all (a threshold held for a window of steps,
hysteresis) is the launcher's business; this module is pure, like ``search``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ..plan import ExecutionPlan, Pipeline
from ..spec import JobSpec
from . import estimator
from .allreduce import allreduce_rounds
from .layer_splits import recompute_flags
from .restorer import choose_sources, holdings
from .search import Decision, PlanningError, PolicyChoice, replan

__all__ = ["decide_speeds", "keep_plan", "reduce_plan", "spare_plan"]

Split = tuple[tuple[int, int], ...]


def decide_speeds(spec: JobSpec, current: ExecutionPlan, speeds: Mapping[int, float],
                  policy: PolicyChoice = "auto",
                  before: Mapping[int, float] | None = None) -> Decision:
    """Keep, reduce or spare, by score; ``keep`` wins ties (nothing moves). ``before``: the
    factors ``current`` was planned for (None: all 1.0); when ``speeds`` says the same, the
    layout is kept without a search, so factors that stay at 1.0 never change a plan.
    ``policy`` ``reroute`` only keeps: it never re-plans."""
    now = estimator.slow_only(speeds, current.live_devices)   # a bad factor fails here, named
    candidates = {"keep": keep_plan(spec, current, speeds)}
    rejected: dict[str, str] = {}
    if now == estimator.slow_only(before, current.live_devices):
        rejected["reduce"] = rejected["spare"] = "the speeds are those the plan was made for."
    elif policy in ("auto", "replan"):
        for name, build in (("reduce", reduce_plan), ("spare", spare_plan)):
            try:
                candidates[name] = build(spec, current, speeds)
            except PlanningError as exc:
                rejected[name] = str(exc)
    chosen = max(candidates.values(),
                 key=lambda p: (p.estimate.score, p is candidates["keep"]))
    return Decision(chosen=chosen, candidates=candidates, rejected=rejected)


def keep_plan(spec: JobSpec, current: ExecutionPlan, speeds: Mapping[int, float]
              ) -> ExecutionPlan:
    """``current`` itself (same generation), estimated at these speeds with no transition."""
    est = estimator.evaluate(spec, current, speeds)
    return replace(current, estimate=replace(est, transition_time_s=0.0, score=est.throughput))


def reduce_plan(spec: JobSpec, current: ExecutionPlan, speeds: Mapping[int, float]
                ) -> ExecutionPlan:
    """Every device stays at its pipeline and stage; layer splits and quotas follow the
    speeds (see the module docstring). Raises PlanningError when that changes nothing or the
    layout is rerouted (its dead devices' work is already spread by a rule of its own)."""
    if current.reroute:
        raise PlanningError("a rerouted layout is not re-split; keep it or re-plan without "
                            "the slow device.")
    pipes = current.pipelines
    factors = [tuple(speeds.get(d, 1.0) for d in p.devices) for p in pipes]
    memo: dict[tuple, tuple[float, Split, tuple[bool, ...]]] = {}

    def best(i: int, quota: int) -> tuple[float, Split, tuple[bool, ...]]:
        key = (pipes[i].layers, factors[i], quota)
        if key not in memo:
            memo[key] = _best_split(spec, pipes[i].layers, factors[i], quota)
        return memo[key]

    quotas = _allocate(len(pipes), spec.training.global_micro_batches,
                       lambda i, q: best(i, q)[0])
    if quotas is None:
        raise PlanningError("no split of the layers fits in memory at these quotas.")
    pipelines = []
    for i, (pipe, quota) in enumerate(zip(pipes, quotas)):
        _, split, flags = best(i, quota)
        pipelines.append(Pipeline(pipe.devices, split, quota, flags))
    if tuple(pipelines) == pipes:
        raise PlanningError("the layout is already the best for these speeds.")
    plan = ExecutionPlan("replan", current.generation + 1, tuple(pipelines),
                         spare_devices=current.spare_devices,
                         transfers=_moves(spec, current, pipelines))
    return _estimated(spec, plan, speeds)


def spare_plan(spec: JobSpec, current: ExecutionPlan, speeds: Mapping[int, float]
               ) -> ExecutionPlan:
    """A re-plan over the live devices but the slow ones, which become spares; spares at full
    speed (a straggler back at speed) are planned in. Raises PlanningError when no device is
    slow and none spare, or when only a slow device holds some layer (it would have to come
    from the checkpoint although its holder is alive)."""
    slow = sorted(d for d, f in estimator.slow_only(speeds, current.live_devices).items()
                  if f < 1.0)
    if not slow and not current.spare_devices:
        raise PlanningError("no device is slow and none is spare.")
    if set(slow) >= set(current.live_devices):
        raise PlanningError("every live device is slow; there is no one to leave them to.")
    plan = replan(spec, current, failed=slow)
    if plan.checkpoint_layers:
        raise PlanningError(f"devices {slow} hold the only copy of some layers; keep them.")
    plan = replace(plan, spare_devices=tuple(sorted({*plan.spare_devices, *slow})))
    return _estimated(spec, plan, speeds)


# --------------------------------------------------------------------------- helpers


def _estimated(spec: JobSpec, plan: ExecutionPlan, speeds: Mapping[int, float]
               ) -> ExecutionPlan:
    plan = replace(plan, allreduce_rounds=allreduce_rounds(plan.pipelines, plan.failed_devices))
    plan = replace(plan, estimate=estimator.evaluate(spec, plan, speeds)).validate()
    limit = spec.cluster.device_memory_bytes
    if any(peak > limit for peak in plan.estimate.peak_memory_bytes.values()):
        raise PlanningError("some device would overflow cluster.device_memory_bytes.")
    return plan


def _moves(spec: JobSpec, current: ExecutionPlan, pipelines: Sequence[Pipeline]):
    """The layers each device lacks for its new range, from the live holders (restorer)."""
    live = sorted(current.live_devices)
    held = holdings(current, live)
    needs = {}
    for pipe in pipelines:
        for d, (start, end) in zip(pipe.devices, pipe.layers):
            lacking = [x for x in range(start, end) if not held[d][0] <= x < held[d][1]]
            if lacking:
                needs[d] = lacking
    return choose_sources(spec.model.transfer_bytes, held, needs)


def _time(spec: JobSpec, split: Split, factors: Sequence[float], quota: int
          ) -> tuple[float, tuple[bool, ...]]:
    """Pipeline time of ``split`` at these speeds (inf when it fits no way), and its flags."""
    flags = recompute_flags(spec, split, quota)
    if flags is None:
        return math.inf, ()
    times = []
    for (a, b), flag, f in zip(split, flags, factors):
        tf, tb = estimator.stage_times(spec, a, b, flag)
        times.append((tf / f, tb / f))
    return estimator.pipeline_makespan(tuple(times), quota), flags


def _proportional(layers: int, factors: Sequence[float]) -> Split:
    """Layers in proportion to speed (largest remainders), at least one per stage."""
    n = len(factors)
    share = [layers * f / sum(factors) for f in factors]
    counts = [max(1, int(s)) for s in share]
    order = sorted(range(n), key=lambda s: -(share[s] - int(share[s])))
    k = 0
    while sum(counts) < layers:
        counts[order[k % n]] += 1
        k += 1
    while sum(counts) > layers:
        counts[max(range(n), key=lambda s: counts[s] / factors[s])] -= 1
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return tuple(out)


def _best_split(spec: JobSpec, current: Split, factors: Sequence[float], quota: int
                ) -> tuple[float, Split, tuple[bool, ...]]:
    """The fastest split found by moving one boundary layer at a time from the current split
    and from the speed-proportional one; the current split wins ties (nothing moves)."""
    found = []
    for rank, start in enumerate((current, _proportional(current[-1][1], factors))):
        split = start
        t, flags = _time(spec, split, factors, quota)
        improved = True
        while improved:
            improved = False
            for neighbour in _neighbours(split):
                nt, nflags = _time(spec, neighbour, factors, quota)
                if nt < t - 1e-12:
                    split, t, flags, improved = neighbour, nt, nflags, True
        found.append((t, rank, split, flags))
    t, _, split, flags = min(found)
    return t, split, flags


def _neighbours(split: Split) -> list[Split]:
    """Splits with one layer moved across one stage boundary, every stage keeping one."""
    sizes = [b - a for a, b in split]
    out = []
    for s in range(len(sizes) - 1):
        for give, take in ((s, s + 1), (s + 1, s)):
            if sizes[give] > 1:
                moved = list(sizes)
                moved[give] -= 1
                moved[take] += 1
                bounds, start = [], 0
                for c in moved:
                    bounds.append((start, start + c))
                    start += c
                out.append(tuple(bounds))
    return out


def _allocate(n: int, total: int, time_of) -> list[int] | None:
    """Quotas (one at least each) minimising the slowest pipeline: every further micro-batch
    goes to the pipeline whose time after taking it is least (lowest index on ties)."""
    if total < n:
        return None
    quotas = [1] * n
    heap = [(time_of(i, 2), i) for i in range(n)]
    heapq.heapify(heap)
    for _ in range(total - n):
        t, i = heapq.heappop(heap)
        if math.isinf(t):
            return None
        quotas[i] += 1
        heapq.heappush(heap, (time_of(i, quotas[i] + 1), i))
    if any(math.isinf(time_of(i, q)) for i, q in enumerate(quotas)):
        return None
    return quotas
