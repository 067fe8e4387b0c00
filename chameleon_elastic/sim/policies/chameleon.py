"""The chameleon policy, decided exactly as the launcher decides it, and the hybrid variant.

``chameleon``: at every event, ``PlanCache.decide`` (the launcher's call) prices rerouting and
re-planning with the estimator and keeps the best score. The job pauses for the chosen plan's
estimated transition time (0 for a reroute; weight transfer + ``cluster.switch_s`` for a
re-plan: a regroup in place, or a restart under ``recovery = "relaunch"``), then runs
at its estimated step time. The step in flight when a working device dies is lost (the runtime
resumes at the last committed step). Decision latency is not charged: the launcher computes
plans for the loss of 1..k devices ahead, during fault-free training; the simulator asks the
cache on demand, which yields the same plan, and reports how long that took. When the state is
lost (the chosen re-plan loads layers from the checkpoint because every replica of them died)
or the planner finds no plan (nothing fits), the job restarts from its last checkpoint on the
live devices, exactly as the recycle baseline does (asynchronous checkpoints, a real process
restart ``cluster.restart_s`` + shard load, full ``training.pp``-stage pipelines), and plans
from there.

Slow devices (``slow`` trace events): ``slow`` asks ``planning.stragglers.decide_speeds``, as
the launcher's decider does, whether to keep the layout, reduce the slow devices' work or leave
them spare, and runs the chosen plan at the devices' speeds after its transition. A failure's
plan is made at profiled speeds, then (as the launcher's watch finds a still-slow device again)
the straggler decision follows at once. The launcher's detection window is not charged, and a
restart from the checkpoint runs at profiled speeds.

``hybrid`` (beyond the paper): reroute at once, build the re-plan and stage its weight
transfers in the background while the rerouted layout trains, then pause only for
``cluster.switch_s`` and switch. It switches when, over the expected time to the next failure,
the re-plan's throughput after that pause beats staying rerouted. A failure before the switch
drops the staged plan (the job is still on the reroute layout and decides again from there).
Hybrid asks the planner exactly as chameleon does: the planner does not place a re-plan that
cannot beat rerouting even with the switch as its only pause, and such a re-plan cannot win
hybrid's comparison either (staging gains at most ``max(thr_p (t_run - switch), thr_r t_run)``,
never more than staying rerouted, ``thr_r t_run``), so no switch is lost and no event pays for
a placement that could not be used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ...plan import ExecutionPlan
from ...planning import estimator
from ...planning.cache import PlanCache
from ...planning.search import PlanningError, initial_plan
from ...planning.stragglers import decide_speeds
from ...spec import JobSpec
from ..constants import BaselineConstants
from ..engine import EventContext, Phase, Reaction
from .common import STALLED, paused, running
from .restart import CheckpointFallback

__all__ = ["ChameleonPolicy", "HybridPolicy"]


def _unchanged(old: ExecutionPlan, new: ExecutionPlan) -> bool:
    return old.pipelines == new.pipelines and set(old.failed_devices) == set(new.failed_devices)


class ChameleonPolicy:
    name = "chameleon"

    def __init__(self, spec: JobSpec, constants: BaselineConstants | None = None) -> None:
        self.spec = spec
        self.plan: ExecutionPlan | None = None
        self.cache: PlanCache | None = None
        self.constants = constants or BaselineConstants()
        self.timing = self.constants.reroute_timing
        self.fallback = CheckpointFallback(spec, constants)
        self.speeds: dict[int, float] = {}   # slow devices the plan was made for

    def _adopt(self, plan: ExecutionPlan | None) -> None:
        self.plan = plan
        self.cache = None if plan is None else PlanCache(self.spec, plan)

    def start(self) -> tuple[Phase, ...]:
        self._adopt(initial_plan(self.spec))
        assert self.plan is not None
        self.fallback.set_layout(self.plan)
        return (running(self.spec, self.plan, "run"),)

    def _hit(self, failed: Sequence[int]) -> bool:
        assert self.plan is not None
        working = set(self.plan.working_devices)
        return any(d in working for d in failed)

    def _decide(self, ctx: EventContext, failed: Sequence[int],
                joined: Sequence[int]) -> tuple[ExecutionPlan | None, dict, Reaction | None]:
        """The planner's decision, or the reaction when there is nothing to decide."""
        if self.plan is None or self.cache is None:
            return None, {}, Reaction((STALLED,), 0.0, "stalled")
        hit = self._hit(failed)
        try:
            decision = self.cache.decide(failed, joined)
        except PlanningError:
            return None, {}, self._restart(ctx, failed, joined)
        if decision.chosen.checkpoint_layers:  # state lost: the model restarts, not in place
            return None, {}, self._restart(ctx, failed, joined)
        if _unchanged(self.plan, decision.chosen) and not hit:
            # A spare died or a device came back as a spare: the layout goes on untouched.
            self._adopt(decision.chosen)
            return None, {}, Reaction(ctx.remaining, 0.0, "spare")
        return decision.chosen, decision.candidates, None

    def _restart(self, ctx: EventContext, failed: Sequence[int],
                 joined: Sequence[int]) -> Reaction:
        """Restart from the last checkpoint on the live devices, and plan from there."""
        assert self.plan is not None
        live = sorted((set(self.plan.live_devices) - set(failed)) | set(joined))
        plan, reaction = self.fallback.restart(ctx, live, stalls=False, label="run")
        self._adopt(plan)
        return reaction

    def react(self, ctx: EventContext, failed: Sequence[int],
              joined: Sequence[int]) -> Reaction:
        hit = self.plan is not None and self._hit(failed)
        chosen, _, done = self._decide(ctx, failed, joined)
        if done is not None:
            return done
        assert chosen is not None and chosen.estimate is not None
        self._adopt(chosen)
        pause = chosen.estimate.transition_time_s
        phases = ((paused(pause, "transition"),) if pause > 0 else ()) + (
            running(self.spec, chosen, chosen.policy, timing=self.timing, speeds=self.speeds),)
        kind = chosen.policy
        if self.speeds:   # made at profiled speeds: the straggler decision follows at once
            speeds, self.speeds = self.speeds, {}
            after = self.slow(replace(ctx, remaining=phases), speeds)
            phases, kind = after.phases, f"{kind}+{after.kind}"
        return Reaction(phases, ctx.inflight_samples if hit else 0.0, kind)

    def slow(self, ctx: EventContext, speeds: dict[int, float]) -> Reaction:
        """Keep, reduce or spare for these factors (``planning.stragglers``); nothing is lost:
        the workers regroup between steps."""
        if self.plan is None:
            return Reaction(ctx.remaining, 0.0, "stalled")
        live = {d: f for d, f in speeds.items() if d in self.plan.live_devices}
        decision = decide_speeds(self.spec, self.plan, live, before=self.speeds)
        self.speeds = live
        chosen = decision.chosen
        if chosen.generation == self.plan.generation:   # kept: the rest runs at these speeds
            step = running(self.spec, self.plan, "run", timing=self.timing, speeds=live)
            return Reaction(tuple(p if p.step_time_s is None else
                                  replace(p, step_time_s=step.step_time_s)
                                  for p in ctx.remaining), 0.0, "keep")
        self._adopt(chosen)
        option = next(k for k, p in decision.candidates.items() if p is chosen)
        pause = chosen.estimate.transition_time_s
        return Reaction(((paused(pause, "transition"),) if pause > 0 else ()) + (
            running(self.spec, chosen, option, timing=self.timing, speeds=live),), 0.0, option)


@dataclass(frozen=True)
class _Staged:
    plan: ExecutionPlan
    commit_s: float  # staging done, switch pause begins: from here on the job is on ``plan``


class HybridPolicy(ChameleonPolicy):
    name = "hybrid"

    def __init__(self, spec: JobSpec, constants: BaselineConstants | None = None) -> None:
        super().__init__(spec, constants)
        self.staged: _Staged | None = None

    def react(self, ctx: EventContext, failed: Sequence[int],
              joined: Sequence[int]) -> Reaction:
        staging = self.staged is not None and ctx.now_s < self.staged.commit_s
        if self.staged is not None and not staging:
            self._adopt(self.staged.plan)
        self.staged = None
        hit = self.plan is not None and self._hit(failed)
        lost = ctx.inflight_samples if hit else 0.0
        chosen, candidates, done = self._decide(ctx, failed, joined)
        if done is not None:
            if staging and done.kind == "spare" and self.plan is not None:
                # The staged re-plan counted on the old set of spares: drop it and carry on
                # with the layout that is running.
                return Reaction((running(self.spec, self.plan, "reroute", timing=self.timing,
                                                speeds=self.speeds),),
                                0.0, "spare")
            return done
        assert chosen is not None
        reroute, replan = candidates.get("reroute"), candidates.get("replan")
        if reroute is None:
            # A stage lost every replica: re-plan at once, as chameleon does.
            assert chosen.estimate is not None
            self._adopt(chosen)
            pause = chosen.estimate.transition_time_s
            return Reaction(((paused(pause, "transition"),) if pause > 0 else ())
                            + (running(self.spec, chosen, chosen.policy, timing=self.timing,
                                      speeds=self.speeds),),
                            lost, chosen.policy)
        # From here on ``reroute`` is the layout that keeps running (after a join: the old
        # layout with the newcomers as spares) while the re-plan is staged.
        self._adopt(reroute)
        now_running = running(self.spec, reroute, "reroute", timing=self.timing,
                              speeds=self.speeds)
        if replan is None or replan.estimate is None:
            return Reaction((now_running,), lost, "reroute")
        transfer = estimator.transfer_time(self.spec, replan.transfers)
        switch_s = max(0.0, replan.estimate.transition_time_s - transfer)
        keep = 1.0 - self.constants.hybrid_interference
        thr_r, thr_p = now_running.rate, running(self.spec, replan, "replan", speeds=self.speeds).rate
        t_run = self.spec.cluster.expected_run_s(len(replan.live_devices))
        if math.isinf(t_run):
            switch = thr_p > thr_r
        else:
            stay = thr_r * t_run
            move = (thr_r * keep * min(transfer, t_run)
                    + thr_p * max(0.0, t_run - transfer - switch_s))
            switch = move > stay
        if not switch:
            return Reaction((now_running,), lost, "reroute")
        self.staged = _Staged(replan, ctx.now_s + transfer)
        phases = (
            running(self.spec, reroute, "staging", duration_s=transfer, slowdown=1.0 / keep,
                    timing=self.timing, speeds=self.speeds),
            paused(switch_s, "transition"),
            running(self.spec, replan, "replan", speeds=self.speeds),
        )
        return Reaction(tuple(p for p in phases if p.duration_s > 0), lost, "reroute+replan")
