"""The plan a job is running under, and how it changes when devices are lost or come back.

A ``JobSession`` exists only with ``--job`` / ``--preset``. It owns the current execution plan,
the set of excluded devices, and a ``PlanCache`` warmed in a background thread right after every
plan change, so that at the next failure the decision is a lookup. The decision itself is the
planner's (``chameleon_elastic.planning``); this module only feeds it the lost / returning
devices, keeps the plan-file per generation and summarises the decision for the event log.

In a multi-node job the lowest member of the round decides (``step``) and publishes its inputs and
the :attr:`JobSession.digest` before and after; the other agents replay the same ``step`` (the
planner is deterministic, and the plan cache makes it a lookup) and compare digests, or ``adopt``
the decider's plan when theirs differs (a late joiner), so their sessions follow the same plans.

``policy = "restart"`` is torchrun's behaviour: the plan never changes, the whole group restarts.

With ``training.tp`` > 1 the planner plans units of ``tp`` cards (``planning.units.unit_spec``):
the session's devices, plans and excluded sets are units; the agent maps cards to them.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from chameleon_elastic.exit_status import ExitStatus
from chameleon_elastic.plan import ExecutionPlan
from chameleon_elastic.spec import JobSpec

from .plan_env import write_plan_file

__all__ = ["CLI_POLICIES", "JobSession", "LauncherPlanningError", "NoPlanError", "PlanChange"]

CLI_POLICIES: tuple[str, ...] = ("auto", "reroute", "replan", "restart")
CliPolicy = Literal["auto", "reroute", "replan", "restart"]


class LauncherPlanningError(RuntimeError):
    """The job cannot go on (the sentence says why); a rerun may succeed."""

    status = ExitStatus.FAILED


class NoPlanError(LauncherPlanningError):
    """No plan can run the job on the devices left (the planner's sentence is included), or
    state was lost that no checkpoint holds: a rerun on the same allocation fails the same
    way, or starts over from step 0."""

    status = ExitStatus.DO_NOT_REQUEUE


@dataclass(frozen=True)
class PlanChange:
    """One decision, summarised for the event log."""

    plan: ExecutionPlan
    lost: tuple[int, ...]
    joined: tuple[int, ...]
    cached: bool
    decide_s: float
    candidates: dict[str, dict[str, Any]] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    slow: dict[int, float] | None = None    # a straggler decision: the factors it was made for
    was_slow: dict[int, float] = field(default_factory=dict)   # and those before it
    same_layout: bool = False   # a new generation of the layout in force (a crash, regrouped)
    #: lost devices that held no role in the plan before this change (spares, standbys)
    idle_lost: tuple[int, ...] = ()
    #: the pipelines (devices, layers, quotas) and reroutes are those of the plan before
    kept_layout: bool = False
    #: standbys lost (spares outside the training world): the plan in force is kept, its
    #: generation too, with fewer spares; no worker is told (:meth:`JobSession.drop_standbys`)
    quiet: bool = False
    #: how this agent holds it: "decided" here, "replayed" from the published inputs (its digest
    #: matched), or "fetched" from the deciding agent (it did not: a late joiner)
    agreed: str = "decided"

    def event_fields(self) -> dict[str, Any]:
        """The ``plan_chosen`` event's own fields (docs/launcher.md)."""
        return {"policy": self.plan.policy, "lost": list(self.lost), "joined": list(self.joined),
                "via_cache": self.cached, "decide_s": self.decide_s, "agreed": self.agreed,
                "candidates": self.candidates, "rejected": self.rejected,
                "live_devices": list(self.plan.live_devices),
                "spare_devices": list(self.plan.spare_devices),
                **({"quiet": True} if self.quiet else {}),
                **({} if self.slow is None else {
                    "slow": {str(d): f for d, f in sorted(self.slow.items())}})}


def _planning_api() -> SimpleNamespace:
    """The planner's documented entry points (imported lazily: the launcher runs without it)."""
    from chameleon_elastic.planning import (
        PlanCache,
        PlanningError,
        decide,
        initial_plan,
        resolve_snapshots,
    )
    from chameleon_elastic.planning.stragglers import decide_speeds
    from chameleon_elastic.planning.units import unit_spec

    return SimpleNamespace(PlanCache=PlanCache, PlanningError=PlanningError, decide=decide,
                           initial_plan=initial_plan, unit_spec=unit_spec,
                           decide_speeds=decide_speeds, resolve_snapshots=resolve_snapshots)


def _hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _summary(plan: ExecutionPlan) -> dict[str, Any]:
    est = plan.estimate
    return {
        "policy": plan.policy,
        "pipelines": [len(p.devices) for p in plan.pipelines],
        "micro_batches": [p.micro_batches for p in plan.pipelines],
        "step_time_s": None if est is None else est.step_time_s,
        "transition_time_s": None if est is None else est.transition_time_s,
        "throughput": None if est is None else est.throughput,
        "score": None if est is None else est.score,
    }


class JobSession:
    def __init__(self, spec: JobSpec, policy: CliPolicy, plan_dir: str | Path,
                 cache_depth: int | None = None, warm_cache: bool = True) -> None:
        if policy not in CLI_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {CLI_POLICIES}")
        planning = _planning_api()
        self._planning = planning
        try:   # the snapshot interval the workers take (CHAMELEON_SNAPSHOT_EVERY), priced too
            spec = planning.resolve_snapshots(spec)
        except planning.PlanningError as exc:
            raise NoPlanError(f"no initial plan for job {spec.name!r}: {exc}") from exc
        self.spec = spec
        self.planned = planning.unit_spec(spec)   # what the planner sees: units of tp cards
        self.policy = policy
        self.plan_dir = Path(plan_dir)
        self.cache_depth = spec.planner.cache_failures if cache_depth is None else cache_depth
        self.warm_cache = warm_cache
        self.excluded: set[int] = set()
        self.speeds: dict[int, float] = {}   # slow devices the plan was made for (factors)
        try:
            self.plan: ExecutionPlan = planning.initial_plan(self.planned)
        except planning.PlanningError as exc:
            raise NoPlanError(f"no initial plan for job {spec.name!r}: {exc}") from exc
        #: what every agent's planner is given besides the plan: the spec (its profiled
        #: figures included, in units) and the policy; part of :attr:`digest`
        self.inputs = _hash(json.dumps({"spec": self.planned.to_dict(), "policy": policy},
                                       sort_keys=True).encode())
        self._set_plan(self.plan)
        self._cache = None
        self._refresh_cache()
        self.warm()

    @property
    def devices(self) -> int:
        """The planner's devices: units of ``tp`` cards (cards when ``tp`` is 1)."""
        return self.planned.cluster.devices

    @property
    def tp(self) -> int:
        return self.spec.training.tp

    @property
    def digest(self) -> str:
        """The state a decision is made from and leads to: the planner's inputs, the plan, the
        excluded devices and the speed factors. Two agents with the same digest hold the same
        plan, so agents agree by comparing digests instead of shipping the plan (0.6 MB at
        8192 devices) to each of them."""
        state = json.dumps([self.inputs, self._plan_hash, sorted(self.excluded),
                            sorted(self.speeds.items())])
        return _hash(state.encode())

    def _set_plan(self, plan: ExecutionPlan) -> None:
        """Make ``plan`` the current one: its file, and its hash for :attr:`digest`, from one
        serialisation (the JSON of a plan at 8192 devices takes tens of milliseconds)."""
        text = plan.to_json(indent=None)
        self.plan = plan
        self.plan_file = write_plan_file(plan, self.plan_dir, text)
        self._plan_hash = _hash(text.encode())

    def step(self, lost: Collection[int], joined: Collection[int],
             speeds: Mapping[int, float], renew: bool, quiet: bool = False) -> PlanChange | None:
        """One decision from its inputs, as every agent takes it: the devices lost and back,
        or else every node's slow devices (``speeds``; excluded ones left out), or else, when
        ``renew`` (the workers regroup in place), the same layout as a new generation.
        ``quiet``: the devices lost are standbys outside the training world (the deciding
        agent says so, launcher/coordination/agreement.py): :meth:`drop_standbys`. A pure
        function of the inputs and the session's :attr:`digest`, so agents that replay it
        from the same digest reach the same plan."""
        change = self.drop_standbys(lost) if quiet else None
        if change is None:
            change = self.apply(lost=lost, joined=joined)
        if change is None:   # no device lost or back: maybe one is slow, or fast again
            change = self.apply_speeds({d: f for d, f in speeds.items()
                                        if d not in self.excluded})
        if change is None and renew:
            change = self.renew()
        return change

    def _refresh_cache(self) -> None:
        """A cache for the plan in force, filled later (:meth:`warm`)."""
        self._cache, self._warming = None, False
        if self.policy == "restart" or self.cache_depth <= 0:
            return
        try:
            self._cache = self._planning.PlanCache(self.planned, self.plan,
                                                   depth=self.cache_depth)
        except Exception:  # noqa: BLE001 - a cache is an optimisation; decide() still works
            self._cache = None

    def warm(self) -> None:
        """Fill the plan cache in the background, once per plan. The agent calls it when a
        recovery is over, not when the plan changes: the warming is pure Python (a core for
        about 0.5 s on the tiny preset) and would compete with the workers' regroup and first
        step. A failure meanwhile is decided without the cache."""
        if self._cache is None or self._warming or not self.warm_cache:
            return
        self._warming = True
        try:
            self._cache.warm_in_background()
        except RuntimeError:   # no thread to be had: decide() still works
            self._cache = None

    def adopt(self, plan: ExecutionPlan, excluded: Collection[int],
              speeds: dict[int, float] | None = None) -> PlanChange | None:
        """Take the plan another agent decided (multi-node); None when it is the current one.
        ``speeds``: the slow devices it was made for (None: as they were)."""
        excluded = set(excluded)
        if speeds is not None:
            self.speeds = dict(speeds)
        if plan == self.plan and plan.generation == self.plan.generation:
            self.excluded = excluded
            return None
        lost = tuple(sorted(excluded - self.excluded))
        joined = tuple(sorted(self.excluded - excluded))
        same = plan == replace(self.plan, generation=plan.generation, transfers=plan.transfers)
        idle = tuple(d for d in lost if d not in self.plan.working_devices)
        quiet = plan.generation == self.plan.generation   # only standbys lost keep it
        self.excluded = excluded
        self._set_plan(plan)
        self._refresh_cache()
        return PlanChange(plan=plan, lost=lost, joined=joined, cached=False, decide_s=0.0,
                          candidates={plan.policy: _summary(plan)}, rejected={},
                          same_layout=same, idle_lost=idle, quiet=quiet)

    def renew(self) -> PlanChange:
        """The same layout as a new generation (nothing moves): what live workers regroup on
        when their world must be formed again although no device changed (a worker crashed
        and is replaced, a peer's sockets broke). The plan cache starts again from it: its
        decisions are the next generation of the plan it holds, and a stale one would take the
        workers back to a generation they left."""
        self._set_plan(replace(self.plan, generation=self.plan.generation + 1, transfers=()))
        self._refresh_cache()
        return PlanChange(plan=self.plan, lost=(), joined=(), cached=False, decide_s=0.0,
                          candidates={self.plan.policy: _summary(self.plan)}, rejected={},
                          same_layout=True)

    def drop_standbys(self, lost: Collection[int]) -> PlanChange | None:
        """Standbys lost: spares that wait outside the training world (runtime/recovery/
        standby.py), holding no layers and taking part in no collective. No worker does
        anything else for their loss, so the planner is not asked and the plan in force is
        kept, generation and all, with fewer spares: the agents agree on it and tell no worker
        (launcher/transition.py), and training goes on undisturbed. (A spare inside the world
        is not one: it votes in every step, so its loss needs a new world, :meth:`apply`.)
        None when nothing new was lost, or under ``policy = "restart"``."""
        lost = tuple(sorted(set(lost) - self.excluded))
        if not lost or self.policy == "restart":
            return None
        start = time.perf_counter()
        self.excluded.update(lost)
        self._set_plan(replace(self.plan, spare_devices=tuple(
            d for d in self.plan.spare_devices if d not in lost)))
        self._refresh_cache()
        return PlanChange(plan=self.plan, lost=lost, joined=(), cached=False,
                          decide_s=time.perf_counter() - start,
                          candidates={self.plan.policy: _summary(self.plan)}, rejected={},
                          same_layout=True, idle_lost=lost, kept_layout=True, quiet=True)

    def apply(self, lost: Collection[int] = (), joined: Collection[int] = ()) -> PlanChange | None:
        """Tell the planner about newly lost / returning devices; None when nothing changes."""
        lost = tuple(sorted(set(lost) - self.excluded))
        joined = tuple(sorted(set(joined) & self.excluded))
        if not lost and not joined:
            return None
        idle = tuple(d for d in lost if d not in self.plan.working_devices)
        self.excluded.update(lost)
        self.excluded.difference_update(joined)
        if self.policy == "restart":
            return None
        self.speeds = {}   # a failure is planned at profiled speeds; stragglers show again
        policy = self.policy
        start = time.perf_counter()
        cached = False
        try:
            if self._cache is not None:
                decision = self._cache.decide(lost, joined, policy=policy)
                cached = True
            else:
                decision = self._planning.decide(self.planned, self.plan, failed=lost,
                                                 joined=joined, policy=policy)
        except self._planning.PlanningError as exc:
            raise NoPlanError(
                f"cannot continue after losing device(s) {list(lost)} "
                f"(excluded now: {sorted(self.excluded)}): {exc}"
            ) from exc
        elapsed = time.perf_counter() - start
        before = self.plan
        self._set_plan(decision.chosen)
        self._refresh_cache()
        return PlanChange(
            plan=self.plan, lost=lost, joined=joined, cached=cached, decide_s=elapsed,
            candidates={name: _summary(p) for name, p in decision.candidates.items()},
            rejected=dict(decision.rejected), idle_lost=idle,
            kept_layout=(self.plan.pipelines == before.pipelines
                         and self.plan.reroute == before.reroute),
        )

    def apply_speeds(self, speeds: dict[int, float]) -> PlanChange | None:
        """Tell the planner which devices are slow now (factors; absent = 1.0): it keeps the
        layout, reduces their work or leaves them spare (``planning.stragglers``). None when
        the factors are those the plan was made for, or the layout is kept."""
        speeds = {d: f for d, f in speeds.items() if f != 1.0}
        if speeds == self.speeds or self.policy == "restart":
            return None
        was, self.speeds = self.speeds, speeds
        start = time.perf_counter()
        try:
            decision = self._planning.decide_speeds(self.planned, self.plan, speeds,
                                                    policy=self.policy, before=was)
        except self._planning.PlanningError as exc:
            raise LauncherPlanningError(f"cannot plan for slow devices {speeds}: {exc}") from exc
        if decision.chosen.generation == self.plan.generation:
            return None   # kept: the same plan, now known to run at these speeds
        self._set_plan(decision.chosen)
        self._refresh_cache()
        return PlanChange(
            plan=self.plan, lost=(), joined=(), cached=False,
            decide_s=time.perf_counter() - start,
            candidates={name: _summary(p) for name, p in decision.candidates.items()},
            rejected=dict(decision.rejected), slow=speeds, was_slow=was,
        )
