"""Plans for the loss of 1..k devices, computed ahead so a failure costs a lookup.

Only the re-plan is cached: rerouting is linear in the devices and always built fresh. The
cache works *up to symmetry*: two failure sets that differ by swapping interchangeable
pipelines (same layer split, same quota, same already-dead stages) or spares lead to the same
plan with device ids relabelled. So we compute one representative per class and, at lookup,
map the representative's plan onto the real devices. On a dp x pp layout that turns
C(dp*pp, k) failure sets into a handful of classes (pp for one failure). A re-plan that loads
layers from the checkpoint (a stage lost every replica) is cached like any other; its
``CHECKPOINT`` sources are not devices, so relabelling leaves them alone.

Thread model: ``warm_in_background`` fills the cache from a daemon thread while training runs;
``decide`` never waits for it (on a miss, ``planning.decide`` builds the re-plan itself).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
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
        self._plans: dict[_Key, tuple[ExecutionPlan, dict[int, list[int]]] | PlanningError] = {}
        self._lock = threading.Lock()
        self._classes = _pipeline_classes(current)
        self._class_order = {cls: i for i, cls in enumerate(self._classes)}
        self._class_of = {p: cls for cls, members in self._classes.items() for p in members}
        self._where = {d: (p, s) for p, pipe in enumerate(current.pipelines)
                       for s, d in enumerate(pipe.devices)}

    # ------------------------------------------------------------------ symmetry

    def _canonical(self, failed: Collection[int]) -> tuple[_Key, dict[int, int]]:
        """Class key of a failure set, and the real -> representative map of the devices that
        move (the representative puts a class's failures in its first pipelines, ordered by
        pattern). Only touched pipelines appear in the map, so a lookup costs O(failures)."""
        hit: dict[int, set[int]] = {}
        spares_hit = []
        for d in failed:
            where = self._where.get(d)
            if where is None:
                spares_hit.append(d)
            else:
                hit.setdefault(where[0], set()).add(where[1])
        by_class: dict[tuple, list[int]] = {}
        for p in hit:
            by_class.setdefault(self._class_of[p], []).append(p)
        pipelines = self.current.pipelines
        mapping: dict[int, int] = {}
        key_parts = []
        for cls in sorted(by_class, key=self._class_order.__getitem__):
            real = sorted(by_class[cls], key=lambda p: (tuple(sorted(hit[p])), p))
            rep = self._classes[cls][: len(real)]
            for a, b in _swap(real, rep).items():
                mapping.update(zip(pipelines[a].devices, pipelines[b].devices))
            key_parts.append((self._class_order[cls], tuple(tuple(sorted(hit[p])) for p in real)))
        spares = self.current.spare_devices
        mapping.update(_swap(sorted(spares_hit), list(spares[: len(spares_hit)])))
        return (tuple(key_parts), len(spares_hit)), mapping

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
        plan, touching = found
        return relabel(plan, {b: a for a, b in mapping.items()}, touching)

    def _compute(self, failed: Collection[int]) -> None:
        key, mapping = self._canonical(failed)
        with self._lock:
            if key in self._plans:
                return
        rep = [mapping.get(d, d) for d in failed]
        try:
            plan = replan(self.spec, self.current, rep)
            result: tuple[ExecutionPlan, dict[int, list[int]]] | PlanningError = (
                plan, transfer_index(plan))
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
               policy: PolicyChoice = "auto", *, price_all: bool = False) -> Decision:
        """``planning.decide`` with the re-plan taken from the cache when it is there.

        A miss is not computed into the cache: ``decide`` builds the re-plan itself, and skips
        placing it when it cannot beat rerouting, which a cached computation could not know.
        """
        replanned = None
        if not joined and policy != "reroute" and 0 < len(failed) <= self.depth:
            try:
                replanned = self.lookup(failed)
            except PlanningError:
                replanned = None  # decide() rebuilds it and reports why it was impossible
        return decide(self.spec, self.current, failed, joined, policy, replanned=replanned,
                      price_all=price_all)

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


def transfer_index(plan: ExecutionPlan) -> dict[int, list[int]]:
    """Device -> positions in ``plan.transfers`` of the transfers it sends or receives."""
    index: dict[int, list[int]] = {}
    for i, t in enumerate(plan.transfers):
        if not t.from_checkpoint:
            index.setdefault(int(t.src), []).append(i)
        if t.dst != t.src:
            index.setdefault(t.dst, []).append(i)
    return index


def _relabel_transfers(transfers: tuple[Transfer, ...], mapping: dict[int, int],
                       touching: Mapping[int, Sequence[int]] | None) -> tuple[Transfer, ...]:
    if touching is None:
        hit: Iterable[int] = (i for i, t in enumerate(transfers)
                              if t.src in mapping or t.dst in mapping)
    else:
        hit = sorted({i for d in mapping for i in touching.get(d, ())})
    out = list(transfers)
    for i in hit:
        t = out[i]
        src = t.src if t.from_checkpoint else mapping.get(int(t.src), t.src)
        out[i] = Transfer(src, mapping.get(t.dst, t.dst), t.layers, t.bytes, t.snapshot)
    return tuple(out)


def _swap(real: list[int], rep: list[int]) -> dict[int, int]:
    """A permutation sending ``real[i]`` to ``rep[i]`` that moves nothing else: the items of
    ``rep`` that are not in ``real`` take the places ``real`` vacates."""
    perm = dict(zip(real, rep))
    vacated = sorted(set(real) - set(rep))
    displaced = sorted(set(rep) - set(real))
    perm.update(zip(displaced, vacated))
    return {a: b for a, b in perm.items() if a != b}


def relabel(plan: ExecutionPlan, mapping: dict[int, int],
            touching: Mapping[int, Sequence[int]] | None = None) -> ExecutionPlan:
    """The same plan with every device id passed through ``mapping`` (identity elsewhere).

    Only the parts that name a mapped device are rebuilt, so relabelling a 2048-device plan for
    one failure touches a few pipelines, not the whole layout. ``touching`` (from
    ``transfer_index``) lets the transfers be patched the same way instead of scanned.
    """
    if not mapping:
        return plan
    moved = set(mapping)

    def m(d: int) -> int:
        return mapping.get(d, d)

    def ids(devices: tuple[int, ...], keep_order: bool) -> tuple[int, ...]:
        if moved.isdisjoint(devices):
            return devices
        out = map(mapping.get, devices, devices)  # mapping.get(d, d), at C speed
        return tuple(out) if keep_order else tuple(sorted(out))

    estimate = plan.estimate
    if estimate is not None:
        peaks = dict(estimate.peak_memory_bytes)
        peaks.update({m(d): estimate.peak_memory_bytes[d] for d in moved
                      if d in estimate.peak_memory_bytes})
        estimate = replace(estimate, peak_memory_bytes=peaks)
    return replace(
        plan,
        pipelines=tuple(p if moved.isdisjoint(p.devices)
                        else Pipeline(ids(p.devices, True), p.layers, p.micro_batches,
                                      p.recompute)
                        for p in plan.pipelines),
        spare_devices=ids(plan.spare_devices, False),
        failed_devices=ids(plan.failed_devices, False),
        reroute=tuple(Reroute(m(r.device), r.pipeline, r.stage,
                              tuple(PeerShare(m(s.device), s.micro_batches) for s in r.peers))
                      for r in plan.reroute),
        transfers=_relabel_transfers(plan.transfers, mapping, touching),
        allreduce_rounds=tuple(
            tuple(AllReduceGroup(g.layers, ids(g.devices, False)) for g in rnd)
            for rnd in plan.allreduce_rounds
        ),
        estimate=estimate,
    )
