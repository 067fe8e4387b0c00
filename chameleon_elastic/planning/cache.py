"""Plans for the loss of 1..k devices, computed ahead so a failure costs a lookup.

Only the re-plan is cached: rerouting is linear in the devices and always built fresh. The
cache works *up to symmetry*: two failure sets that differ by swapping interchangeable
pipelines (same layer split, same quota, same already-dead stages) or spares lead to the same
plan with device ids relabelled. So we compute one representative per class and, at lookup,
map the representative's plan onto the real devices. On a dp x pp layout that turns
C(dp*pp, k) failure sets into a handful of classes (pp for one failure).

Thread model: ``warm_in_background`` fills the cache from a daemon thread while training runs;
``decide`` never waits for it (a miss is computed on the spot and stored).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Collection
from dataclasses import replace

from ..plan import AllReduceGroup, ExecutionPlan, PeerShare, Pipeline, Reroute, Transfer
from ..spec import JobSpec
from .search import Decision, PlanningError, PolicyChoice, decide, replan

__all__ = ["PlanCache", "relabel"]

_Key = tuple


class PlanCache:
    def __init__(self, spec: JobSpec, current: ExecutionPlan, depth: int | None = None) -> None:
        self.spec = spec
        self.current = current
        self.depth = spec.planner.cache_failures if depth is None else depth
        self._plans: dict[_Key, ExecutionPlan | PlanningError] = {}
        self._lock = threading.Lock()
        self._classes = _pipeline_classes(current)

    # ------------------------------------------------------------------ symmetry

    def _canonical(self, failed: Collection[int]) -> tuple[_Key, dict[int, int]]:
        """Class key of a failure set, and the map real device -> representative device."""
        cur = self.current
        hit: dict[int, set[int]] = {}
        spares_hit = 0
        for d in failed:
            if d in cur.spare_devices:
                spares_hit += 1
            else:
                p, s = cur.locate(d)
                hit.setdefault(p, set()).add(s)
        mapping: dict[int, int] = {}
        key_parts = []
        for cls, members in self._classes.items():
            # Pipelines with failures first, by pattern; the representative uses the class's
            # first pipelines in the same order, so equal patterns get equal keys.
            ordered = sorted(members, key=lambda p: (tuple(sorted(hit.get(p, ()))) == (),
                                                     tuple(sorted(hit.get(p, ()))), p))
            for real, rep in zip(ordered, members):
                for a, b in zip(cur.pipelines[real].devices, cur.pipelines[rep].devices):
                    mapping[a] = b
            key_parts.append((cls, tuple(tuple(sorted(hit.get(p, ()))) for p in ordered
                                         if p in hit)))
        spares = list(cur.spare_devices)
        real_hit = sorted(d for d in failed if d in cur.spare_devices)
        rest = [d for d in spares if d not in real_hit]
        for a, b in zip(real_hit + rest, spares):
            mapping[a] = b
        return (tuple(key_parts), spares_hit), mapping

    # ------------------------------------------------------------------ API

    def lookup(self, failed: Collection[int]) -> ExecutionPlan | None:
        """The cached re-plan for this failure set, relabelled onto the real devices."""
        key, mapping = self._canonical(failed)
        with self._lock:
            found = self._plans.get(key)
        if found is None:
            return None
        if isinstance(found, PlanningError):
            raise found
        inverse = {b: a for a, b in mapping.items()}
        return relabel(found, inverse)

    def _compute(self, failed: Collection[int]) -> None:
        key, mapping = self._canonical(failed)
        with self._lock:
            if key in self._plans:
                return
        rep = [mapping[d] for d in failed]
        try:
            result: ExecutionPlan | PlanningError = replan(self.spec, self.current, rep)
        except PlanningError as exc:
            result = exc
        with self._lock:
            self._plans.setdefault(key, result)

    def warm(self) -> int:
        """Compute every class of 1..depth failures; returns how many classes are cached."""
        live = list(self.current.live_devices)
        for k in range(1, min(self.depth, len(live) - 1) + 1):
            seen: set[_Key] = set()
            for combo in _representatives(self, live, k):
                key, _ = self._canonical(combo)
                if key not in seen:
                    seen.add(key)
                    self._compute(combo)
        return len(self._plans)

    def warm_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self.warm, name="chameleon-plan-cache", daemon=True)
        thread.start()
        return thread

    def decide(self, failed: Collection[int], joined: Collection[int] = (),
               policy: PolicyChoice = "auto") -> Decision:
        """``planning.decide`` with the re-plan taken from the cache when it is there."""
        replanned = None
        if not joined and policy != "reroute" and 0 < len(failed) <= self.depth:
            try:
                replanned = self.lookup(failed)
                if replanned is None:
                    self._compute(failed)
                    replanned = self.lookup(failed)
            except PlanningError:
                replanned = None  # decide() rebuilds it and reports why it was impossible
        return decide(self.spec, self.current, failed, joined, policy, replanned=replanned)

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)


def _pipeline_classes(plan: ExecutionPlan) -> dict[tuple, list[int]]:
    """Interchangeable pipelines: same layer split, same quota, same dead stages."""
    dead = set(plan.failed_devices)
    classes: dict[tuple, list[int]] = {}
    for i, p in enumerate(plan.pipelines):
        sig = (p.layers, p.micro_batches, tuple(s for s, d in enumerate(p.devices) if d in dead))
        classes.setdefault(sig, []).append(i)
    return classes


def _representatives(cache: PlanCache, live: list[int], k: int):
    """Failure sets of size k that reach every class, without walking all C(n, k) sets: only
    the first k pipelines of each class and the first k spares can matter."""
    cur = cache.current
    pool: list[int] = []
    for members in cache._classes.values():
        for p in members[:k]:
            pool.extend(d for d in cur.pipelines[p].devices if d not in cur.failed_devices)
    pool.extend(cur.spare_devices[:k])
    pool = [d for d in pool if d in set(live)]
    return itertools.combinations(pool, k)


def relabel(plan: ExecutionPlan, mapping: dict[int, int]) -> ExecutionPlan:
    """The same plan with every device id passed through ``mapping`` (identity elsewhere)."""

    def m(d: int) -> int:
        return mapping.get(d, d)

    return replace(
        plan,
        pipelines=tuple(Pipeline(tuple(m(d) for d in p.devices), p.layers, p.micro_batches)
                        for p in plan.pipelines),
        spare_devices=tuple(sorted(m(d) for d in plan.spare_devices)),
        failed_devices=tuple(sorted(m(d) for d in plan.failed_devices)),
        reroute=tuple(Reroute(m(r.device), r.pipeline, r.stage,
                              tuple(PeerShare(m(s.device), s.micro_batches) for s in r.peers))
                      for r in plan.reroute),
        transfers=tuple(Transfer(m(t.src), m(t.dst), t.layers, t.bytes) for t in plan.transfers),
        allreduce_rounds=tuple(
            tuple(AllReduceGroup(g.layers, tuple(sorted(m(d) for d in g.devices))) for g in rnd)
            for rnd in plan.allreduce_rounds
        ),
        estimate=None if plan.estimate is None else replace(
            plan.estimate,
            peak_memory_bytes={m(d): v for d, v in plan.estimate.peak_memory_bytes.items()},
        ),
    )
