"""The planner's fast paths give exactly what the straightforward computations give.

Each fast path (issue 27: a cold decision at 16k devices within 0.1 s) is checked here against
the plain computation it replaces, float for float and choice for choice: the 1F1B makespan
in one topological pass against ``simulate`` of the device orders; the lower bounds that let
the search skip candidates against the figures they bound, and the whole search with them
against the search with every bound switched off; the restorer's array assignment against
the per-device loop it replaced; the DSatur colouring against networkx's.
"""

from __future__ import annotations

import itertools
import math
import pickle
from dataclasses import replace

import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chameleon_elastic.plan import ExecutionPlan, Pipeline
from chameleon_elastic.planning import (
    PlanningError,
    candidates,
    decide,
    initial_plan,
    layer_splits,
    search,
)
from chameleon_elastic.planning.allreduce import dsatur
from chameleon_elastic.planning.estimator import pipeline_time, pipeline_time_floor
from chameleon_elastic.planning.restorer import (
    _assign,
    _live_cells,
    _prefix_bytes,
    _slot_cells,
    _slot_table,
    place,
)
from chameleon_elastic.planning.schedule import (
    device_orders,
    pipeline_end,
    pipeline_end_floor,
    pipeline_schedule,
    simulate,
)
from chameleon_elastic.spec import JobSpec

pytestmark = pytest.mark.timeout(120)

durations = st.sampled_from([0.0, 0.1, 0.25, 1.0, 2.5, 3.0, 0.7])


# --------------------------------------------------------------------------- one pipeline


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(durations, durations), min_size=1, max_size=7),
       st.integers(0, 9))
def test_one_pass_schedule_equals_the_simulated_orders(stage_times, micro_batches):
    n = len(stage_times)
    plan = ExecutionPlan("initial", 0, (Pipeline(tuple(range(n)), tuple(
        (s, s + 1) for s in range(n)), micro_batches),)).validate()
    timeline = simulate(device_orders(plan),
                        lambda op: stage_times[op.stage][0 if op.kind == "F" else 1])
    ends = pipeline_schedule(tuple(stage_times), micro_batches)
    for s in range(n):
        for m in range(micro_batches):
            assert ends[s][0][m] == timeline.end[("F", 0, m, s)]
            assert ends[s][1][m] == timeline.end[("B", 0, m, s)]
    assert pipeline_end(tuple(stage_times), micro_batches) == timeline.makespan


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(durations, durations), min_size=1, max_size=9),
       st.integers(0, 12))
def test_path_floor_never_exceeds_the_makespan(stage_times, micro_batches):
    floor = pipeline_end_floor(tuple(stage_times), micro_batches)
    margin = 1 - layer_splits.FLOOR_MARGIN
    assert floor * margin <= pipeline_end(tuple(stage_times), micro_batches)


def test_path_floor_is_the_makespan_of_identical_stages():
    for n, nm in itertools.product(range(1, 7), range(1, 9)):
        times = ((0.5, 1.25),) * n
        assert pipeline_end_floor(times, nm) == pytest.approx(pipeline_end(times, nm))


# --------------------------------------------------------------------------- the search


def job(layers: int, devices: int, dp: int, pp: int, mbs: int, fwd: list[float],
        activation: list[float], memory: float, recompute: str, templates: bool) -> JobSpec:
    return JobSpec.from_dict({
        "model": {"layers": layers, "forward_s": fwd, "backward_s": [2 * f for f in fwd],
                  "param_bytes": 1e8, "optimizer_bytes": 2e8, "activation_bytes": activation},
        "cluster": {"devices": devices, "device_memory_bytes": memory,
                    "bandwidth_bytes_per_s": 1e9, "restart_s": 5.0,
                    "failure_rate_per_hour": 0.1},
        "training": {"dp": dp, "pp": pp, "global_micro_batches": mbs},
        "planner": {"templates": templates, "recompute": recompute},
    })


@st.composite
def jobs(draw):
    layers = draw(st.integers(2, 12))
    pp = draw(st.integers(1, min(4, layers)))
    dp = draw(st.integers(2, 5))
    uniform = draw(st.booleans())
    fwd = [0.01] * layers if uniform else draw(
        st.lists(st.sampled_from([0.005, 0.01, 0.02]), min_size=layers, max_size=layers))
    activation = draw(st.lists(st.sampled_from([1e7, 1e8, 4e8]), min_size=layers,
                               max_size=layers))
    return job(layers, dp * pp + draw(st.integers(0, 3)), dp, pp,
               dp * draw(st.sampled_from([1, 2, 3, 4])), fwd, activation,
               draw(st.sampled_from([2e9, 3e9, 64e9])),
               draw(st.sampled_from(["auto", "never", "always"])), draw(st.booleans()))


def plain_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bound at zero: the search then prices every candidate it used to."""
    # the floors live in ``candidates``; the walk (``search._best_layout``) reads search's names
    monkeypatch.setattr(search, "_shape_floor", lambda spec, shape: 0.0)
    monkeypatch.setattr(search, "_allreduce_floor", lambda spec, shape: 0.0)
    monkeypatch.setattr(search, "_compute_floor", lambda spec, shape: 0.0)
    monkeypatch.setattr(search.estimator, "pipeline_time_floor", lambda *a, **k: 0.0)


def clear_memos() -> None:
    for module in (layer_splits, candidates, search.estimator, search.memory):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()


def decisions(spec: JobSpec, seed: int) -> list[str]:
    """repr of up to three successive decisions (chosen, candidates, rejected), or errors."""
    out = []
    try:
        current = initial_plan(spec)
    except PlanningError as exc:
        return [str(exc)]
    rng = np.random.default_rng(seed)
    for _ in range(3):
        live = list(current.live_devices)
        if len(live) < 2:
            break
        failed = [int(d) for d in rng.choice(live, size=1 + (len(live) > 4), replace=False)]
        try:
            out.append(repr(decide(spec, current, failed)))  # a re-plan placed only to win
            decision = decide(spec, current, failed, price_all=True)
        except PlanningError as exc:
            out.append(str(exc))
            break
        out.append(repr(decision))
        current = decision.chosen
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(jobs(), st.integers(0, 1000))
def test_search_with_bounds_decides_as_the_search_without(monkeypatch, spec, seed):
    clear_memos()
    fast = decisions(spec, seed)
    with monkeypatch.context() as patched:
        plain_search(patched)
        clear_memos()
        plain = decisions(spec, seed)
    clear_memos()
    assert fast == plain


@settings(max_examples=60, deadline=None)
@given(jobs(), st.integers(1, 12), st.integers(1, 9))
def test_split_floor_is_below_every_split_the_search_makes(spec, stages, quota):
    if stages > spec.model.layers:
        return
    base, extra = divmod(spec.model.layers, stages)
    if math.comb(stages, extra) > 60:
        return
    margin = 1 - layer_splits.FLOOR_MARGIN
    floor = candidates._split_floor(spec.model, stages, quota) * margin
    for heavy in itertools.combinations(range(stages), extra):
        layers = layer_splits._ranges(base + (s in heavy) for s in range(stages))
        for flags in {(False,) * stages, (True,) * stages,
                      tuple(s in heavy for s in range(stages))}:
            assert floor <= pipeline_time(spec, layers, quota, flags)
            assert pipeline_time_floor(spec, layers, quota, flags) * (
                1 - layer_splits.FLOOR_MARGIN) <= pipeline_time(spec, layers, quota, flags)


# --------------------------------------------------------------------------- the restorer


def plain_assign(spec: JobSpec, current: ExecutionPlan, layout: list[Pipeline],
                 live: list[int]) -> list[int | None]:
    """The assignment device by device, as it was written before it ran on arrays."""
    slots = _slot_table(layout, current.num_layers)
    working = set(current.working_devices)
    where = {d: (i, s, rng) for i, p in enumerate(current.pipelines)
             for s, (d, rng) in enumerate(zip(p.devices, p.layers)) if d in working}
    held = {d: where[d][2] if d in where else (0, 0) for d in live}
    dev_classes: dict = {}
    for d in live:
        dev_classes.setdefault((held[d], d in working), []).append(d)
    slot_classes: dict = {}
    for j, (_, _, rng) in enumerate(slots):
        slot_classes.setdefault(rng, []).append(j)
    flow = _reference_flow(spec, current.num_layers, dev_classes, slot_classes, len(live),
                           len(slots))
    slot_at = {(p, s): j for j, (p, s, _) in enumerate(slots)}
    taken: dict[int, int | None] = {}
    free = {rng: set(members) for rng, members in slot_classes.items()}
    for key, members in dev_classes.items():
        quota = {rng: flow[("d", key)].get(("s", rng), 0) for rng in slot_classes}
        for d in members:
            j = slot_at.get(where[d][:2]) if d in where else None
            if j is not None and quota[slots[j][2]] > 0 and j in free[slots[j][2]]:
                taken[d] = j
                quota[slots[j][2]] -= 1
                free[slots[j][2]].discard(j)
        rest = [d for d in members if d not in taken]
        for rng in slot_classes:
            for _ in range(quota[rng]):
                j = min(free[rng])
                free[rng].discard(j)
                taken[rest.pop(0)] = j
        for d in rest:
            taken[d] = None
    return [taken[d] for d in live]


def _reference_flow(spec, num_layers, dev_classes, slot_classes, n_live, n_slots):
    prefix = _prefix_bytes(spec, num_layers)

    def missing(have, need):
        lo, hi = max(have[0], need[0]), min(have[1], need[1])
        covered = (prefix[hi] - prefix[lo]) if lo < hi else 0.0
        return float(prefix[need[1]] - prefix[need[0]] - covered)

    top = max((missing(k[0], r) for k in dev_classes for r in slot_classes), default=0.0) or 1.0
    graph = nx.DiGraph()
    graph.add_node("src", demand=-n_live)
    graph.add_node("sink", demand=n_live)
    graph.add_edge("spare", "sink", capacity=n_live - n_slots, weight=0)
    for key, members in dev_classes.items():
        graph.add_edge("src", ("d", key), capacity=len(members), weight=0)
        graph.add_edge(("d", key), "spare", weight=1 if key[1] else 0)
        for rng in slot_classes:
            graph.add_edge(("d", key), ("s", rng),
                           weight=round(missing(key[0], rng) / top * 1e12) * (n_live + 1))
    for rng, members in slot_classes.items():
        graph.add_edge(("s", rng), "sink", capacity=len(members), weight=0)
    return nx.min_cost_flow(graph)


def _split(draw, layers: int, stages: int) -> tuple[tuple[int, int], ...]:
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=stages - 1,
                               max_size=stages - 1))) if stages > 1 else []
    return tuple(itertools.pairwise([0, *cuts, layers]))


@st.composite
def placements(draw):
    """A current plan (two splits, some devices dead in it, spares), the live devices (some
    joined) and a slot layout of another shape."""
    layers = draw(st.integers(1, 8))
    sizes = draw(st.lists(st.sampled_from([0.0, 1.0, 2.0, 5.5]), min_size=layers,
                          max_size=layers))
    spec = JobSpec.from_dict({
        "model": {"layers": layers, "forward_s": 1.0, "backward_s": 2.0, "param_bytes": sizes,
                  "optimizer_bytes": 0.0, "activation_bytes": 0.0},
        "cluster": {"devices": 64, "device_memory_bytes": 1e12, "bandwidth_bytes_per_s": 1e9,
                    "restart_s": 1.0, "failure_rate_per_hour": 0.1},
        "training": {"dp": 1, "pp": 1, "global_micro_batches": 1},
    })
    pipelines, first = [], 0
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, min(3, layers)))
        pipelines.append(Pipeline(tuple(range(first, first + n)), _split(draw, layers, n), 1))
        first += n
    spares = tuple(range(first, first + draw(st.integers(0, 2))))
    current = ExecutionPlan("initial", 0, tuple(pipelines), spare_devices=spares).validate()
    devices = list(current.live_devices)
    failed = draw(st.sets(st.sampled_from(devices), max_size=len(devices) - 1))
    live = sorted([d for d in devices if d not in failed] + list(
        range(40, 40 + draw(st.integers(0, 2)))))
    slots = draw(st.integers(1, len(live)))
    numbers = draw(st.permutations(range(slots)))
    layout, k = [], 0
    while k < slots:
        n = draw(st.integers(1, min(layers, slots - k)))
        layout.append(Pipeline(tuple(numbers[k:k + n]), _split(draw, layers, n), 1))
        k += n
    return spec, current, layout, live


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placements())
def test_array_assignment_equals_the_per_device_loop(case):
    spec, current, layout, live = case
    ids = np.asarray(live, dtype=np.int64)
    fast = _assign(spec, _slot_cells(layout, spec.model.layers), _live_cells(current, ids),
                   spec.model.layers)
    assert [None if j < 0 else int(j) for j in fast] == plain_assign(spec, current, layout, live)
    plain = plain_assign(spec, current, layout, live)
    device_of = {j: d for d, j in zip(live, plain) if j is not None}
    placed = place(spec, current, layout, live)
    assert [p.devices for p in placed.pipelines] == [
        tuple(device_of[j] for j in p.devices) for p in layout]
    assert placed.spare_devices == tuple(d for d, j in zip(live, plain) if j is None)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 14), st.floats(0.0, 1.0), st.randoms(use_true_random=False))
def test_dsatur_colours_as_networkx(n, density, rnd):
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    graph.add_edges_from((u, v) for u in range(n) for v in range(u + 1, n)
                         if rnd.random() < density)
    want = nx.greedy_color(graph, strategy="saturation_largest_first")
    assert dsatur([sorted(graph[u]) for u in range(n)]) == tuple(want[u] for u in range(n))


# --------------------------------------------------------------------------- the spec


def test_a_spec_keeps_its_hash_but_not_in_a_pickle():
    spec = JobSpec.preset("llama2-7b-910b")
    first = hash(spec)
    assert hash(spec) == first == hash(replace(spec))
    copy = pickle.loads(pickle.dumps(spec))
    assert "_hash" not in copy.__dict__
    assert copy == spec and hash(copy) == first
    assert hash(JobSpec.preset("llama2-7b-910b")) == first
