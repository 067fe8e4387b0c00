"""Plan search and policy choice: the decision centre's pure core.

At every failure the job may *reroute* (keep the layout; each lost device's micro-batches go
round-robin to the live devices holding the same layers), *swap* (keep the layout; a standby, a
live device beyond the job's size ``training.dp x training.pp``, takes each lost device's place
and receives its stage: ``swap_plan``; priced only when a standby is live) or *re-plan* (a new
layout over the live devices, possibly asymmetric, never on more devices than the job's size).
``decide`` builds each, prices it with the estimator, and keeps the one with the best

    score = throughput x t_run / (t_transition + t_run)

where t_run is the expected time to the next failure. Everything here is a pure function of
(spec, current plan, event): the simulator and the launcher call the same code, and
``chameleon-plan`` previews it offline.

Re-planning follows the paper's Algorithm 1 with three additions that only ever help:
- candidates are the balanced partitions of the live devices into dp pipelines for every dp in
  R_dp (lengths in R_pp), plus the same with the remainder left spare (a symmetric layout can
  beat an asymmetric one once all-reduce is priced);
- pipeline-length templates (``planner.templates``, on by default): one balanced cover per
  pipeline length, at least two pipelines, so a re-plan can leave a poor initial layout behind
  (``_candidate_shapes`` says why the floor of two);
- micro-batch quotas minimise the slowest pipeline's time exactly (greedy marginal
  allocation, ``_allocate``) instead of the paper's proportional split.

The wider candidate set stays cheap: a candidate is a few runs of identical pipelines, priced
per class, never per device; candidates are allocated in order of a compute floor and dropped
once the floor cannot beat the best step found (branch and bound); with identical layers the
C(N_pp, r) layer splits shrink to three structured ones. Each shortcut is tested against the
plain computation it replaces (tests/planning/test_search_candidates.py).

``decide`` prices the re-plan's layout before placing it: the layout fixes its step time, and
its transition is at least ``cluster.switch_s``, so when even that bound cannot beat rerouting
the costly placement (assignment, weight sources) is skipped. The chosen plan is the same.

When a stage lost every replica, rerouting is impossible and the re-plan loads the layers no
live device holds from the checkpoint (``ExecutionPlan.checkpoint_layers``): still an ordinary
candidate, priced like any other.

Recomputation (``planner.recompute``). Wherever a layer split would be dropped because a stage
overflows, ``auto`` first tries that stage with recomputation (``stage_recompute``): the split
survives with the slower backward priced in, so it competes on time with splits that need
none; among splits equally fast, fewer recomputing stages win. ``never`` is the search as it
was; ``always`` recomputes every stage. A reroute keeps the layout's flags, except that under
``auto`` (and ``always``) a peer that would overflow with the micro-batches it absorbs turns
recomputation on when that makes it fit; a peer that fits even so stays as it was, and one
that fits neither way makes rerouting impossible, as before.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Literal

from ..plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from ..spec import PER_LAYER_KEYS, JobSpec, ModelProfile
from . import estimator, memory, snapshots
from .allreduce import allreduce_rounds, class_round_sizes
from .restorer import choose_sources, holdings, place

__all__ = [
    "Decision",
    "PlanningError",
    "PolicyChoice",
    "allreduce_time_by_class",
    "balanced_shape",
    "compact_ids",
    "decide",
    "distribute_batches",
    "initial_plan",
    "recompute_flags",
    "replan",
    "reroute_plan",
    "split_counts",
    "split_layers",
    "stage_recompute",
    "swap_plan",
]

PolicyChoice = Literal["auto", "reroute", "replan"]

# C(N_pp, r) layer splits are enumerated exactly up to this many; beyond it (very long
# pipelines) only the structured choices are tried (exact for uniform layers, see
# ``_split_layers_cached``).
MAX_SPLIT_ENUMERATION = 2048

# Lower bounds are summed in another order than the figures they bound: a candidate is skipped
# only when its bound, lowered by this relative margin, still cannot beat the best one.
FLOOR_MARGIN = 1e-9


class PlanningError(Exception):
    """An impossible request; the message is one sentence naming the problem and the fix."""


@dataclass(frozen=True)
class Decision:
    """The chosen plan, every policy that was priced, and why the others were not possible."""

    chosen: ExecutionPlan
    candidates: dict[str, ExecutionPlan] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- building blocks


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


def _ranges(sizes: Iterable[int]) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return tuple(out)


def _structured_choices(stages: int, extra: int) -> list[tuple[int, ...]]:
    """Which stages get a leftover layer: the first ones, evenly spaced, or the last ones
    (least activation memory), in the order ``itertools.combinations`` would visit them."""
    step = stages / extra if extra else 1.0
    return sorted({tuple(range(extra)), tuple(sorted({int(i * step) for i in range(extra)})),
                   tuple(range(stages - extra, stages))})


def _uniform(model: ModelProfile) -> bool:
    return (all(len(set(getattr(model, key))) <= 1 for key in PER_LAYER_KEYS)
            and len(set(model.boundary_figures)) <= 1)


def stage_recompute(spec: JobSpec, start: int, end: int, in_flight: int) -> bool | None:
    """Whether a stage holding layers ``[start, end)`` with ``in_flight`` micro-batches
    recomputes under ``planner.recompute``, or None when it fits in device memory neither way
    the policy allows: ``never`` only without, ``always`` only with, ``auto`` without when that
    fits (recomputation costs a forward per backward), else with."""
    limit = spec.cluster.device_memory_bytes
    policy = spec.planner.recompute
    if policy != "always" and memory.stage_memory(spec, start, end, in_flight) <= limit:
        return False
    if policy != "never" and memory.stage_memory(spec, start, end, in_flight, True) <= limit:
        return True
    return None


def recompute_flags(spec: JobSpec, layers: Sequence[tuple[int, int]], micro_batches: int
                    ) -> tuple[bool, ...] | None:
    """Per stage of a plain 1F1B pipeline holding ``layers`` (stage ``i`` with
    ``min(N_pp - i, N_m)`` micro-batches in flight), ``stage_recompute``; None when some stage
    fits in no way the policy allows, which is what drops a split from the search."""
    n = len(layers)
    flags = []
    for i, (a, b) in enumerate(layers):
        flag = stage_recompute(spec, a, b, min(n - i, micro_batches))
        if flag is None:
            return None
        flags.append(flag)
    return tuple(flags)


@lru_cache(maxsize=4096)
def _split_layers_cached(spec: JobSpec, stages: int, quota: int
                         ) -> tuple[Split, tuple[bool, ...]] | None:
    base, extra = divmod(spec.model.layers, stages)
    unchecked = (spec.planner.recompute == "always",) * stages  # the flags if memory were free

    def fastest(choices: Iterable[Collection[int]], must_fit: bool = True):
        """The first split (in the given order) with the least pipeline time, and its flags;
        on equal times the one with fewer recomputing stages."""
        best, best_key = None, (math.inf, math.inf)
        for chosen in choices:
            picked = set(chosen)
            layers = _ranges(base + (1 if s in picked else 0) for s in range(stages))
            flags = recompute_flags(spec, layers, quota) if must_fit else unchecked
            if flags is None:
                continue
            n = sum(flags)
            if best is not None and _cannot_win(
                    estimator.pipeline_time_floor(spec, layers, quota, flags), n, best_key):
                continue  # its time could neither beat nor tie the best: not simulated
            t = estimator.pipeline_time(spec, layers, quota, flags)
            if t < best_key[0] - 1e-12 or (t <= best_key[0] + 1e-12 and n < best_key[1]):
                best, best_key = (layers, flags), (t, n)
        return best

    structured = _structured_choices(stages, extra)
    if _uniform(spec.model):
        # With identical layers the fastest split is always a structured one, and the very one
        # the enumeration below picks, ties included (test_search_candidates.py checks both):
        # when that split fits with the flags it would have in unlimited memory, no split can
        # be faster (recomputation only slows one down) and the C(N_pp, r) walk is not needed.
        best = fastest(structured, must_fit=False)
        if best is not None and recompute_flags(spec, best[0], quota) == unchecked:
            return best
    if math.comb(stages, extra) <= MAX_SPLIT_ENUMERATION:
        return fastest(itertools.combinations(range(stages), extra))
    return fastest(structured)


def _cannot_win(floor: float, recomputing: int, best_key: tuple[float, float]) -> bool:
    """Whether a split whose time is at least ``floor`` (``pipeline_time_floor``) and that
    recomputes on ``recomputing`` stages would lose to ``best_key`` in ``fastest``'s test:
    it replaces the best when faster by 1e-12, or within 1e-12 with fewer recomputing stages."""
    low = floor * (1.0 - FLOOR_MARGIN)
    best_t, best_n = best_key
    return low >= best_t - 1e-12 and (recomputing >= best_n or low > best_t + 1e-12)


def split_layers(spec: JobSpec, stages: int, quota: int) -> tuple[tuple[int, int], ...] | None:
    """Even split; the r = L mod N_pp leftover layers go to the choice of stages that fits in
    memory (recomputing where ``planner.recompute`` says, ``recompute_flags``) with the least
    pipeline time; None when no choice fits."""
    found = _split_of(spec, stages, quota)
    return None if found is None else found[0]


def _split_of(spec: JobSpec, stages: int, quota: int) -> tuple[Split, tuple[bool, ...]] | None:
    """``split_layers`` with the split's recomputation flags."""
    if stages > spec.model.layers or stages < 1:
        return None
    return _split_layers_cached(spec, stages, max(quota, 1))


#: Pipeline lengths in slot order as runs: ((length, how many pipelines), ...). Candidate
#: layouts of thousands of pipelines have one or two runs, so nothing below is per pipeline.
Shape = tuple[tuple[int, int], ...]
#: A layer split, one [start, end) per stage.
Split = tuple[tuple[int, int], ...]


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


def _finish(spec: JobSpec, plan: ExecutionPlan) -> ExecutionPlan:
    """Attach all-reduce rounds and the estimate: the last step of every plan we emit."""
    rounds = allreduce_rounds(plan.pipelines, plan.failed_devices)
    plan = replace(plan, allreduce_rounds=rounds)
    return replace(plan, estimate=estimator.evaluate(spec, plan)).validate()


def _recompute_note(spec: JobSpec) -> str:
    """What the memory check allowed, for the no-fit sentences."""
    return {"auto": ", even with recomputation", "always": ", with recomputation",
            "never": ", planner.recompute = never"}[spec.planner.recompute]


def _memory_ok(spec: JobSpec, plan: ExecutionPlan) -> tuple[bool, str]:
    """Device memory (the estimate's peaks), then the host memory the plan's snapshots take."""
    peaks = plan.estimate.peak_memory_bytes
    limit = spec.cluster.device_memory_bytes
    device = max(peaks, key=peaks.__getitem__)  # the first busiest, as max() over items gives
    peak = peaks[device]
    if peak > limit:
        return False, (f"device {device} would need {peak / 1e9:.2f} GB but "
                       f"cluster.device_memory_bytes is {limit / 1e9:.2f} GB")
    problem = snapshots.host_memory_problem(spec, plan)
    return (False, problem) if problem else (True, "")


def _with_snapshots(spec: JobSpec, current: ExecutionPlan, failed: Collection[int],
                    plan: ExecutionPlan) -> ExecutionPlan:
    """A re-plan that loads lost layers from the checkpoint takes them from a live
    partner's in-memory snapshot where one keeps them, priced with the steps trained again
    (``planning.snapshots``); its step time and memory do not change."""
    taken = snapshots.from_snapshots(spec, current, failed, plan)
    if taken is plan or plan.estimate is None:
        return plan
    was = plan.estimate
    transition = estimator.transition_time(spec, taken, was.step_time_s)
    run = spec.cluster.expected_run_s(len(taken.live_devices))
    return replace(taken, estimate=replace(
        was, transition_time_s=transition,
        score=estimator.score(was.throughput, transition, run))).validate()


# --------------------------------------------------------------------------- plans


def initial_plan(spec: JobSpec) -> ExecutionPlan:
    """The job's starting layout: training.dp pipelines of training.pp stages, device p*pp+s;
    devices beyond dp x pp are spare."""
    dp, pp = spec.training.dp, spec.training.pp
    layout = _layout_for(spec, ((pp, dp),))
    if layout is None:
        raise PlanningError(
            f"the model does not fit the initial layout dp={dp} x pp={pp}: some stage exceeds "
            f"cluster.device_memory_bytes = {spec.cluster.device_memory_bytes:g}"
            f"{_recompute_note(spec)}; raise training.pp (more stages, fewer layers each) or "
            "the device memory."
        )
    pipelines = tuple(
        replace(p, devices=tuple(i * pp + s for s in range(pp)))
        for i, p in enumerate(layout.pipelines)
    )
    spare = tuple(range(dp * pp, spec.cluster.devices))
    plan = _finish(spec, ExecutionPlan("initial", 0, pipelines, spare_devices=spare))
    problem = snapshots.host_memory_problem(spec, plan)
    if problem:
        raise PlanningError(
            f"the initial layout's in-memory snapshots do not fit: {problem}; raise "
            "cluster.host_memory_bytes, spread the devices over more nodes "
            "(cluster.devices_per_node), or take no snapshots ([recovery] snapshot_every = 0).")
    return plan


def resolve_snapshots(spec: JobSpec) -> JobSpec:
    """``spec`` with its snapshot interval decided: the job's (``[recovery] snapshot_every``,
    ``--snapshot-every``), else the default for its initial layout
    (``snapshots.default_every``); none where a recovery restarts every process (their memory
    goes with them) or under tensor parallelism (not yet supported)."""
    if spec.recovery.snapshot_every is not None:
        return spec
    if snapshots.why_none(spec):
        return spec.with_snapshot_every(0)
    return spec.with_snapshot_every(snapshots.default_every(spec, initial_plan(spec)))


#: how a rejection names its rival
_NAMES = {"reroute": "rerouting", "swap": "swapping standbys in", "replan": "re-planning"}


def _swappable(current: ExecutionPlan, failed: Collection[int], joined: Collection[int]) -> bool:
    """A device of the layout is dead (lost now, or left dead by a reroute) and a standby (a
    live spare, or a device back) is there to take its place."""
    standby = (set(current.spare_devices) - set(failed)) | set(joined)
    dead = bool(current.failed_devices) or not set(failed).isdisjoint(current.working_devices)
    return dead and bool(standby)


def swap_plan(spec: JobSpec, current: ExecutionPlan, failed: Collection[int],
              joined: Collection[int] = ()) -> ExecutionPlan:
    """Keep the layout and its throughput: every dead device of the layout (lost now, or left
    dead by an earlier reroute) is replaced by a standby, a live spare device (one beyond the
    job's size, ``TrainingSpec.size``, or a device back), lowest ids paired first. Each standby
    receives its stage's layers with their optimizer state from live replicas (spread over
    them as a re-plan's sources are, ``restorer.choose_sources``), else from the checkpoint,
    which ``decide`` turns into a snapshot where a live partner keeps one. So a swap costs one
    stage's transfer and a regroup, where a reroute costs throughput for as long as it runs and
    a re-plan moves more layers to run on fewer devices."""
    failed_set = set(failed)
    dead = sorted(set(current.failed_devices) | (failed_set & set(current.working_devices)))
    standbys = sorted((set(current.spare_devices) - failed_set) | set(joined))
    if not dead:
        raise PlanningError("cannot swap: no device of the layout was lost.")
    if len(standbys) < len(dead):
        raise PlanningError(
            f"cannot swap: {len(dead)} device(s) of the layout are lost but only "
            f"{len(standbys)} standby device(s) are live; start more standby nodes "
            "(cluster.devices beyond training.dp x training.pp).")
    into = dict(zip(dead, standbys))
    where = _positions_of(current, into)
    needs = {into[d]: list(range(*current.pipelines[p].layers[s])) for d, (p, s) in where.items()}
    live = sorted((set(current.live_devices) - failed_set) | set(joined))
    transfers = choose_sources(spec.model.transfer_bytes, holdings(current, live), needs)
    pipelines = tuple(replace(p, devices=tuple(into.get(d, d) for d in p.devices))
                      if not into.keys().isdisjoint(p.devices) else p for p in current.pipelines)
    plan = _finish(spec, ExecutionPlan("swap", current.generation + 1, pipelines,
                                       spare_devices=tuple(standbys[len(dead):]),
                                       transfers=transfers))
    ok, why = _memory_ok(spec, plan)
    if not ok:
        raise PlanningError(f"cannot swap: {why}.")
    return plan


def reroute_plan(spec: JobSpec, current: ExecutionPlan, failed: Collection[int],
                 joined: Collection[int] = ()) -> ExecutionPlan:
    """Keep the layout; every dead device's micro-batches go round-robin to its live peers
    (devices holding exactly its layers in other pipelines). Joined devices become spares.

    The policy of the result is always ``reroute``: the layout is kept, nothing moves, so the
    transition costs nothing even when the event only touched spares.
    """
    back_in_layout = set(joined) & set(current.failed_devices)
    if back_in_layout:
        raise PlanningError(
            f"cannot reroute: device(s) {compact_ids(sorted(back_in_layout))} came back but still "
            "sit dead in the layout without their layers; re-plan to use them."
        )
    dead_spares = set(failed) & set(current.spare_devices)
    dead = tuple(sorted(set(current.failed_devices) | (set(failed) - dead_spares)))
    dead_set = set(dead)
    where = _positions_of(current, dead_set)
    holders = _live_holders(current, {current.pipelines[p].layers[s] for p, s in where.values()},
                            dead_set)
    reroutes = []
    # Where the next dead device of a layer group starts its round-robin: the extra
    # micro-batches of uneven shares then rotate over the peers instead of piling on the first.
    start_at: dict[tuple[int, int], int] = {}
    for d in dead:
        p, s = where[d]
        held = current.pipelines[p].layers[s]
        peers = sorted(holders.get(held, ()))
        if not peers:
            raise PlanningError(
                f"cannot reroute: the stage holding layers [{held[0]}, {held[1]}) lost every "
                "replica (no live device holds exactly those layers); re-plan instead "
                "(--policy replan or auto)."
            )
        quota = current.pipelines[p].micro_batches
        n = len(peers)
        k = start_at.get(held, 0) % n
        # Peers that would get nothing are left out (a quota smaller than the group).
        ring = (peers[k:] + peers[:k])[: max(1, min(n, quota))]
        start_at[held] = k + quota % n
        m = len(ring)
        shares = tuple(PeerShare(q, (quota - j + m - 1) // m) for j, q in enumerate(ring))
        reroutes.append(Reroute(device=d, pipeline=p, stage=s, peers=shares))
    spare = tuple(sorted((set(current.spare_devices) - dead_spares) | set(joined)))
    plan = ExecutionPlan("reroute", current.generation + 1, current.pipelines,
                         spare_devices=spare, failed_devices=dead, reroute=tuple(reroutes))
    was = current.estimate
    if (was is not None and plan.reroute == current.reroute
            and plan.failed_devices == tuple(sorted(current.failed_devices))):
        # Only spares changed (one died, or a repaired device came back): the same layout runs
        # the same reroutes, so step time and memory are the current plan's, and with nothing
        # to switch the score is the throughput. Repairs make this the commonest event at scale.
        plan = replace(plan, allreduce_rounds=current.allreduce_rounds, estimate=replace(
            was, transition_time_s=0.0, score=was.throughput))
        plan = plan.validate()
    else:
        plan = _finish(spec, plan)
    ok, why = _memory_ok(spec, plan)
    if not ok:  # only then is recomputation for the peers worth a look (and a second estimate)
        flagged = _peers_recompute(spec, plan, _positions_of(current))
        if flagged is not None:
            plan = _finish(spec, flagged)
            ok, why = _memory_ok(spec, plan)
    if not ok:
        raise PlanningError(f"cannot reroute: {why}; re-plan instead.")
    return plan


def _positions_of(plan: ExecutionPlan, devices: Collection[int] | None = None
                  ) -> dict[int, tuple[int, int]]:
    """(pipeline, stage) of ``devices`` (default: every device in the layout); pipelines
    without one are skipped whole, which at 16k devices is most of them."""
    if devices is None:
        return {d: (i, t) for i, pipe in enumerate(plan.pipelines)
                for t, d in enumerate(pipe.devices)}
    wanted = set(devices)
    return {d: (i, t) for i, pipe in enumerate(plan.pipelines) if not wanted.isdisjoint(pipe.devices)
            for t, d in enumerate(pipe.devices) if d in wanted}


def _live_holders(plan: ExecutionPlan, ranges: Collection[tuple[int, int]],
                  dead: Collection[int]) -> dict[tuple[int, int], list[int]]:
    """The devices outside ``dead`` holding each of ``ranges`` as a stage, in layout order.
    Which stages those are is found once per layer split (the pipelines of a layout share
    theirs), not per pipeline."""
    holders: dict[tuple[int, int], list[int]] = {rng: [] for rng in ranges}
    stages_of: dict[int, list[tuple[int, tuple[int, int]]]] = {}
    for pipe in plan.pipelines:
        stages = stages_of.get(id(pipe.layers))
        if stages is None:
            stages = stages_of[id(pipe.layers)] = [
                (t, rng) for t, rng in enumerate(pipe.layers) if rng in holders]
        for t, rng in stages:
            d = pipe.devices[t]
            if d not in dead:
                holders[rng].append(d)
    return {rng: found for rng, found in holders.items() if found}


def _peers_recompute(spec: JobSpec, plan: ExecutionPlan,
                     where: Mapping[int, tuple[int, int]]) -> ExecutionPlan | None:
    """``plan`` (estimated) with recomputation turned on for the rerouting peers that overflow
    with the micro-batches they absorb and fit with it (``stage_recompute``; never under
    ``never``), or None when no peer can be helped so. Every other flag is the layout's: a
    device that fits keeps running as it did. ``where``: device -> (pipeline, stage)."""
    if spec.planner.recompute == "never" or plan.estimate is None:
        return None
    limit = spec.cluster.device_memory_bytes
    peers = {share.device for r in plan.reroute for share in r.peers}
    over = [d for d, peak in plan.estimate.peak_memory_bytes.items() if peak > limit and d in peers]
    if not over:
        return None
    loads = memory.in_flight(plan)
    pipelines = list(plan.pipelines)
    for d in over:
        p, s = where[d]
        pipe = pipelines[p]
        if not pipe.recompute[s] and stage_recompute(spec, *pipe.layers[s], loads[d]) is True:
            pipelines[p] = replace(pipe, recompute=pipe.recompute[:s] + (True,)
                                   + pipe.recompute[s + 1:])
    if all(a is b for a, b in zip(pipelines, plan.pipelines)):
        return None
    return replace(plan, pipelines=tuple(pipelines), allreduce_rounds=(), estimate=None)


def replan(spec: JobSpec, current: ExecutionPlan, failed: Collection[int],
           joined: Collection[int] = ()) -> ExecutionPlan:
    """Algorithm 1 over the live devices; the best layout by step time is placed on devices
    with the least data movement (restorer)."""
    live, layout, _ = _best_layout(spec, current, failed, joined)
    return _placed(spec, current, layout, live)


def _best_layout(spec: JobSpec, current: ExecutionPlan, failed: Collection[int],
                 joined: Collection[int]) -> tuple[list[int], _Layout, float]:
    """(live devices, the layout with the least step time, that step time)."""
    live = sorted((set(current.live_devices) - set(failed)) | set(joined))
    if not live:
        raise PlanningError("no live device is left; the job cannot continue.")
    # Branch and bound: shapes in order of their compute floor, each allocated and priced
    # (compute + all-reduce) only while its floor can still beat the best step found.
    # Two bounds, each below the step time of every layout of the shape: a cheap one without
    # simulation orders the shapes and ends the walk, a simulated one then skips a shape. The
    # first shape of one pipeline length goes first: its bound is close to its step time (one
    # class, one all-reduce round per stage), so the skipping starts from a good step at once;
    # the walk after it stays in bound order, which is all the stopping rule needs.
    # never more working devices than the job's size: the rest wait as standbys (spec.py)
    shapes = _candidate_shapes(spec, current, min(len(live), spec.training.size))
    walk = sorted((_shape_floor(spec, shape), i, shape) for i, shape in enumerate(shapes))
    probe = next((k for k, (_, _, shape) in enumerate(walk) if len(shape) == 1), 0)
    walk.insert(0, walk.pop(probe)) if walk else None
    priced: list[tuple[float, float, int, int, _Layout]] = []
    best_step = math.inf
    for k, (bound, i, shape) in enumerate(walk):
        if k and bound * (1.0 - FLOOR_MARGIN) > best_step:
            break
        floor = _compute_floor(spec, shape) + _allreduce_floor(spec, shape)
        if floor * (1.0 - FLOOR_MARGIN) > best_step:
            continue
        layout = _layout_for(spec, shape)
        if layout is not None:
            step = layout.compute_s + _allreduce_s(spec, layout)
            priced.append((step, layout.compute_s, -layout.num_pipelines, i, layout))
            best_step = min(best_step, step)
    if not priced:
        raise PlanningError(
            f"no layout of {len(live)} live devices fits in memory (cluster.device_memory_bytes "
            f"= {spec.cluster.device_memory_bytes:g}{_recompute_note(spec)}) within the search "
            "ranges; widen "
            "planner.pp_radius / planner.dp_radius (or set planner.templates = true), add "
            "devices, or lower the model footprint."
        )
    # Least step; ties go to less compute, then more pipelines, then candidate order.
    step, *_, best = min(priced, key=lambda entry: entry[:4])
    return live, best, step


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


def _placed(spec: JobSpec, current: ExecutionPlan, layout: _Layout,
            live: Sequence[int]) -> ExecutionPlan:
    try:
        placed = place(spec, current, layout.pipelines, live)
    except ValueError as exc:
        raise PlanningError(f"cannot re-plan: {exc}") from exc
    plan = ExecutionPlan("replan", current.generation + 1, placed.pipelines,
                         spare_devices=placed.spare_devices, transfers=placed.transfers)
    plan = _finish(spec, plan)
    problem = snapshots.host_memory_problem(spec, plan)
    if problem:
        raise PlanningError(f"cannot re-plan: {problem}.")
    return plan


def check_event(spec: JobSpec, current: ExecutionPlan, failed: Collection[int],
                joined: Collection[int]) -> None:
    """Reject events that do not make sense for ``current``, with the fix in the message."""
    live = set(current.live_devices)
    for d in failed:
        if d not in live:
            raise PlanningError(
                f"device {d} cannot fail: it is not live in plan generation {current.generation} "
                f"(live devices: {compact_ids(sorted(live))}); name a live device."
            )
    if live and set(failed) >= live:
        raise PlanningError(
            ("the last live device would fail" if len(live) == 1 else
             f"all {len(live)} live devices would fail") + "; at least one must survive to continue."
        )
    for d in joined:
        if d in live or not 0 <= d < spec.cluster.devices:
            raise PlanningError(
                f"device {d} cannot join: it is live already or outside 0..{spec.cluster.devices - 1}."
            )


def decide(spec: JobSpec, current: ExecutionPlan, failed: Collection[int] = (),
           joined: Collection[int] = (), policy: PolicyChoice = "auto",
           replanned: ExecutionPlan | None = None, *, price_all: bool = False) -> Decision:
    """Price rerouting and re-planning for this event and choose by score.

    ``replanned`` lets a cache hand in a re-plan it computed ahead; rerouting is always built
    fresh because it is cheap (linear in the devices). Unless ``price_all``, a re-plan whose
    best possible score (its step time with ``cluster.switch_s`` as the only transition)
    cannot beat rerouting is not placed; it appears in ``rejected`` with both scores.
    """
    check_event(spec, current, failed, joined)
    candidates: dict[str, ExecutionPlan] = {}
    rejected: dict[str, str] = {}
    if policy in ("auto", "reroute"):
        try:
            candidates["reroute"] = reroute_plan(spec, current, failed, joined)
        except PlanningError as exc:
            rejected["reroute"] = str(exc)
    if policy == "auto" and _swappable(current, failed, joined):
        try:
            candidates["swap"] = _with_snapshots(spec, current, failed,
                                                 swap_plan(spec, current, failed, joined))
        except PlanningError as exc:
            rejected["swap"] = str(exc)
    if policy in ("auto", "replan"):
        rival = max(candidates.values(), key=lambda p: p.estimate.score, default=None)
        try:
            candidates["replan"] = _with_snapshots(spec, current, failed, (
                replanned if replanned is not None else _replan_to_beat(
                    spec, current, failed, joined, None if price_all else rival)))
        except PlanningError as exc:
            rejected["replan"] = str(exc)
    if not candidates:
        raise PlanningError(" ".join(rejected.values()))
    # ties: nothing to switch (reroute), then the layout kept (swap)
    chosen = max(candidates.values(), key=lambda p: (p.estimate.score, p.policy == "reroute",
                                                     p.policy == "swap"))
    return Decision(chosen=chosen, candidates=candidates, rejected=rejected)


def _replan_to_beat(spec: JobSpec, current: ExecutionPlan, failed: Collection[int],
                    joined: Collection[int], rival: ExecutionPlan | None) -> ExecutionPlan:
    """``replan``, or a PlanningError when it cannot outscore ``rival`` (ties go to rival)."""
    live, layout, step = _best_layout(spec, current, failed, joined)
    if rival is not None:
        throughput = spec.training.global_micro_batches * spec.training.micro_batch_size / step
        bound = estimator.score(throughput, spec.cluster.switch_s,
                                spec.cluster.expected_run_s(len(live)))
        if bound <= rival.estimate.score:
            raise PlanningError(
                f"not placed: a re-plan scores at most {bound:.4g} (step {step:.4g} s plus a "
                f"{spec.cluster.switch_s:g} s switch), not above "
                f"{_NAMES[rival.policy]}'s {rival.estimate.score:.4g}."
            )
    return _placed(spec, current, layout, live)


def compact_ids(ids: Sequence[int]) -> str:
    """'0-3,6,8-9' for a sorted id list: readable in one-sentence errors at 2048 devices."""
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)
