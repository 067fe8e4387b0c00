"""The torchft-like baseline: replica groups drop out of a per-step quorum and heal back in.

Why a model of it: torchft (meta-pytorch/torchft, ``torchft/manager.py``, ``src/lighthouse.rs``)
is the closest published design to in-place recovery: no checkpoint reload, survivors go on.
What it cannot do is re-plan a pipeline: its failure unit is a whole replica group (pipeline
and tensor parallelism live inside a group), so the loss of one device takes its whole group
out until the group is whole again and has healed from a healthy peer.

Mechanism modelled (every figure a ``BaselineConstants`` field, sourced in sim/constants.py):

* one replica group per pipeline of the job's initial layout (``training.dp`` groups of
  ``training.pp`` devices). At the loss of a device of a group in the quorum, the surviving
  groups pause ``torchft_failure_s`` (detection, the aborted step, the quorum's
  reconfiguration: 5.11 s measured side by side with ours, torchft 0.2.0, default timeouts),
  and every group's step in flight is lost (the step's commit vote fails);
* the survivors then train on: every group keeps its own micro-batches (torchft's global batch
  shrinks with the quorum, nothing is redistributed), so the step time is the full layout's and
  the samples per step scale by ``live groups / training.dp``;
* the group is whole again when a standby (a device beyond the job's size, or a repaired one)
  takes each lost device's place: torchft's lighthouse assigns a hot spare. With none left it
  waits for a repair (a ``join`` in the trace). Once whole, it restarts its processes
  (``torchft_restart_s``, 7 s measured) and heals its state from a healthy group
  (``shard / torchft_heal_bandwidth_bytes_per_s``, every device of the group in parallel);
* it then joins the quorum, which costs the survivors ``torchft_join_s`` (a reconfiguration
  without a timeout to wait out).

Simplified: the data-parallel all-reduce over fewer groups is not made cheaper (the full
layout's step time throughout, a small cost against torchft). No checkpoint is ever read: with
one group left standing torchft keeps training; were every group out at once, nothing would
train until one healed, and it would heal as if a peer still held the state (torchft would
need a checkpoint then: not charged, and it takes every group failing within one heal). Both
are stated in docs/sim.md beside the figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from ...plan import ExecutionPlan
from ...planning.search import initial_plan
from ...spec import JobSpec
from ..constants import BaselineConstants, checkpoint_shard_bytes
from ..engine import EventContext, Phase, Reaction
from .common import paused, running

__all__ = ["TorchftPolicy", "quorum_phases"]


def quorum_phases(full: Phase, groups: int, live: int, pause_s: float,
                  ready_in_s: Sequence[float], join_s: float) -> tuple[Phase, ...]:
    """The schedule from now: ``pause_s`` paused, then ``live`` of ``groups`` groups training,
    one more (after a ``join_s`` pause) at each of ``ready_in_s`` (seconds from now, when a
    healed group is ready). Pure, so that the rule can be tested apart from the bookkeeping.
    ``full`` is the whole layout's running phase; ``live`` groups run its step with
    ``live / groups`` of its samples and devices."""
    def at(n: int, duration: float) -> Phase:
        if n == 0:
            return paused(duration, "no quorum")
        return replace(full, duration_s=duration, samples_per_step=full.samples_per_step * n
                       / groups, working_devices=full.working_devices * n // groups,
                       label="run" if n == groups else "quorum")

    phases: list[Phase] = [paused(pause_s, "quorum change")] if pause_s > 0 else []
    t = pause_s
    for ready in sorted(ready_in_s):
        if ready > t:
            phases.append(at(live, ready - t))
            t = ready
        if join_s > 0:
            phases.append(paused(join_s, "join"))
            t += join_s
        live += 1
    phases.append(at(live, math.inf))
    return tuple(phases)


class TorchftPolicy:
    name = "torchft"

    def __init__(self, spec: JobSpec, constants: BaselineConstants | None = None) -> None:
        self.spec = spec
        self.constants = constants or BaselineConstants()

    def start(self) -> tuple[Phase, ...]:
        plan: ExecutionPlan = initial_plan(self.spec)
        self.full = running(self.spec, plan, "run")
        self.members = [set(p.devices) for p in plan.pipelines]   # each group's devices
        self.size = self.spec.training.pp
        self.spares = set(plan.spare_devices)
        self.ready_s = [0.0] * len(self.members)   # when each group is (back) in the quorum
        self.heal_s = (self.constants.torchft_restart_s + checkpoint_shard_bytes(self.spec, plan)
                       / self.constants.torchft_heal_bandwidth_bytes_per_s)
        self.paused_until = 0.0
        return (self.full,)

    def _fill(self, now_s: float) -> None:
        """A standby in each lost device's place (the lighthouse's hot spare), lowest ids
        first; a group made whole starts its restart and heal now."""
        for g, members in enumerate(self.members):
            while len(members) < self.size and self.spares:
                spare = min(self.spares)
                self.spares.discard(spare)
                members.add(spare)
            if len(members) == self.size and math.isinf(self.ready_s[g]):
                self.ready_s[g] = now_s + self.heal_s

    def react(self, ctx: EventContext, failed: Sequence[int],
              joined: Sequence[int]) -> Reaction:
        now = ctx.now_s
        hit = False
        self.spares |= set(joined)
        for d in failed:
            self.spares.discard(d)
            for g, members in enumerate(self.members):
                if d in members:
                    members.discard(d)
                    hit = hit or self.ready_s[g] <= now   # it was in the quorum
                    self.ready_s[g] = math.inf
        self._fill(now)
        if hit:
            self.paused_until = now + self.constants.torchft_failure_s
        live = sum(1 for r in self.ready_s if r <= now)
        ready_in = [r - now for r in self.ready_s if now < r < math.inf]
        phases = quorum_phases(self.full, len(self.members), live,
                               max(0.0, self.paused_until - now), ready_in,
                               self.constants.torchft_join_s)
        lost = ctx.inflight_samples if hit else 0.0
        return Reaction(phases, lost, "group-lost" if hit else "spare")
