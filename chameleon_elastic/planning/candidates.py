"""Candidate layouts of a re-plan: which shapes are tried, how each is filled, what bounds it.

A re-plan walks candidate layouts of the live devices and keeps the one with the least step
time. Building one candidate, and bounding what any layout of its shape can do, depends only on
the job and the shape (pipeline lengths as runs): no device ids, no current holdings, no
policy. So it lives here, between the layer splits below it (``layer_splits``) and the search
above it (``search``), which walks the shapes in order of their bounds (branch and bound),
places the winner on devices and prices it against rerouting and swapping. The simulator's
Oobleck-like model prices its mixes with the same pieces (``balanced_shape``, ``split_counts``,
``allreduce_time_by_class``).

- Shapes (``_candidate_shapes``): Algorithm 1's R_dp x R_pp window, plus (``planner.templates``)
  one balanced cover per pipeline length, at least two pipelines, each also with the remainder
  left spare.
- Filling a shape (``_layout_for``): micro-batch quotas that minimise the slowest pipeline's
  time exactly (greedy marginal allocation, ``_allocate``; the paper's proportional split is
  ``distribute_batches``), each pipeline with its best layer split; the (stages, quota) figures
  are memoised per job across searches (``search.initial_plan`` fills the job's dp x pp shape
  the same way). A candidate is a few runs of identical pipelines (``_Layout``), never spelt
  out per device until it wins.
- Bounds (``_shape_floor`` without simulation, ``_compute_floor`` simulated,
  ``_allreduce_floor``): below the step time of every layout of a shape, so the search can
  skip a shape that cannot win.
- All-reduce per class (``split_counts``, ``allreduce_time_by_class``): a layout of thousands of
  pipelines is priced per class of identical pipelines, never per device.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

from ..plan import ExecutionPlan, Pipeline
from ..spec import JobSpec, ModelProfile
from . import estimator
from .allreduce import class_round_sizes
from .layer_splits import Split, _split_of

__all__ = [
    "Shape",
    "allreduce_time_by_class",
    "balanced_shape",
    "distribute_batches",
    "split_counts",
]

#: Pipeline lengths in slot order as runs: ((length, how many pipelines), ...). Candidate
#: layouts of thousands of pipelines have one or two runs, so nothing below is per pipeline.
Shape = tuple[tuple[int, int], ...]


def balanced_shape(devices: int, dp: int) -> Shape:
    """``dp`` pipelines over ``devices`` devices, lengths differing by at most one, longer
    first."""
    q, r = divmod(devices, dp)
    return tuple((n, k) for n, k in ((q + 1, r), (q, dp - r)) if k)


@dataclass(frozen=True)
class _Layout:
    """A candidate layout on slot numbers, before devices are placed: runs of identical
    pipelines ``(layer split, quota, how many)`` in slot order, the slowest one's time, and
    per run its stages' recomputation flags (a function of split and quota, kept apart so
    that runs stay the classes the all-reduce pricing counts)."""

    runs: tuple[tuple[Split, int, int], ...]
    compute_s: float
    recompute: tuple[tuple[bool, ...], ...] = ()

    @property
    def num_pipelines(self) -> int:
        return sum(count for _, _, count in self.runs)

    @cached_property
    def pipelines(self) -> tuple[Pipeline, ...]:
        """The layout spelt out, slots numbered 0 .. n-1 in order: only for the winner."""
        out: list[Pipeline] = []
        first = 0
        flags = self.recompute or ((),) * len(self.runs)
        for (split, quota, count), recompute in zip(self.runs, flags):
            n = len(split)
            for _ in range(count):
                out.append(Pipeline(tuple(range(first, first + n)), split, quota, recompute))
                first += n
        return tuple(out)


#: (stages, quota) -> (layer split, its recomputation flags, pipeline time) of one job.
_ShapeMemo = dict[tuple[int, int], tuple[Split | None, tuple[bool, ...], float]]


@lru_cache(maxsize=16)
def _shape_memo(spec: JobSpec) -> _ShapeMemo:
    """The (stages, quota) figures of one job, shared by every search on it: they depend on
    nothing else, and a simulation or a launcher's cache runs hundreds of searches, each
    pricing a hundred candidate shapes. Entries are only ever added, with the same value."""
    return {}


def _figures(spec: JobSpec, memo: _ShapeMemo, n: int, q: int
             ) -> tuple[Split | None, tuple[bool, ...], float]:
    """(layer split, its recomputation flags, pipeline time) of ``n`` stages running ``q``
    micro-batches, via ``memo`` (``_shape_memo(spec)``, fetched once by the caller: hashing the
    spec costs more than this)."""
    found = memo.get((n, q))
    if found is None:
        chosen = _split_of(spec, n, q)
        if chosen is None:
            found = memo[(n, q)] = (None, (), math.inf)
        else:
            split, flags = chosen
            found = memo[(n, q)] = (split, flags, estimator.pipeline_time(spec, split, q, flags))
    return found


def _layout_for(spec: JobSpec, shape: Shape) -> _Layout | None:
    """Pipelines of the given shape, each with the layer split and micro-batch quota that
    minimise the slowest pipeline's time; None when the batch or the memory cannot be met."""
    total = spec.training.global_micro_batches
    if sum(count for _, count in shape) > total:
        return None
    memo = _shape_memo(spec)
    runs = _allocate(shape, total, lambda n, q: _figures(spec, memo, n, q)[2])
    if runs is None:
        return None
    figures = [_figures(spec, memo, n, q) for n, q, _ in runs]
    return _Layout(tuple((split, q, count) for (split, _, _), (_, q, count) in zip(figures, runs)),
                   max(t for _, _, t in figures), tuple(flags for _, flags, _ in figures))


def _compute_floor(spec: JobSpec, shape: Shape) -> float:
    """No layout of this shape computes faster: some pipeline takes at least ceil(B / dp)
    micro-batches, and a pipeline's time never drops as its quota grows (more micro-batches in
    flight never need less recomputation)."""
    dp = sum(count for _, count in shape)
    total = spec.training.global_micro_batches
    if dp > total:
        return math.inf
    memo = _shape_memo(spec)
    return min(_figures(spec, memo, n, -(-total // dp))[2] for n, _ in shape)


def _shape_floor(spec: JobSpec, shape: Shape) -> float:
    """No layout of this shape takes less per step, computed without simulating: some
    pipeline runs at least ceil(B / dp) micro-batches, so ``_split_floor`` at that quota for
    the cheapest length, plus ``_allreduce_floor``."""
    dp = sum(count for _, count in shape)
    total = spec.training.global_micro_batches
    if dp > total:
        return math.inf
    quota = -(-total // dp)
    return (min(_split_floor(spec.model, n, quota) for n, _ in shape)
            + _allreduce_floor(spec, shape))


def _split_floor(model: ModelProfile, stages: int, quota: int) -> float:
    """A lower bound on the time of every split the search makes of the model into ``stages``
    stages running ``quota`` micro-batches, recomputing or not (that only lengthens backwards).

    Such a split gives r = L mod N_pp stages ceil(L / N_pp) layers and the others floor(L /
    N_pp), each stage at least the sum of that many of the smallest per-layer figures. Bounds,
    all paths of ``schedule.pipeline_end_floor`` or the 1F1B closed form at those minima: a
    long stage's backwards after micro-batch 0's round trip; the last long stage's whole order
    after the r - 1 long stages before it (and likewise the last short one); identical stages
    as short as a stage can be."""
    total, forward, backward, both = _layer_floors(model)
    most, least = -(-model.layers // stages), model.layers // stages
    extra = model.layers % stages
    return max(total + (quota - 1) * backward[most],
               (extra - 1 + quota) * both[most] if extra else 0.0,
               (stages - extra - 1 + quota) * both[least],
               (stages + quota - 1) * (forward[least] + backward[least]))


@lru_cache(maxsize=16)
def _layer_floors(model: ModelProfile) -> tuple[float, tuple[float, ...], tuple[float, ...],
                                                  tuple[float, ...]]:
    """(sum of every layer's T_f + T_b, and prefix sums of the smallest T_f, T_b and T_f + T_b:
    entry k sums the k smallest)."""
    def prefix(values: Iterable[float]) -> tuple[float, ...]:
        return (0.0, *itertools.accumulate(sorted(values)))

    return (math.fsum(model.forward_s) + math.fsum(model.backward_s), prefix(model.forward_s),
            prefix(model.backward_s),
            prefix(f + b for f, b in zip(model.forward_s, model.backward_s)))


def _allreduce_floor(spec: JobSpec, shape: Shape) -> float:
    """No layout of this shape reduces its gradients faster: every layer has one holder per
    pipeline, a device's buckets go in distinct rounds, and the longest pipeline has a stage
    holding at least 1 / N_pp of the gradient bytes, summed over dp devices in those rounds."""
    dp = sum(count for _, count in shape)
    longest = max(n for n, _ in shape)
    return estimator.ring_seconds(math.fsum(spec.model.param_bytes) / longest, dp,
                                  spec.cluster.bandwidth_bytes_per_s)


def distribute_batches(lengths: Sequence[int], total: int) -> tuple[int, ...]:
    """The paper's batch distribution: proportional to pipeline length, leftovers one at a time
    round the pipelines (longest first), then no pipeline left idle."""
    n_dev = sum(lengths)
    quotas = [total * n // n_dev for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    left = total - sum(quotas)
    for k in range(left):
        quotas[order[k % len(order)]] += 1
    while 0 in quotas and total >= len(quotas):
        idle = quotas.index(0)
        donor = max(range(len(quotas)), key=lambda i: (quotas[i], -i))
        quotas[donor] -= 1
        quotas[idle] += 1
    return tuple(quotas)



def _allocate(shape: Shape, total: int, time_of: Callable[[int, int], float]
              ) -> list[tuple[int, int, int]] | None:
    """Micro-batch quotas (at least one each) that minimise the slowest pipeline's time, as
    runs ``(length, quota, how many)`` in slot order.

    Greedy marginal allocation: every micro-batch beyond the first of each pipeline goes to the
    pipeline whose time after taking it is least (longer pipelines first on ties). Because a
    pipeline's time never drops when its quota grows, this reaches the optimal maximum: if
    a step ever had to exceed the optimum, every pipeline would already hold at least its
    quota in an optimal allocation, and the batch would be complete. Pipelines of one length
    are interchangeable, so a whole quota level of a length class is handed out at once, in
    slot order: the loop runs per level, not per micro-batch, which keeps the search
    fast at thousands of pipelines. This replaces the paper's proportional split (which
    ``distribute_batches`` keeps) and can only lower the step time.
    """
    counts: dict[int, int] = {}
    for n, k in shape:
        counts[n] = counts.get(n, 0) + k
    if any(time_of(n, 1) == math.inf for n in counts):
        return None
    base = dict.fromkeys(counts, 1)  # every member of class n has base[n] or base[n] + 1
    ahead = dict.fromkeys(counts, 0)  # how many (the first in slot order) have base + 1
    left = total - sum(counts.values())
    while left > 0:
        n = min(counts, key=lambda c: (time_of(c, base[c] + 1), -c))
        if time_of(n, base[n] + 1) == math.inf:
            return None
        give = min(counts[n] - ahead[n], left)
        ahead[n] += give
        left -= give
        if ahead[n] == counts[n]:
            base[n], ahead[n] = base[n] + 1, 0
    runs = []
    for n, k in shape:
        plus = min(k, ahead[n])  # the class's first ``ahead`` pipelines take one more
        ahead[n] -= plus
        runs.extend((n, q, c) for q, c in ((base[n] + 1, plus), (base[n], k - plus)) if c)
    return runs


def _candidate_shapes(spec: JobSpec, current: ExecutionPlan, live: int) -> list[Shape]:
    """Algorithm 1's window, then (``planner.templates``) one cover per pipeline length.

    Window (the paper's): dp within R_dp of the current pipeline count, lengths within R_pp of
    the current ones, the live devices split evenly (or the largest multiple of dp used, the
    rest spare). Templates (Oobleck's idea): for every pipeline length n, the even covers by
    floor(live / n) and ceil(live / n) pipelines, and again with the remainder spare, whenever
    that makes at least two pipelines. The window alone cannot leave the neighbourhood of the
    first layout, however poor that layout is once all-reduce is priced; templates can, and
    the floor of two pipelines keeps every layer on two devices, so the next failure can still
    be rerouted instead of restarting from a checkpoint (a single pipeline is fastest by the
    estimator, no all-reduce, but loses a layer at any failure).
    """
    dp0 = len(current.pipelines)
    lengths_now = [p.num_stages for p in current.pipelines]
    lo = max(1, min(lengths_now) - spec.planner.pp_radius)
    hi = min(spec.model.layers, max(lengths_now) + spec.planner.pp_radius)
    found: list[Shape] = []

    def add(dp: int, shortest: int, longest: int) -> None:
        for used in {live, live - live % dp}:
            if used < dp:
                continue
            shape = balanced_shape(used, dp)
            if shortest <= shape[-1][0] and shape[0][0] <= longest and shape not in found:
                found.append(shape)

    for dp in range(max(1, dp0 - spec.planner.dp_radius), dp0 + spec.planner.dp_radius + 1):
        add(dp, lo, hi)
    if spec.planner.templates:
        for n in range(1, spec.model.layers + 1):
            for dp in sorted({live // n, -(-live // n)}):
                if 2 <= dp <= spec.training.global_micro_batches:
                    add(dp, 1, spec.model.layers)
    return found


def _allreduce_s(spec: JobSpec, layout: _Layout) -> float:
    return allreduce_time_by_class(spec, split_counts(layout.runs))


def split_counts(runs: Iterable[tuple[Split, int, int]]) -> dict[tuple[Split, tuple[int, ...]], int]:
    """Pipelines per layer split (no dead stages) of runs ``(split, quota, how many)``: the
    classes ``allreduce_time_by_class`` prices."""
    counts: dict[tuple[Split, tuple[int, ...]], int] = {}
    for split, _, count in runs:
        counts[(split, ())] = counts.get((split, ()), 0) + count
    return counts


def allreduce_time_by_class(spec: JobSpec, counts: Mapping[tuple[Split, tuple[int, ...]], int]
                            ) -> float:
    """``estimator.allreduce_time`` of the rounds the restorer builds for pipelines given as a
    count per class ((layer split, dead stages) -> how many): a search prices many layouts of
    thousands of pipelines before building any (the Oobleck model's search too)."""
    return math.fsum(max((estimator.ring_time(spec, layers, n) for layers, n in rnd), default=0.0)
                     for rnd in class_round_sizes(counts))
