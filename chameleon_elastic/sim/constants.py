"""The few figures the baselines need that a job spec does not carry, and where each comes from.

Everything else (step times, peak memory, weight-transfer time, the restart overhead
``cluster.restart_s`` and the re-plan switch ``cluster.switch_s``) comes from the job spec
through ``planning.estimator``, the same model the chameleon policy decides with. The figures
below are assumptions; docs/sim.md explains each.

* ``storage_bandwidth_bytes_per_s`` (default 2 GB/s per device): how fast one device writes or
  reads its checkpoint shard (weights + optimizer state of its layers). 2 GB/s is a typical
  sequential rate of one local NVMe drive or one client's share of a parallel file system; the
  checkpoint baseline pays ``shard / bandwidth`` per save and per load.
* ``checkpoint_interval_s`` (default: Young's optimum ``sqrt(2 x save_s x MTBF)``, MTBF of the
  whole job at its initial size): the interval that minimises save stalls plus expected lost
  work; any fixed interval is worse for the checkpoint baseline, so the default flatters it.
  With no failures the MTBF is infinite and no checkpoint is taken.
* ``oobleck_reconfigure_s`` (default ``cluster.restart_s``): Oobleck's fixed cost per
  reconfiguration (tear down and rebuild the communicators of the new pipelines). Under
  ``cluster.recovery = "relaunch"`` (the paper presets) that is chameleon's own switch cost, so
  the two differ only by what they decide and how much they move, never by a constant we
  picked; under ``"inplace"`` chameleon pays ``cluster.regroup_s`` instead, and this constant
  is what to set to give Oobleck the same.
* ``hybrid_interference`` (default 0): fraction of throughput the hybrid policy loses while it
  stages weight transfers in the background (0 = transfers fully overlap compute).
* ``reroute_timing`` (default ``"closed-form"``): how a rerouted layout's step is timed while it
  runs. ``closed-form`` is the paper's formula, which the planner also decides with; it adds the
  penalties of every hit layer group. ``schedule`` times the executed 1F1B orders
  (``estimator.step_time(..., simulate_reroute=True)``), which overlap them. Decisions always
  use the planner's own estimate; this only changes what the rerouted job then experiences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..plan import ExecutionPlan
from ..spec import JobSpec

__all__ = ["REROUTE_TIMINGS", "BaselineConstants", "checkpoint_shard_bytes", "young_interval_s"]

REROUTE_TIMINGS: tuple[str, ...] = ("closed-form", "schedule")


@dataclass(frozen=True)
class BaselineConstants:
    storage_bandwidth_bytes_per_s: float = 2e9
    checkpoint_interval_s: float | None = None
    oobleck_reconfigure_s: float | None = None
    hybrid_interference: float = 0.0
    reroute_timing: Literal["closed-form", "schedule"] = "closed-form"

    def __post_init__(self) -> None:
        if not (self.storage_bandwidth_bytes_per_s > 0):
            raise ValueError(
                f"storage bandwidth {self.storage_bandwidth_bytes_per_s!r} B/s is invalid; "
                "pass a positive number of bytes per second."
            )
        if self.checkpoint_interval_s is not None and not (self.checkpoint_interval_s > 0):
            raise ValueError(
                f"checkpoint interval {self.checkpoint_interval_s!r} s is invalid; pass a "
                "positive number of seconds or leave it out for Young's optimum."
            )
        if self.oobleck_reconfigure_s is not None and not (self.oobleck_reconfigure_s >= 0):
            raise ValueError(
                f"Oobleck reconfiguration cost {self.oobleck_reconfigure_s!r} s is invalid; "
                "pass a number >= 0."
            )
        if self.reroute_timing not in REROUTE_TIMINGS:
            raise ValueError(
                f"reroute timing {self.reroute_timing!r} is invalid; choose one of: "
                f"{', '.join(REROUTE_TIMINGS)}."
            )
        if not (0.0 <= self.hybrid_interference < 1.0):
            raise ValueError(
                f"hybrid interference {self.hybrid_interference!r} is invalid; pass a fraction "
                "in [0, 1)."
            )

    def save_s(self, spec: JobSpec, plan: ExecutionPlan) -> float:
        return checkpoint_shard_bytes(spec, plan) / self.storage_bandwidth_bytes_per_s

    def interval_s(self, spec: JobSpec, plan: ExecutionPlan) -> float:
        if self.checkpoint_interval_s is not None:
            return self.checkpoint_interval_s
        mtbf = spec.cluster.expected_run_s(len(plan.live_devices))
        return young_interval_s(self.save_s(spec, plan), mtbf)

    def reconfigure_s(self, spec: JobSpec) -> float:
        if self.oobleck_reconfigure_s is not None:
            return self.oobleck_reconfigure_s
        return spec.cluster.restart_s


def checkpoint_shard_bytes(spec: JobSpec, plan: ExecutionPlan) -> float:
    """The largest per-device checkpoint shard: weights + optimizer state of its layers."""
    worst = 0.0
    for role in plan.roles():
        size = sum(spec.model.transfer_bytes(i) for i in range(role.layer_start, role.layer_end))
        worst = max(worst, size)
    return worst


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young (1974): the checkpoint interval that minimises overhead, sqrt(2 x cost x MTBF)."""
    if math.isinf(mtbf_s):
        return math.inf
    return math.sqrt(2.0 * save_s * mtbf_s)
