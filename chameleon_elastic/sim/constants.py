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
* ``torchft_failure_s`` (default 5.11 s): what the surviving replica groups of the torchft-like
  baseline lose at the loss of a group, the step in flight aside: detection, the failed
  step's abort and the quorum's reconfiguration. Measured side by side with ours
  (the project's anchors: kill -9 of 1 of 4 DP workers -> next committed step, torchft 0.2.0
  with its default timeouts, on CPU; 1.18 s with 1 s timeouts).
* ``torchft_join_s`` (default 0.1 s): what the survivors lose when a healed group joins the
  quorum (a reconfiguration without a timeout to wait out): the 1.18 s measured with 1 s
  timeouts, less that timeout and the 0.1 s step it includes, rounded up.
* ``torchft_restart_s`` (default 7 s): a healed group's process start before it fetches state
  ("a restarted replica needs about 7 s, mostly process start and import torch", torchft 0.2.0
  on CPU, ANCHORS.md).
* ``torchft_heal_bandwidth_bytes_per_s`` (default 4 GB/s): how fast a healing rank receives its
  state from a healthy peer (torchft's HTTP checkpoint transport: 12 GB in ~3 s, ANCHORS.md).
* ``nvrx_restart_s`` (default 1.5 s): NVRx in-process restart at 16k ranks, the iteration it
  re-runs and the checkpoint it reloads aside: ~0.5 s teardown + 0.5 s rank assignment + 0.5 s
  barrier (NVRx ``inprocess`` docs, ANCHORS.md).
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
    torchft_failure_s: float = 5.11
    torchft_join_s: float = 0.1
    torchft_restart_s: float = 7.0
    torchft_heal_bandwidth_bytes_per_s: float = 4e9
    nvrx_restart_s: float = 1.5

    def __post_init__(self) -> None:
        for name in ("torchft_failure_s", "torchft_join_s", "torchft_restart_s",
                     "nvrx_restart_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name.replace('_', ' ')} {value!r} is invalid; pass a "
                                 "finite number of seconds >= 0.")
        if not (self.torchft_heal_bandwidth_bytes_per_s > 0):
            raise ValueError(
                f"torchft heal bandwidth {self.torchft_heal_bandwidth_bytes_per_s!r} B/s is "
                "invalid; pass a positive number of bytes per second."
            )
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
    """The largest per-device checkpoint shard: weights + optimizer state of its layers.
    Summed once per distinct layer range of a working device: a 16k-device plan holds 2048
    roles but 16 ranges, and a restart asks for this twice."""
    dead = set(plan.failed_devices)
    ranges = {p.layers[s] for p in plan.pipelines for s, d in enumerate(p.devices)
              if d not in dead}
    return max((sum(spec.model.transfer_bytes(i) for i in range(a, b)) for a, b in ranges),
               default=0.0)


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young (1974): the checkpoint interval that minimises overhead, sqrt(2 x cost x MTBF)."""
    if math.isinf(mtbf_s):
        return math.inf
    return math.sqrt(2.0 * save_s * mtbf_s)
