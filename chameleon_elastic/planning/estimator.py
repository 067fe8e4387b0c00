"""Performance model: step time, transition time and score of an execution plan.

The planner compares hundreds of candidate plans per failure, up to 2048 devices, so every
figure here is a pure function of ``(spec, plan)`` built from the job's per-layer profile and
cheap to compute. Where the paper gives a closed form we use it; elsewhere we time the very
operation order the runtime executes (``schedule.device_orders``) with the paper's recurrence
``start(i, j) = max(end(i, j-1), end(f1(i), f2(j)))``.

Step time = pipeline compute + gradient all-reduce.

- Compute, no failure: pipelines meet only at the all-reduce, so the step waits for the slowest
  pipeline. A pipeline whose stages all take the same ``(T_f, T_b)`` takes
  ``(N_pp + N_m - 1)(T_f + T_b)`` (1F1B); any other is simulated. ``pipeline_makespan`` memoises
  both per distinct ``(stage times, quota)``, which is what keeps large searches fast.
- Compute, rerouted: on a symmetric layout (same layer split and quota in every pipeline) with
  uniform stages, where every dead device's work is spread over all live holders of its layers,
  the paper's closed form ``(N_pp + N_m - 1 + sum_g [F_g > 0] N_m F_g / (N_g - F_g))(T_f + T_b)``
  with ``g`` a group of devices holding an identical layer range, ``N_g`` its size and ``F_g``
  its dead members; the fractional share is replaced by the busiest peer's whole number of
  absorbed micro-batches (equal when shares are even). Otherwise, or on request
  (``simulate_reroute``), the pipelines that rerouting couples (the dead devices' and their
  peers') are timed in the orders ``device_orders`` gives them, one group of pipelines that
  share devices at a time (``schedule.coupled_makespan``, memoised per group shape with
  devices renumbered by position, so recurring groups are timed once); the others use
  ``pipeline_time``.
  With several layer groups hit the closed form adds their penalties while the executed order
  overlaps them, so it is pessimistic there (docs/estimator.md has the numbers).
- All-reduce: the plan's colour rounds run one after another; inside a round, groups run in
  parallel, so a round costs its slowest group, a ring all-reduce of ``2 (n - 1) / n`` times
  the group's gradient bytes over the cluster bandwidth. A plan without rounds (hand-built;
  the search always fills them through ``allreduce.allreduce_rounds``) costs 0 here.

Peak memory (``Estimate.peak_memory_bytes``) is ``memory``'s, and ``evaluate`` reads it from
there; ``memory`` also holds the layer-range and plan checks and ``EstimatorError``, which both
modules raise.

Recomputation and precision (docs/estimator.md has the formulas; ``memory`` has what they do
to the bytes). A device whose stage recomputes (``Pipeline.recompute``) runs its forward again
before a backward: its backward takes ``T_b + T_f``. The flag is the device's, so a peer runs
the micro-batches it absorbs with its own flag. Times are taken as given (measured at the
training precision).

Transition: initial and reroute cost nothing (no reconfiguration); a re-plan costs its weight
transfer (the busiest device's bytes in or out over the bandwidth) plus the fixed cost of
switching, ``cluster.switch_s``: rebuilding the process groups in the live processes
(``regroup_s``) under in-place recovery, a process restart (``restart_s``) under relaunch.
Layers loaded from the checkpoint (every replica died) are priced like any transfer, at the
receiver's link; the checkpoint store is not a device and has no send side to be busiest. That
ignores the steps redone since the checkpoint, which the planner cannot know. Layers taken from
an in-memory snapshot (``planning.snapshots``) are priced as a transfer from the device that
keeps it, plus the steps trained again: half a snapshot interval on average. The plan search
itself is ~0 because plans are cached ahead of failures.

Score (the paper's objective): ``throughput * t_run / (t_transition + t_run)`` with ``t_run``
the expected time to the next failure of the live devices.

Speed factors (stragglers, ``speeds``: device -> factor, 1.0 = as profiled, 0.5 = half speed).
A device at speed ``s`` takes ``T / s`` for any work ``T``. Without factors, or with all of them
1.0, every figure is exactly the one above (the same code path). With factors, each pipeline is
timed with its own stages' scaled ``(T_f, T_b)`` (the DP simulation, since its stages then
differ); a rerouted plan, whose coupled pipelines run merged orders, is priced pessimistically:
its unscaled compute divided by the slowest working device's factor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

from ..plan import AllReduceGroup, Estimate, ExecutionPlan, Pipeline, Transfer
from ..spec import JobSpec, ModelProfile
from . import snapshots
from .memory import EstimatorError, _check_plan, _check_range, peak_memory
from .schedule import Lane, coupled_makespan, pipeline_end, pipeline_end_floor

__all__ = [
    "EstimatorError",
    "allreduce_time",
    "compute_time",
    "evaluate",
    "expected_compute",
    "pipeline_makespan",
    "pipeline_time",
    "pipeline_time_floor",
    "reroute_closed_form",
    "ring_seconds",
    "ring_time",
    "score",
    "slow_only",
    "stage_times",
    "step_time",
    "transfer_time",
    "transition_time",
]


# --------------------------------------------------------------------------- building blocks


def stage_times(spec: JobSpec, start: int, end: int, recompute: bool = False
                ) -> tuple[float, float]:
    """``(T_f, T_b)`` of one micro-batch through layers ``[start, end)``: per-layer sums. A
    recomputing stage runs its forward again before the backward: ``T_b + T_f``."""
    tf, tb = _stage_figures(spec.model, start, end)
    return (tf, tb + tf) if recompute else (tf, tb)


def pipeline_time(spec: JobSpec, layers: Sequence[tuple[int, int]], micro_batches: int,
                  recompute: Sequence[bool] | None = None) -> float:
    """Makespan of one 1F1B pipeline whose stages hold ``layers`` (one range per stage) with
    the stages' recomputation flags (None: no stage recomputes)."""
    flags = tuple(recompute) if recompute is not None else (False,) * len(layers)
    return _pipeline_time_of(spec.model, tuple((a, b) for a, b in layers), micro_batches, flags)


def pipeline_time_floor(spec: JobSpec, layers: Sequence[tuple[int, int]], micro_batches: int,
                        recompute: Sequence[bool] | None = None) -> float:
    """A lower bound on ``pipeline_time`` in O(N_pp) (``schedule.pipeline_end_floor``): lets
    a search skip simulating a split that cannot beat the best one found."""
    flags = tuple(recompute) if recompute is not None else (False,) * len(layers)
    return pipeline_end_floor(_flagged_times(spec.model, tuple(layers), flags), micro_batches)


@lru_cache(maxsize=1 << 16)
def _pipeline_time_of(model: ModelProfile, layers: tuple[tuple[int, int], ...],
                      micro_batches: int, recompute: tuple[bool, ...]) -> float:
    return pipeline_makespan(_flagged_times(model, layers, recompute), micro_batches)


def _flagged_times(model: ModelProfile, layers: tuple[tuple[int, int], ...],
                   recompute: tuple[bool, ...]) -> tuple[tuple[float, float], ...]:
    """Per stage ``(T_f, T_b)``, ``T_b + T_f`` where the stage recomputes."""
    figures = _figures_memo(model)  # hashing the model once, not per stage
    out = []
    for (a, b), r in zip(layers, recompute):
        found = figures.get((a, b))
        if found is None:
            found = figures[(a, b)] = _stage_figures(model, a, b)
        tf, tb = found
        out.append((tf, tb + tf) if r else (tf, tb))
    return tuple(out)


@lru_cache(maxsize=16)
def _figures_memo(model: ModelProfile) -> dict[tuple[int, int], tuple[float, float]]:
    """``_stage_figures`` of one model by layer range, filled as asked (the same values)."""
    return {}


@lru_cache(maxsize=1 << 16)
def pipeline_makespan(stage_times: tuple[tuple[float, float], ...], micro_batches: int) -> float:
    """Makespan of one 1F1B pipeline: closed form for equal stages, else the DP simulation.

    Pure and memoised per distinct ``(stage times, quota)``: a search prices hundreds of
    candidate layouts that share a handful of pipeline shapes.
    """
    if micro_batches == 0:
        return 0.0
    first = stage_times[0]
    if all(t == first for t in stage_times):
        return (len(stage_times) + micro_batches - 1) * (first[0] + first[1])
    return pipeline_end(stage_times, micro_batches)


def ring_time(spec: JobSpec, layers: Iterable[int], n_devices: int) -> float:
    """Ring all-reduce of the gradients of ``layers`` over ``n_devices`` devices.

    ``2 (n - 1) / n`` times the layers' gradient bytes over the cluster bandwidth; 0 for a
    single device (nothing to sync). Public and free of device lists so that other modules can
    price ``(layers, count)`` groups before they pick devices.
    """
    grad_bytes = math.fsum(spec.model.param_bytes[layer] for layer in layers)
    return ring_seconds(grad_bytes, n_devices, spec.cluster.bandwidth_bytes_per_s)


def ring_seconds(nbytes: float, n_devices: int, bandwidth: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``n_devices``: each sends and receives
    ``2 (n - 1) / n`` of the bytes over its link; 0 for one device."""
    if n_devices <= 1:
        return 0.0
    return 2.0 * (n_devices - 1) / n_devices * nbytes / bandwidth


def transfer_time(spec: JobSpec, transfers: Iterable[Transfer]) -> float:
    """Seconds to move weights: the busiest device's bytes received or sent, over the bandwidth.
    A checkpoint source is not a device: only its receivers' links count."""
    received: dict[int, float] = {}
    sent: dict[int | str, float] = {}
    for t in transfers:
        received[t.dst] = received.get(t.dst, 0.0) + t.bytes
        if not t.from_checkpoint:
            sent[t.src] = sent.get(t.src, 0.0) + t.bytes
    busiest = max([*received.values(), *sent.values()], default=0.0)
    return busiest / spec.cluster.bandwidth_bytes_per_s


def score(throughput: float, transition_s: float, run_s: float) -> float:
    """The paper's objective: throughput discounted by the time spent switching plans."""
    if throughput < 0 or transition_s < 0 or run_s < 0 or math.isnan(run_s):
        raise ValueError(
            f"score needs non-negative figures, got throughput={throughput}, "
            f"transition_s={transition_s}, run_s={run_s}."
        )
    if transition_s == 0 or math.isinf(run_s):
        return throughput
    return throughput * run_s / (transition_s + run_s)


# --------------------------------------------------------------------------- a whole plan


def compute_time(spec: JobSpec, plan: ExecutionPlan, *, simulate_reroute: bool = False,
                 speeds: Mapping[int, float] | None = None) -> float:
    """Pipeline part of one training step (see the module docstring for which model applies).

    ``simulate_reroute=True`` skips the paper's rerouting closed form and times the executed
    orders instead: slower at scale, closer to what the runtime does when failures hit
    several layer groups (the closed form adds their penalties; the orders overlap them).
    ``speeds``: per-device speed factors (module docstring); absent devices run at 1.0.
    """
    _check_plan(spec, plan)
    slow = slow_only(speeds, plan.working_devices)
    if slow:
        return _compute_with_speeds(spec, plan, slow, simulate_reroute)
    if not plan.reroute:
        return _slowest_alone(spec, plan.pipelines)
    closed = None if simulate_reroute else reroute_closed_form(spec, plan)
    if closed is not None:
        return closed
    components = _coupled_components(plan)
    coupled = {p for comp in components for p in comp}
    rest = [pipe for p, pipe in enumerate(plan.pipelines) if p not in coupled]
    times: dict[tuple[tuple[int, int], ...], tuple[tuple[float, float], ...]] = {}
    return max([*(_component_makespan(*_lanes(spec, plan, comp, times)) for comp in components),
                *([_slowest_alone(spec, rest)] if rest else [])])


def reroute_closed_form(spec: JobSpec, plan: ExecutionPlan) -> float | None:
    """The paper's rerouting step time, or None where its assumptions do not hold.

    Assumptions: every pipeline has the same layer split, quota and recomputation flags (every
    stage recomputes or none: the flag is a device's, and peers with different flags would run
    a dead stage's micro-batches at different speeds), every stage then takes the same
    ``(T_f, T_b)``, and each dead device's micro-batches go to all live holders of its layers
    (or, when it has fewer micro-batches than live holders, to as many holders as it has).
    The paper's extra term for a group with ``F_g`` of ``N_g`` holders dead is the fractional
    share ``N_m F_g / (N_g - F_g)``; micro-batches are whole, so we charge the busiest live
    holder's absorbed count from the plan's reroute shares, which equals the paper's term
    whenever the shares come out even and is never less.
    """
    first = plan.pipelines[0]
    flags = first.recompute
    if any(p.layers != first.layers or p.micro_batches != first.micro_batches
           or (p.recompute is not flags and p.recompute != flags) for p in plan.pipelines):
        return None
    if len(set(flags)) > 1:  # stages then differ in speed: no closed form
        return None
    times = _flagged_times(spec.model, first.layers, flags)
    if any(t != times[0] for t in times):
        return None
    nm = first.micro_batches
    dead = set(plan.failed_devices)
    # Every pipeline has the same split, so a group holds one stage of each: only the dead
    # devices and the peers need their range looked up, not all devices.
    asked = dead.union(share.device for r in plan.reroute for share in r.peers)
    group_of: dict[int, tuple[int, int]] = {  # device -> the layer range its group holds
        d: rng for pipe in plan.pipelines if not asked.isdisjoint(pipe.devices)
        for rng, d in zip(pipe.layers, pipe.devices) if d in asked}
    live: dict[tuple[int, int], int] = dict.fromkeys(first.layers, len(plan.pipelines))
    for d in dead:
        live[group_of[d]] -= 1
    absorbed: dict[int, int] = {}
    for r in plan.reroute:
        rng = first.layers[r.stage]
        served = {share.device for share in r.peers if share.micro_batches}
        # Spread over every live holder, or over as many as there are micro-batches to spread.
        if (len(served) != min(live[rng], max(1, nm))
                or any(d in dead or group_of.get(d) != rng for d in served)):
            return None
        for share in r.peers:
            absorbed[share.device] = absorbed.get(share.device, 0) + share.micro_batches
    hit = {group_of[d] for d in dead if d in group_of}
    busiest = dict.fromkeys(hit, 0)
    for d, count in absorbed.items():
        if group_of[d] in busiest:
            busiest[group_of[d]] = max(busiest[group_of[d]], count)
    tf, tb = times[0]
    return (first.num_stages + nm - 1 + sum(busiest.values())) * (tf + tb)


def allreduce_time(spec: JobSpec, plan: ExecutionPlan) -> float:
    """Gradient sync: colour rounds one after another, each as slow as its slowest ring."""
    _check_plan(spec, plan)
    return math.fsum(max((_ring_time(spec, g) for g in rnd), default=0.0)
                     for rnd in plan.allreduce_rounds)


def step_time(spec: JobSpec, plan: ExecutionPlan, *, simulate_reroute: bool = False,
              speeds: Mapping[int, float] | None = None) -> float:
    """Compute plus gradient all-reduce; ``simulate_reroute`` and ``speeds`` as in
    ``compute_time`` (the all-reduce is a link's, not a device's: speeds leave it alone)."""
    return (compute_time(spec, plan, simulate_reroute=simulate_reroute, speeds=speeds)
            + allreduce_time(spec, plan))


def slow_only(speeds: Mapping[int, float] | None, devices: Iterable[int]) -> dict[int, float]:
    """The factors of ``devices`` other than 1.0, checked: empty means "price as profiled"."""
    if not speeds:
        return {}
    out = {}
    for d in devices:
        factor = speeds.get(d, 1.0)
        if not (factor > 0 and math.isfinite(factor)):
            raise EstimatorError(
                f"device {d} has speed factor {factor}; give a positive finite factor "
                "(1.0 = as profiled, 0.5 = half speed)."
            )
        if factor != 1.0:
            out[d] = factor
    return out


def expected_compute(spec: JobSpec, plan: ExecutionPlan) -> dict[int, float]:
    """Seconds of forward and backward work each working device does per step at speed 1.0:
    its micro-batches (absorbed ones included) times its layers' ``T_f + T_b`` (recomputing:
    ``+ T_f``). What a measured compute time is compared with to get a device's speed."""
    _check_plan(spec, plan)
    out = {}
    for role in plan.roles():
        tf, tb = stage_times(spec, role.layer_start, role.layer_end, role.recompute)
        out[role.device] = role.micro_batches * (tf + tb)
    return out


def _compute_with_speeds(spec: JobSpec, plan: ExecutionPlan, slow: Mapping[int, float],
                         simulate_reroute: bool) -> float:
    if plan.reroute:   # merged orders: pessimistic, the slowest device sets the pace
        base = compute_time(spec, plan, simulate_reroute=simulate_reroute)
        return base / min(slow.values())
    worst = 0.0
    for pipe in plan.pipelines:
        times = _flagged_times(spec.model, pipe.layers, pipe.recompute)
        factors = [slow.get(d, 1.0) for d in pipe.devices]
        if any(f != 1.0 for f in factors):
            times = tuple((tf / f, tb / f) for (tf, tb), f in zip(times, factors))
        worst = max(worst, pipeline_makespan(times, pipe.micro_batches))
    return worst


def transition_time(spec: JobSpec, plan: ExecutionPlan, step_s: float = 0.0) -> float:
    """Seconds to switch to ``plan``: 0 for initial and reroute; for a re-plan or a swap, its
    transfers plus ``cluster.switch_s`` (regroup in place, or restart under relaunch), plus, when it
    takes layers from in-memory snapshots, the steps trained again since the last one at
    ``step_s`` each (``snapshots.redone_s``)."""
    if plan.policy not in ("replan", "swap"):
        return 0.0
    seconds = transfer_time(spec, plan.transfers) + spec.cluster.switch_s
    if plan.snapshot_layers:
        seconds += snapshots.redone_s(spec, step_s)
    return seconds


def evaluate(spec: JobSpec, plan: ExecutionPlan,
             speeds: Mapping[int, float] | None = None) -> Estimate:
    """Everything above for one plan; ``t_run`` is the expected time to the next failure;
    ``speeds`` as in ``compute_time``."""
    step = step_time(spec, plan, speeds=speeds)
    if step <= 0:
        raise EstimatorError(
            "the plan gives no micro-batch to any pipeline, so it trains nothing; give the "
            "pipelines quotas summing to the global batch."
        )
    throughput = plan.global_micro_batches * spec.training.micro_batch_size / step
    transition = transition_time(spec, plan, step)
    run = spec.cluster.expected_run_s(len(plan.live_devices))
    return Estimate(
        step_time_s=step,
        transition_time_s=transition,
        peak_memory_bytes=peak_memory(spec, plan),
        throughput=throughput,
        score=score(throughput, transition, run),
    )


# --------------------------------------------------------------------------- helpers


@lru_cache(maxsize=1 << 16)
def _stage_figures(model: ModelProfile, start: int, end: int) -> tuple[float, float]:
    """``(T_f, T_b)`` of layers [start, end), without recomputation.

    Memoised: a search asks for the same few ranges thousands of times. ``math.fsum`` makes
    equal multisets of layer figures sum to equal floats, so uniform stages compare equal and
    take the closed forms. Times do not depend on the training precision: they are measured
    at it.
    """
    _check_range(model, start, end)
    return math.fsum(model.forward_s[start:end]), math.fsum(model.backward_s[start:end])


def _base_times(spec: JobSpec, pipe: Pipeline) -> tuple[tuple[float, float], ...]:
    """Per stage ``(T_f, T_b)`` without recomputation: in coupled pipelines a stage's
    micro-batches may run on devices with different flags (``coupled_makespan`` adds them)."""
    return tuple(stage_times(spec, a, b) for a, b in pipe.layers)


def _slowest_alone(spec: JobSpec, pipelines: Iterable[Pipeline]) -> float:
    """Makespan of the slowest of pipelines that share no device, each priced once per
    distinct ``(layers, quota, flags)``: hundreds of pipelines, a handful of shapes, and every
    memo lookup hashes the whole model profile."""
    shapes = {(pipe.layers, pipe.micro_batches, pipe.recompute) for pipe in pipelines}
    return max(_pipeline_time_of(spec.model, layers, nm, flags) for layers, nm, flags in shapes)


def _ring_time(spec: JobSpec, group: AllReduceGroup) -> float:
    return ring_time(spec, group.layers, len(group.devices))


def _coupled_components(plan: ExecutionPlan) -> list[list[int]]:
    """Pipelines that rerouting couples (a dead device's with its peers'), split into groups
    that share no device, each sorted: the groups time independently, so the step waits for
    the slowest, and recurring groups hit ``_component_makespan``'s memo."""
    owner = {d: p for p, pipe in enumerate(plan.pipelines) for d in pipe.devices}
    parent = list(range(len(plan.pipelines)))

    def root(p: int) -> int:
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    coupled = {r.pipeline for r in plan.reroute}
    for r in plan.reroute:
        for share in r.peers:
            q = owner[share.device]
            coupled.add(q)
            a, b = root(r.pipeline), root(q)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for p in sorted(coupled):
        groups.setdefault(root(p), []).append(p)
    return list(groups.values())


def _lanes(spec: JobSpec, plan: ExecutionPlan, component: Sequence[int],
           times: dict[tuple[tuple[int, int], ...], tuple[tuple[float, float], ...]]
           ) -> tuple[tuple[Lane, ...], frozenset[int]]:
    """A component as position-free lanes, and the (renumbered) devices that recompute:
    devices renumbered by their home (lane, stage), so the same shape anywhere in any plan
    gives the same key. ``times`` memoises stage times per layer split across the components
    of one plan."""
    local: dict[int, int] = {}
    recompute: set[int] = set()
    for p in component:
        pipe = plan.pipelines[p]
        for d, r in zip(pipe.devices, pipe.recompute):
            if r:
                recompute.add(len(local))
            local[d] = len(local)
    reroutes = {r.device: r for r in plan.reroute}
    lanes = []
    for p in component:
        pipe = plan.pipelines[p]
        servers = tuple(tuple(local[share.device] for share in reroutes[d].peers)
                        if d in reroutes else (local[d],) for d in pipe.devices)
        if pipe.layers not in times:
            times[pipe.layers] = _base_times(spec, pipe)
        lanes.append((times[pipe.layers], pipe.micro_batches, servers))
    dead = {local[d] for d in reroutes if d in local}  # their flags are never used
    return tuple(lanes), frozenset(recompute - dead)


_MEMO_LANES = 32
"""Largest group of coupled pipelines worth a memo entry. Small groups recur (the same few
pipelines coupled the same way at many places and events); a large one is reshuffled by
nearly every failure, so keeping it would only hold hundreds of kilobytes per entry."""


def _component_makespan(lanes: tuple[Lane, ...], recompute: frozenset[int]) -> float:
    if len(lanes) > _MEMO_LANES:
        return coupled_makespan(lanes, recompute)
    return _small_component_makespan(lanes, recompute)


@lru_cache(maxsize=1 << 12)
def _small_component_makespan(lanes: tuple[Lane, ...], recompute: frozenset[int]) -> float:
    return coupled_makespan(lanes, recompute)
