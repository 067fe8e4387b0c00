"""Baselines that fall back on checkpoints: ``checkpoint`` (torchrun-like) and ``recycle``.

``checkpoint``: torchrun with a fixed pipeline depth. A synchronous checkpoint every
``interval`` of training stalls the job for ``save_s`` (shard / storage bandwidth), so its
fault-free step is stretched by ``(interval + save_s) / interval``. When a working device dies
every worker restarts: the job pauses ``cluster.restart_s + load_s``, loses all the work since
the last checkpoint, and resumes with as many full ``training.pp``-stage pipelines as the live
devices allow (the rest idle). Rejoined devices trigger a restart only when they complete one
more pipeline (torchrun's scale-up also resumes from the last checkpoint).

``recycle`` (ReCycle-like): the failed device's micro-batches go to its data-parallel peers
(the planner's ``reroute_plan`` on the job's layout: the same construction the chameleon policy
prices), at no transition cost. A repaired device takes its own slot back. When a stage has no
live replica left, it restarts from the last checkpoint like the baseline above and keeps
rerouting on the new layout. ReCycle's checkpoints are assumed asynchronous (no stall, the
fault-free phase runs at full speed, as the paper describes), taken at the same interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from ...plan import ExecutionPlan
from ...planning.search import PlanningError, initial_plan, reroute_plan
from ...spec import JobSpec
from ..constants import BaselineConstants
from ..engine import EventContext, Phase, Reaction
from .common import STALLED, paused, restart_pipelines, running, symmetric_plan

__all__ = ["CheckpointFallback", "CheckpointPolicy", "RecyclePolicy"]


class CheckpointFallback:
    """Checkpoint bookkeeping: when training last resumed, how often it saves, and the restart
    from the last checkpoint onto full ``training.pp``-stage pipelines."""

    def __init__(self, spec: JobSpec, constants: BaselineConstants | None) -> None:
        self.spec = spec
        self.constants = constants or BaselineConstants()
        self.resumed_s = 0.0
        self.interval_s = math.inf
        self.save_s = 0.0
        self.generation = 0

    def set_layout(self, plan: ExecutionPlan) -> None:
        self.interval_s = self.constants.interval_s(self.spec, plan)
        self.save_s = self.constants.save_s(self.spec, plan)

    def _last_checkpoint_s(self, now_s: float, stalls: bool) -> float:
        """Wall time of the last state that a restart would load."""
        if math.isinf(self.interval_s) or now_s <= self.resumed_s:
            return self.resumed_s
        period = self.interval_s + (self.save_s if stalls else 0.0)
        return self.resumed_s + math.floor((now_s - self.resumed_s) / period) * period

    def _slowdown(self, stalls: bool) -> float:
        """How much longer a step takes on average when saving stalls training."""
        if not stalls or math.isinf(self.interval_s):
            return 1.0
        return (self.interval_s + self.save_s) / self.interval_s

    def begin(self, stalls: bool) -> tuple[Phase, ...]:
        """Training on the initial plan, every device live, saving every interval."""
        self.plan: ExecutionPlan | None = initial_plan(self.spec)
        self.live = set(self.plan.live_devices)
        self.set_layout(self.plan)
        return (running(self.spec, self.plan, "run", slowdown=self._slowdown(stalls)),)

    def needs_restart(self, failed: Sequence[int], joined: Sequence[int]) -> bool:
        """Note the devices lost and back (``live``); whether that takes a restart: a working
        device lost, or enough devices for more pipelines. A standby that died or came back
        waits for the next loss."""
        working = set(self.plan.working_devices) if self.plan is not None else set()
        hit = any(d in working for d in failed)
        self.live = (self.live - set(failed)) | set(joined)
        now_dp = 0 if self.plan is None else len(self.plan.pipelines)
        return hit or restart_pipelines(self.spec, len(self.live)) > now_dp

    def restart(self, ctx: EventContext, live: Sequence[int], stalls: bool, label: str,
                restart_s: float | None = None, redo_steps: int = 0
                ) -> tuple[ExecutionPlan | None, Reaction]:
        """Back to the last checkpoint on ``live``. The pause is ``restart_s`` (default
        ``cluster.restart_s``: new processes, whatever cluster.recovery says), plus
        ``redo_steps`` steps of the new layout (an iteration a restart re-runs before training
        goes on, NVRx's figure), plus the shard's load (as long as saving it)."""
        last = self._last_checkpoint_s(ctx.now_s, stalls)
        lost = max(0.0, ctx.net_since(last)) if ctx.now_s > self.resumed_s else 0.0
        self.generation += 1
        plan = symmetric_plan(self.spec, live, self.generation)
        if plan is None:
            return None, Reaction((STALLED,), lost, "stalled")
        self.set_layout(plan)
        then = running(self.spec, plan, label, slowdown=self._slowdown(stalls))
        assert then.step_time_s is not None
        fixed = self.spec.cluster.restart_s if restart_s is None else restart_s
        pause = fixed + redo_steps * then.step_time_s + self.save_s
        self.resumed_s = ctx.now_s + pause
        return plan, Reaction((paused(pause, "restart"), then), lost, "restart")


class CheckpointPolicy(CheckpointFallback):
    name = "checkpoint"

    def start(self) -> tuple[Phase, ...]:
        return self.begin(stalls=True)

    def react(self, ctx: EventContext, failed: Sequence[int],
              joined: Sequence[int]) -> Reaction:
        if not self.needs_restart(failed, joined):
            return Reaction(ctx.remaining, 0.0, "spare")
        self.plan, reaction = self.restart(ctx, sorted(self.live), stalls=True, label="run")
        return reaction


class RecyclePolicy(CheckpointFallback):
    name = "recycle"

    def start(self) -> tuple[Phase, ...]:
        self.base: ExecutionPlan | None = initial_plan(self.spec)
        self.dead: set[int] = set()
        self.spares = set(self.base.spare_devices)
        self.set_layout(self.base)
        return (running(self.spec, self.base, "run"),)

    def react(self, ctx: EventContext, failed: Sequence[int],
              joined: Sequence[int]) -> Reaction:
        if self.base is None:
            return Reaction((STALLED,), 0.0, "stalled")
        slots = {d for p in self.base.pipelines for d in p.devices}
        hit = {d for d in failed if d in slots and d not in self.dead}
        back = {d for d in joined if d in self.dead}
        self.spares = (self.spares - set(failed)) | (set(joined) - back)
        self.dead = (self.dead | hit) - back
        if not hit and not back:
            return Reaction(ctx.remaining, 0.0, "spare")
        lost = ctx.inflight_samples if hit else 0.0
        base = replace(self.base, spare_devices=tuple(sorted(self.spares)))
        try:
            plan = reroute_plan(self.spec, base, sorted(self.dead))
        except PlanningError:
            live = sorted((slots - self.dead) | self.spares)
            self.base, reaction = self.restart(ctx, live, stalls=False, label="run")
            self.dead = set()
            self.spares = set() if self.base is None else set(self.base.spare_devices)
            return reaction
        timing = self.constants.reroute_timing
        return Reaction((running(self.spec, plan, plan.policy, timing=timing),), lost,
                        "reroute" if hit else "rejoin")
