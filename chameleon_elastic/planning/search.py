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
  (``candidates._candidate_shapes`` says why the floor of two);
- micro-batch quotas minimise the slowest pipeline's time exactly (greedy marginal
  allocation, ``candidates._allocate``) instead of the paper's proportional split.

The wider candidate set stays cheap: a candidate is a few runs of identical pipelines, priced
per class, never per device; candidates are allocated in order of a compute floor and dropped
once the floor cannot beat the best step found (branch and bound); with identical layers the
C(N_pp, r) layer splits shrink to three structured ones. Each shortcut is tested against the
plain computation it replaces (tests/planning/test_search_candidates.py).

The pieces a candidate is built from live below this module and never look at devices: one
pipeline's layer split and recomputation flags in ``layer_splits``; candidate shapes, their
micro-batch quotas, lower bounds and per-class all-reduce pricing in ``candidates``. Here: the
walk over the candidates (branch and bound), their placement, the policies and the choice.

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

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from ..plan import ExecutionPlan, PeerShare, Reroute
from ..spec import JobSpec
from . import estimator, memory, snapshots
from .allreduce import allreduce_rounds
from .candidates import (
    _allreduce_floor,
    _allreduce_s,
    _candidate_shapes,
    _compute_floor,
    _Layout,
    _layout_for,
    _shape_floor,
)
from .layer_splits import FLOOR_MARGIN, stage_recompute
from .restorer import choose_sources, holdings, place

__all__ = [
    "Decision",
    "PlanningError",
    "PolicyChoice",
    "compact_ids",
    "decide",
    "initial_plan",
    "replan",
    "reroute_plan",
    "swap_plan",
]

PolicyChoice = Literal["auto", "reroute", "replan"]


class PlanningError(Exception):
    """An impossible request; the message is one sentence naming the problem and the fix."""


@dataclass(frozen=True)
class Decision:
    """The chosen plan, every policy that was priced, and why the others were not possible."""

    chosen: ExecutionPlan
    candidates: dict[str, ExecutionPlan] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)


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
