"""Layer splits: which layers each stage of a pipeline holds, and which stages recompute.

Every layout the planner builds (the initial one, each re-plan candidate) is made of pipelines
of some length running some micro-batch quota, and each asks the same question: how to cut the
model's L layers into N_pp stages. The answer depends only on (job, stages, quota), never on
devices, holdings or the layout around the pipeline, and it is where device memory and
``planner.recompute`` enter the search: a split with a stage that fits in no way the policy
allows is dropped, and a stage that fits only with recomputation gets its flag here
(``stage_recompute``, ``recompute_flags``). So it lives on its own, below the candidate layouts
(``candidates``), which ask it for every pipeline length and quota they price, and below the
policies (``search``), which ask ``stage_recompute`` of a reroute's overflowing peers;
``stragglers`` asks ``recompute_flags`` of its re-splits.

The split is even; the r = L mod N_pp leftover layers go to the choice of stages that fits with
the least pipeline time (fewer recomputing stages on ties). The C(N_pp, r) choices are
enumerated up to ``MAX_SPLIT_ENUMERATION``, each skipped unsimulated when its
``estimator.pipeline_time_floor`` can neither beat nor tie the best; with identical layers three
structured choices (first, evenly spaced, last stages) decide when the fastest of them fits
with the flags it would have in unlimited memory. Each shortcut is tested against the plain
computation it replaces (tests/planning/test_search_candidates.py, test_fast_paths.py).
Memoised per (job, stages, quota): a search asks for the same few splits thousands of times.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable, Sequence
from functools import lru_cache

from ..spec import PER_LAYER_KEYS, JobSpec, ModelProfile
from . import estimator, memory

__all__ = [
    "FLOOR_MARGIN",
    "MAX_SPLIT_ENUMERATION",
    "Split",
    "recompute_flags",
    "split_layers",
    "stage_recompute",
]

# C(N_pp, r) layer splits are enumerated exactly up to this many; beyond it (very long
# pipelines) only the structured choices are tried (exact for uniform layers, see
# ``_split_layers_cached``).
MAX_SPLIT_ENUMERATION = 2048

# Lower bounds are summed in another order than the figures they bound: a candidate is skipped
# only when its bound, lowered by this relative margin, still cannot beat the best one.
FLOOR_MARGIN = 1e-9

#: A layer split, one [start, end) per stage.
Split = tuple[tuple[int, int], ...]


def _ranges(sizes: Iterable[int]) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return tuple(out)


def _structured_choices(stages: int, extra: int) -> list[tuple[int, ...]]:
    """Which stages get a leftover layer: the first ones, evenly spaced, or the last ones
    (least activation memory), in the order ``itertools.combinations`` would visit them."""
    step = stages / extra if extra else 1.0
    return sorted({tuple(range(extra)), tuple(sorted({int(i * step) for i in range(extra)})),
                   tuple(range(stages - extra, stages))})


def _uniform(model: ModelProfile) -> bool:
    return (all(len(set(getattr(model, key))) <= 1 for key in PER_LAYER_KEYS)
            and len(set(model.boundary_figures)) <= 1)


def stage_recompute(spec: JobSpec, start: int, end: int, in_flight: int) -> bool | None:
    """Whether a stage holding layers ``[start, end)`` with ``in_flight`` micro-batches
    recomputes under ``planner.recompute``, or None when it fits in device memory neither way
    the policy allows: ``never`` only without, ``always`` only with, ``auto`` without when that
    fits (recomputation costs a forward per backward), else with."""
    limit = spec.cluster.device_memory_bytes
    policy = spec.planner.recompute
    if policy != "always" and memory.stage_memory(spec, start, end, in_flight) <= limit:
        return False
    if policy != "never" and memory.stage_memory(spec, start, end, in_flight, True) <= limit:
        return True
    return None


def recompute_flags(spec: JobSpec, layers: Sequence[tuple[int, int]], micro_batches: int
                    ) -> tuple[bool, ...] | None:
    """Per stage of a plain 1F1B pipeline holding ``layers`` (stage ``i`` with
    ``min(N_pp - i, N_m)`` micro-batches in flight), ``stage_recompute``; None when some stage
    fits in no way the policy allows, which is what drops a split from the search."""
    n = len(layers)
    flags = []
    for i, (a, b) in enumerate(layers):
        flag = stage_recompute(spec, a, b, min(n - i, micro_batches))
        if flag is None:
            return None
        flags.append(flag)
    return tuple(flags)


@lru_cache(maxsize=4096)
def _split_layers_cached(spec: JobSpec, stages: int, quota: int
                         ) -> tuple[Split, tuple[bool, ...]] | None:
    base, extra = divmod(spec.model.layers, stages)
    unchecked = (spec.planner.recompute == "always",) * stages  # the flags if memory were free

    def fastest(choices: Iterable[Collection[int]], must_fit: bool = True):
        """The first split (in the given order) with the least pipeline time, and its flags;
        on equal times the one with fewer recomputing stages."""
        best, best_key = None, (math.inf, math.inf)
        for chosen in choices:
            picked = set(chosen)
            layers = _ranges(base + (1 if s in picked else 0) for s in range(stages))
            flags = recompute_flags(spec, layers, quota) if must_fit else unchecked
            if flags is None:
                continue
            n = sum(flags)
            if best is not None and _cannot_win(
                    estimator.pipeline_time_floor(spec, layers, quota, flags), n, best_key):
                continue  # its time could neither beat nor tie the best: not simulated
            t = estimator.pipeline_time(spec, layers, quota, flags)
            if t < best_key[0] - 1e-12 or (t <= best_key[0] + 1e-12 and n < best_key[1]):
                best, best_key = (layers, flags), (t, n)
        return best

    structured = _structured_choices(stages, extra)
    if _uniform(spec.model):
        # With identical layers the fastest split is always a structured one, and the very one
        # the enumeration below picks, ties included (test_search_candidates.py checks both):
        # when that split fits with the flags it would have in unlimited memory, no split can
        # be faster (recomputation only slows one down) and the C(N_pp, r) walk is not needed.
        best = fastest(structured, must_fit=False)
        if best is not None and recompute_flags(spec, best[0], quota) == unchecked:
            return best
    if math.comb(stages, extra) <= MAX_SPLIT_ENUMERATION:
        return fastest(itertools.combinations(range(stages), extra))
    return fastest(structured)


def _cannot_win(floor: float, recomputing: int, best_key: tuple[float, float]) -> bool:
    """Whether a split whose time is at least ``floor`` (``pipeline_time_floor``) and that
    recomputes on ``recomputing`` stages would lose to ``best_key`` in ``fastest``'s test:
    it replaces the best when faster by 1e-12, or within 1e-12 with fewer recomputing stages."""
    low = floor * (1.0 - FLOOR_MARGIN)
    best_t, best_n = best_key
    return low >= best_t - 1e-12 and (recomputing >= best_n or low > best_t + 1e-12)


def split_layers(spec: JobSpec, stages: int, quota: int) -> tuple[tuple[int, int], ...] | None:
    """Even split; the r = L mod N_pp leftover layers go to the choice of stages that fits in
    memory (recomputing where ``planner.recompute`` says, ``recompute_flags``) with the least
    pipeline time; None when no choice fits."""
    found = _split_of(spec, stages, quota)
    return None if found is None else found[0]


def _split_of(spec: JobSpec, stages: int, quota: int) -> tuple[Split, tuple[bool, ...]] | None:
    """``split_layers`` with the split's recomputation flags."""
    if stages > spec.model.layers or stages < 1:
        return None
    return _split_layers_cached(spec, stages, max(quota, 1))
