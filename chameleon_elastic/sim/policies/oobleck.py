"""The Oobleck-like baseline: pipeline templates re-instantiated over the live devices.

Model (after Jang et al., SOSP 2023, reduced to what a step-time model can express):

* Templates: one pipeline template per size from the memory-bound minimum (the fewest stages
  whose every stage fits in device memory) up to one layer per stage. A template splits the
  layers evenly and gives the ``L mod n`` leftover layers to the last stages (they keep the
  fewest activations in flight); with uniform layers every balanced split has the same
  slowest stage, so this is what Oobleck's stage-partitioning would find.
* Fault-tolerance threshold: Oobleck keeps at least ``f + 1`` pipelines so that every layer
  survives ``f`` simultaneous failures; we use its smallest setting, ``f = 1`` (two
  pipelines). Below that the job stops (``stalled``).
* Instantiation: after every failure the live devices are covered by ``k >= f + 1`` pipelines
  of near equal size (sizes differ by at most one), for every feasible ``k``; the mix with the
  best estimated step time wins. Every live device is used; there is no reroute.
* Batch: micro-batches are handed out by throughput, one at a time to the pipeline whose
  1F1B time ``(stages + quota) x slowest stage`` stays lowest, at least one each.
* Placement: surviving devices keep their order (old pipeline, old stage) and fill the new
  pipelines in turn; every missing layer is copied from the first live device (lowest id) that
  holds it, with no attempt to balance links, as Oobleck's copy from "any" replica does.
* Cost: a fixed reconfiguration time (``BaselineConstants.reconfigure_s``) plus the estimator's
  busiest-link transfer time; the step in flight is lost. Repaired devices are not taken back
  (no scale-up).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from ...plan import ExecutionPlan, Pipeline, Transfer
from ...planning import estimator
from ...planning.search import PlanningError, initial_plan
from ...spec import JobSpec
from ..constants import BaselineConstants
from ..engine import EventContext, Phase, Reaction
from .common import STALLED, finish, fits_memory, paused, running

__all__ = ["MIN_PIPELINES", "OobleckPolicy", "first_holder_transfers", "template_layers",
           "throughput_quotas"]

#: Oobleck's fault-tolerance threshold f = 1: at least two pipelines hold every layer.
MIN_PIPELINES = 2


def template_layers(num_layers: int, stages: int) -> tuple[tuple[int, int], ...]:
    """Even split, the leftover layers on the last stages."""
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        size = base + (1 if s >= stages - extra else 0)
        out.append((start, start + size))
        start += size
    return tuple(out)


def throughput_quotas(stage_costs: Sequence[tuple[int, float]], total: int) -> tuple[int, ...]:
    """Micro-batches per pipeline; ``stage_costs[i]`` = (stages, slowest stage F+B seconds)."""
    quotas = [1] * len(stage_costs)
    for _ in range(total - len(stage_costs)):
        best = min(range(len(quotas)),
                   key=lambda i: ((stage_costs[i][0] + quotas[i]) * stage_costs[i][1], i))
        quotas[best] += 1
    return tuple(quotas)


def first_holder_transfers(spec: JobSpec, old: ExecutionPlan,
                           new_pipelines: Sequence[Pipeline]) -> tuple[Transfer, ...]:
    """Missing layers of every device, each from the lowest-id live device that held it."""
    dead = set(old.failed_devices)
    held: dict[int, range] = {}
    for p in old.pipelines:
        for d, (a, b) in zip(p.devices, p.layers):
            if d not in dead:
                held[d] = range(a, b)
    holders = sorted(held)
    moves: dict[tuple[int, int], list[int]] = defaultdict(list)
    for p in new_pipelines:
        for d, (a, b) in zip(p.devices, p.layers):
            mine = held.get(d, range(0))
            for layer in range(a, b):
                if layer in mine:
                    continue
                src = next((h for h in holders if layer in held[h]), None)
                if src is None:
                    raise PlanningError(f"no live device holds layer {layer}")
                moves[(src, d)].append(layer)
    return tuple(
        Transfer(src, dst, tuple(layers), sum(spec.model.transfer_bytes(i) for i in layers))
        for (src, dst), layers in sorted(moves.items())
    )


class OobleckPolicy:
    name = "oobleck"

    def __init__(self, spec: JobSpec, constants: BaselineConstants | None = None) -> None:
        self.spec = spec
        self.constants = constants or BaselineConstants()
        self.plan: ExecutionPlan | None = None
        self.min_stages = next((n for n in range(1, spec.model.layers + 1)
                                if self._fits(template_layers(spec.model.layers, n))), None)

    def _fits(self, layers: tuple[tuple[int, int], ...]) -> bool:
        total = self.spec.training.global_micro_batches
        probe = ExecutionPlan("replan", 0, (Pipeline(tuple(range(len(layers))), layers, total),))
        return fits_memory(self.spec, probe)

    def start(self) -> tuple[Phase, ...]:
        self.plan = initial_plan(self.spec)
        return (running(self.spec, self.plan, "run"),)

    def _instantiate(self, live: Sequence[int], generation: int) -> ExecutionPlan | None:
        spec, total = self.spec, self.spec.training.global_micro_batches
        if self.min_stages is None:
            return None
        best: ExecutionPlan | None = None
        for k in range(MIN_PIPELINES, min(len(live) // self.min_stages, total) + 1):
            q, r = divmod(len(live), k)
            sizes = [q + 1] * r + [q] * (k - r)
            if sizes[0] > spec.model.layers:
                continue
            splits = [template_layers(spec.model.layers, n) for n in sizes]
            costs = [(n, max(sum(estimator.stage_times(spec, a, b)) for a, b in s))
                     for n, s in zip(sizes, splits)]
            quotas = throughput_quotas(costs, total)
            it = iter(live)
            pipelines = tuple(Pipeline(tuple(next(it) for _ in range(n)), s, m)
                              for n, s, m in zip(sizes, splits, quotas))
            plan = finish(spec, ExecutionPlan("replan", generation, pipelines))
            if not fits_memory(spec, plan):
                continue
            assert plan.estimate is not None and (best is None or best.estimate is not None)
            if best is None or plan.estimate.step_time_s < best.estimate.step_time_s - 1e-12:
                best = plan
        return best

    def react(self, ctx: EventContext, failed: Sequence[int],
              joined: Sequence[int]) -> Reaction:
        if self.plan is None:
            return Reaction((STALLED,), 0.0, "stalled")
        working = set(self.plan.working_devices)
        hit = [d for d in failed if d in working]
        spares = tuple(d for d in self.plan.spare_devices if d not in set(failed))
        if not hit:  # a spare died or a device came back: no scale-up, nothing changes
            self.plan = replace(self.plan, spare_devices=spares)
            return Reaction(ctx.remaining, 0.0, "spare")
        order = {d: i for i, d in enumerate(
            d for p in self.plan.pipelines for d in p.devices)}
        survivors = sorted((d for d in working if d not in set(hit)), key=order.__getitem__)
        live = survivors + list(spares)
        new = self._instantiate(live, self.plan.generation + 1)
        if new is None:
            self.plan = None
            return Reaction((STALLED,), ctx.inflight_samples, "stalled")
        dead_now = replace(self.plan, failed_devices=tuple(sorted(set(self.plan.failed_devices)
                                                                  | set(hit))), reroute=())
        try:
            transfers = first_holder_transfers(self.spec, dead_now, new.pipelines)
        except PlanningError:
            self.plan = None
            return Reaction((STALLED,), ctx.inflight_samples, "stalled")
        self.plan = replace(new, transfers=transfers)
        pause = self.constants.reconfigure_s(self.spec) + estimator.transfer_time(
            self.spec, transfers)
        return Reaction((paused(pause, "reconfigure"), running(self.spec, self.plan, "replan")),
                        ctx.inflight_samples, "replan")
