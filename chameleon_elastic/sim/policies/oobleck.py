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
* Recomputation: ignored. Templates are sized, fitted and timed without activation
  recomputation (whatever ``planner.recompute`` says); only the starting layout, the
  planner's ``initial_plan``, may carry recomputing stages. A job that fits only with
  recomputation therefore has fewer templates here than the planner considers.

At 2048 devices "every feasible k" is a thousand mixes per failure, so each mix is priced from
its two pipeline classes (quotas per class, all-reduce from class counts, the estimator's own
formulas) and only the winner is built as a plan; mixes are priced in order of a compute floor
(some pipeline runs at least ceil(B / k) micro-batches) and the rest dropped once the floor
cannot win. The choice is the one pricing every mix as a full plan makes (tested).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from ...plan import ExecutionPlan, Pipeline, Transfer
from ...planning import estimator, memory
from ...planning.candidates import allreduce_time_by_class, balanced_shape, split_counts
from ...planning.search import PlanningError, initial_plan
from ...spec import JobSpec
from ..constants import BaselineConstants
from ..engine import EventContext, Phase, Reaction
from .common import STALLED, finish, paused, running

__all__ = ["MIN_PIPELINES", "OobleckPolicy", "first_holder_transfers", "quotas_by_class",
           "template_layers"]

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


def quotas_by_class(classes: Sequence[tuple[int, float, int]], total: int
                    ) -> list[tuple[int, int]]:
    """Micro-batches by throughput, for pipelines given as contiguous classes ``(stages,
    slowest stage F+B seconds, how many)`` in pipeline order: per class ``(quota, how many of
    its first members take one more)``.

    Oobleck's rule, one micro-batch at a time (at least one each): the next goes to the
    pipeline whose ``(stages + quota) x slowest stage`` is least, ties to the lowest index
    (tests/sim/test_oobleck.py keeps that definition and checks this against it). Members of a
    class at the same quota have the same key and lower indices than any later
    class, so once the greedy picks a class it gives the class's whole level before anyone
    else: one step per level, not per micro-batch.
    """
    base = [1] * len(classes)
    ahead = [0] * len(classes)
    left = total - sum(count for *_, count in classes)
    while left > 0:
        i = min(range(len(classes)),
                key=lambda c: ((classes[c][0] + base[c]) * classes[c][1], c))
        give = min(classes[i][2] - ahead[i], left)
        ahead[i] += give
        left -= give
        if ahead[i] == classes[i][2]:
            base[i], ahead[i] = base[i] + 1, 0
    return list(zip(base, ahead))


def first_holder_transfers(spec: JobSpec, old: ExecutionPlan,
                           new_pipelines: Sequence[Pipeline]) -> tuple[Transfer, ...]:
    """Missing layers of every device, each from the lowest-id live device that held it."""
    dead = set(old.failed_devices)
    held: dict[int, range] = {}
    for p in old.pipelines:
        for d, (a, b) in zip(p.devices, p.layers):
            if d not in dead:
                held[d] = range(a, b)
    first: dict[int, int] = {}
    for h in sorted(held, reverse=True):
        first.update(dict.fromkeys(held[h], h))
    moves: dict[tuple[int, int], list[int]] = defaultdict(list)
    for p in new_pipelines:
        for d, (a, b) in zip(p.devices, p.layers):
            mine = held.get(d, range(0))
            for layer in range(a, b):
                if layer in mine:
                    continue
                src = first.get(layer)
                if src is None:
                    raise PlanningError(f"no live device holds layer {layer}")
                moves[(src, d)].append(layer)
    return tuple(
        Transfer(src, dst, tuple(layers), sum(spec.model.transfer_bytes(i) for i in layers))
        for (src, dst), layers in sorted(moves.items())
    )


#: A priced mix: runs of identical pipelines (layer split, quota, how many) in pipeline order.
_Runs = tuple[tuple[tuple[tuple[int, int], ...], int, int], ...]


class OobleckPolicy:
    name = "oobleck"

    def __init__(self, spec: JobSpec, constants: BaselineConstants | None = None) -> None:
        self.spec = spec
        self.constants = constants or BaselineConstants()
        self.plan: ExecutionPlan | None = None
        self._templates: dict[int, tuple[tuple[tuple[int, int], ...], float, float]] = {}
        self.min_stages = next(
            (n for n in range(1, spec.model.layers + 1)
             if memory.pipeline_fits(spec, template_layers(spec.model.layers, n),
                                     spec.training.global_micro_batches)), None)

    def start(self) -> tuple[Phase, ...]:
        self.plan = initial_plan(self.spec)
        return (running(self.spec, self.plan, "run"),)

    def _split(self, stages: int) -> tuple[tuple[tuple[int, int], ...], float, float]:
        """The template of ``stages`` stages, its slowest stage's F+B seconds, and its largest
        stage's gradient bytes."""
        if stages not in self._templates:
            spec = self.spec
            split = template_layers(spec.model.layers, stages)
            self._templates[stages] = (
                split, max(sum(estimator.stage_times(spec, a, b)) for a, b in split),
                max(math.fsum(spec.model.param_bytes[a:b]) for a, b in split))
        return self._templates[stages]

    def _floor(self, live: int, k: int) -> float:
        """No mix of k pipelines steps faster. Compute: one pipeline runs ceil(B / k)
        micro-batches. Sync: every pipeline holds the whole model, so each layer has k holders,
        and the buckets of one device go in distinct rounds; the device with the largest stage
        spends at least that stage's ring all-reduce in them."""
        spec = self.spec
        q = -(-spec.training.global_micro_batches // k)
        classes = balanced_shape(live, k)
        compute = min(estimator.pipeline_time(spec, self._split(n)[0], q) for n, _ in classes)
        grads = max(self._split(n)[2] for n, _ in classes)
        return compute + 2.0 * (k - 1) / k * grads / spec.cluster.bandwidth_bytes_per_s

    def _price(self, live: int, k: int) -> tuple[float, _Runs] | None:
        """Step time of the k-pipeline mix and its runs, or None if it does not fit in memory."""
        spec = self.spec
        classes = balanced_shape(live, k)
        quotas = quotas_by_class([(n, self._split(n)[1], c) for n, c in classes],
                                 spec.training.global_micro_batches)
        runs: _Runs = tuple(
            (self._split(n)[0], q, count)
            for (n, c), (base, plus) in zip(classes, quotas)
            for q, count in ((base + 1, plus), (base, c - plus)) if count
        )
        if not all(memory.pipeline_fits(spec, split, q) for split, q, _ in runs):
            return None
        compute = max(estimator.pipeline_time(spec, split, q) for split, q, _ in runs)
        return compute + allreduce_time_by_class(spec, split_counts(runs)), runs

    def _instantiate(self, live: Sequence[int], generation: int) -> ExecutionPlan | None:
        """The mix with the least step time (ties: fewer pipelines), built on ``live`` in order."""
        spec = self.spec
        if self.min_stages is None:
            return None
        n = len(live)
        mixes = [k for k in range(MIN_PIPELINES,
                                  min(n // self.min_stages, spec.training.global_micro_batches) + 1)
                 if -(-n // k) <= spec.model.layers]
        best: tuple[float, int, _Runs] | None = None
        for floor, k in sorted((self._floor(n, k), k) for k in mixes):
            if best is not None and round(floor, 9) > best[0]:
                break
            priced = self._price(n, k)
            if priced is not None and (best is None or (round(priced[0], 9), k) < best[:2]):
                best = (round(priced[0], 9), k, priced[1])
        if best is None:
            return None
        it = iter(live)
        pipelines = tuple(Pipeline(tuple(next(it) for _ in split), split, q)
                          for split, q, count in best[2] for _ in range(count))
        return finish(spec, ExecutionPlan("replan", generation, pipelines))

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
