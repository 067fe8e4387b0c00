"""Pieces every policy model shares: phases from plans, finished hand-built plans, restarts.

A policy never times anything itself. A running phase takes its step time from the plan's
estimate, which ``planning.estimator.evaluate`` produced; hand-built baseline plans are
finished the same way the planner finishes its own (all-reduce rounds from the restorer, then
the estimator), so every policy is priced by one model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ...plan import ExecutionPlan, Pipeline
from ...planning import estimator
from ...planning.allreduce import allreduce_rounds
from ...planning.search import PlanningError, initial_plan
from ...spec import JobSpec
from ..engine import Phase

__all__ = [
    "STALLED",
    "finish",
    "paused",
    "restart_pipelines",
    "running",
    "samples_per_step",
    "symmetric_plan",
]

#: No layout is possible (too few live devices): nothing runs until the horizon.
STALLED = Phase(math.inf, None, 0.0, 0, "stalled")


def samples_per_step(spec: JobSpec) -> float:
    return float(spec.training.global_micro_batches * spec.training.micro_batch_size)


def step_time(spec: JobSpec, plan: ExecutionPlan, timing: str = "closed-form",
              speeds: Mapping[int, float] | None = None) -> float:
    """The step the job experiences: the plan's estimate, or for a rerouted plan under
    ``timing="schedule"`` the simulated executed orders (see ``BaselineConstants``); with slow
    devices (``speeds``), the estimator's step at their factors."""
    if timing == "schedule" and plan.reroute:
        return estimator.step_time(spec, plan, simulate_reroute=True, speeds=speeds)
    if plan.estimate is not None and not estimator.slow_only(speeds, plan.working_devices):
        return plan.estimate.step_time_s
    return estimator.step_time(spec, plan, speeds=speeds)


def running(spec: JobSpec, plan: ExecutionPlan, label: str, *, duration_s: float = math.inf,
            slowdown: float = 1.0, timing: str = "closed-form",
            speeds: Mapping[int, float] | None = None) -> Phase:
    """Training under ``plan``; ``slowdown`` > 1 stretches the step (checkpoint stalls, ...);
    ``speeds``: slow devices' factors."""
    return Phase(duration_s, step_time(spec, plan, timing, speeds) * slowdown,
                 samples_per_step(spec), len(plan.working_devices), label)


def paused(duration_s: float, label: str) -> Phase:
    return Phase(duration_s, None, 0.0, 0, label)


def finish(spec: JobSpec, plan: ExecutionPlan) -> ExecutionPlan:
    """All-reduce rounds and the estimate, as the planner attaches them to its own plans."""
    plan = replace(plan, allreduce_rounds=allreduce_rounds(plan.pipelines, plan.failed_devices))
    return replace(plan, estimate=estimator.evaluate(spec, plan)).validate()


def restart_pipelines(spec: JobSpec, live: int) -> int:
    """How many full ``training.pp``-stage pipelines a restart on ``live`` devices runs: as
    many as they hold, never more than the job's layout (``training.dp``: devices beyond it
    are standbys, TrainingSpec.size) nor than its micro-batches."""
    return min(live // spec.training.pp, spec.training.dp, spec.training.global_micro_batches)


def symmetric_plan(spec: JobSpec, devices: Sequence[int], generation: int) -> ExecutionPlan | None:
    """What a restart from a checkpoint runs: as many full ``training.pp``-stage pipelines as
    the live devices allow up to the job's layout (the job's own layer split), the rest spare:
    a restart takes a standby in a lost device's place. None if not even one pipeline fits."""
    pp = spec.training.pp
    dp = restart_pipelines(spec, len(devices))
    if dp == 0:
        return None
    shrunk = replace(spec, training=replace(spec.training, dp=dp))
    try:
        template = initial_plan(shrunk)
    except PlanningError:
        return None
    ids = sorted(devices)
    pipelines = tuple(
        Pipeline(tuple(ids[i * pp + s] for s in range(pp)), p.layers, p.micro_batches,
                 p.recompute)
        for i, p in enumerate(template.pipelines)
    )
    plan = ExecutionPlan("initial", generation, pipelines, spare_devices=tuple(ids[dp * pp:]))
    return finish(spec, plan)
