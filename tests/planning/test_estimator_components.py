"""The estimator's fast rerouted pricing (coupled components, no ``Op`` objects) against the
straightforward full simulation it replaced, on random rerouted plans the planner emits and on
hand-built reroutes (peer subsets in any order, repeated peers, zero shares)."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.planning import PlanningError, initial_plan
from chameleon_elastic.planning import estimator as est
from chameleon_elastic.planning import memory as mem
from chameleon_elastic.planning.schedule import (
    Op,
    device_orders,
    in_flight_peak,
    orders_of_devices,
    simulate,
)
from chameleon_elastic.planning.search import reroute_plan
from chameleon_elastic.spec import JobSpec

# --------------------------------------------------------------------------- the reference


def reference_compute_time(spec: JobSpec, plan: ExecutionPlan) -> float:
    """Rerouted compute time as first written: every coupled pipeline simulated together from
    its device orders, the others priced alone (``simulate_reroute=True`` semantics)."""
    if not plan.reroute:
        return max(est.pipeline_time(spec, p.layers, p.micro_batches) for p in plan.pipelines)
    owner = {d: p for p, pipe in enumerate(plan.pipelines) for d in pipe.devices}
    coupled = {r.pipeline for r in plan.reroute}
    coupled.update(owner[share.device] for r in plan.reroute for share in r.peers)
    rest = [est.pipeline_time(spec, pipe.layers, pipe.micro_batches)
            for p, pipe in enumerate(plan.pipelines) if p not in coupled]
    orders = device_orders(plan, pipelines=sorted(coupled))

    def duration(op: Op) -> float:
        a, b = plan.pipelines[op.pipeline].layers[op.stage]
        return est.stage_times(spec, a, b)[0 if op.kind == "F" else 1]

    return max([simulate(orders, duration).makespan, *rest])


def reference_peak_memory(spec: JobSpec, plan: ExecutionPlan) -> dict[int, float]:
    """Peak memory as first written: each peer's merged order built and counted."""
    dead = set(plan.failed_devices)
    peers = {share.device for r in plan.reroute for share in r.peers}
    where = {d: (p, s) for p, pipe in enumerate(plan.pipelines)
             for s, d in enumerate(pipe.devices) if d in peers}
    orders = orders_of_devices(plan, where)
    out: dict[int, float] = {}
    for pipe in plan.pipelines:
        for s, d in enumerate(pipe.devices):
            if d in dead:
                continue
            if d in orders:
                in_flight = int(in_flight_peak(orders[d]))
            else:
                in_flight = min(pipe.num_stages - s, pipe.micro_batches)
            out[d] = mem.stage_memory(spec, *pipe.layers[s], in_flight)
    return dict(sorted(out.items()))


def assert_same_as_reference(spec: JobSpec, plan: ExecutionPlan) -> None:
    reference = reference_compute_time(spec, plan)
    assert est.compute_time(spec, plan, simulate_reroute=True) == reference
    closed = est.reroute_closed_form(spec, plan) if plan.reroute else None
    assert est.compute_time(spec, plan) == (reference if closed is None else closed)
    assert mem.peak_memory(spec, plan) == reference_peak_memory(spec, plan)


# --------------------------------------------------------------------------- random plans


def make_spec(forward: list[float], micro_batches: int, devices: int) -> JobSpec:
    return JobSpec.from_dict({
        "model": {"layers": len(forward), "forward_s": forward,
                  "backward_s": [2.0 * f for f in forward], "param_bytes": 1e6,
                  "optimizer_bytes": 2e6, "activation_bytes": 1e6},
        "cluster": {"devices": devices, "device_memory_bytes": 1e12,
                    "bandwidth_bytes_per_s": 1e9, "restart_s": 2.0,
                    "failure_rate_per_hour": 0.1},
        "training": {"dp": 1, "pp": 1, "global_micro_batches": micro_batches},
    })


@st.composite
def splits(draw: st.DrawFn, layers: int) -> tuple[tuple[int, int], ...]:
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), max_size=3)))
    bounds = [0, *cuts, layers]
    return tuple(itertools.pairwise(bounds))


@st.composite
def asymmetric_layouts(draw: st.DrawFn) -> tuple[JobSpec, ExecutionPlan]:
    """A few layer splits shared by several pipelines (so stages have peers), own quotas,
    shuffled device ids, uniform or uneven layer times."""
    layers = 8
    uniform = draw(st.booleans())
    forward = [1.0] * layers if uniform else draw(
        st.lists(st.sampled_from([0.5, 1.0, 1.5, 3.0]), min_size=layers, max_size=layers))
    shapes = draw(st.lists(splits(layers), min_size=1, max_size=3))
    count = draw(st.integers(2, 8))
    chosen = [draw(st.sampled_from(shapes)) for _ in range(count)]
    quotas = draw(st.lists(st.integers(0, 6), min_size=count, max_size=count))
    assume(sum(quotas) > 0)
    total = sum(len(c) for c in chosen)
    ids = draw(st.permutations(range(total)))
    pipes, k = [], 0
    for split, quota in zip(chosen, quotas):
        pipes.append(Pipeline(tuple(ids[k:k + len(split)]), split, quota))
        k += len(split)
    spec = make_spec(forward, sum(quotas), total + 2)
    plan = ExecutionPlan("replan", 1, tuple(pipes), spare_devices=(total, total + 1)).validate()
    return spec, plan


def _reroute_or_skip(spec: JobSpec, plan: ExecutionPlan, failed: list[int]) -> ExecutionPlan:
    try:
        return reroute_plan(spec, plan, failed)
    except PlanningError:  # a stage lost every replica: the planner re-plans, nothing to price
        assume(False)
        raise


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(asymmetric_layouts(), st.data())
def test_planner_reroutes_of_asymmetric_layouts_price_as_the_full_simulation(
        layout: tuple[JobSpec, ExecutionPlan], data: st.DataObject) -> None:
    spec, plan = layout
    working = sorted(plan.working_devices)
    first = data.draw(st.lists(st.sampled_from(working), min_size=1, max_size=4, unique=True))
    rerouted = _reroute_or_skip(spec, plan, first)
    assert_same_as_reference(spec, rerouted)
    # Failures accumulate on top of a rerouted plan, as in a long trace.
    more = data.draw(st.lists(st.sampled_from(sorted(rerouted.working_devices)), max_size=3,
                              unique=True))
    if more:
        assert_same_as_reference(spec, _reroute_or_skip(spec, rerouted, more))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 6), st.sampled_from([1, 2, 4]), st.integers(1, 5), st.booleans(),
       st.data())
def test_planner_reroutes_of_initial_plans_price_as_the_full_simulation(
        dp: int, pp: int, per_pipeline: int, uniform: bool, data: st.DataObject) -> None:
    forward = [1.0] * 8 if uniform else [1.0, 2.0, 1.0, 1.0, 3.0, 1.0, 1.0, 0.5]
    spec = JobSpec.from_dict({
        **make_spec(forward, dp * per_pipeline, dp * pp + 1).to_dict(),
        "training": {"dp": dp, "pp": pp, "global_micro_batches": dp * per_pipeline},
    })
    plan = initial_plan(spec)
    failed = data.draw(st.lists(st.sampled_from(plan.working_devices), min_size=1,
                                max_size=dp * pp - 1, unique=True))
    assert_same_as_reference(spec, _reroute_or_skip(spec, plan, failed))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(asymmetric_layouts(), st.data())
def test_hand_built_reroutes_price_as_the_full_simulation(
        layout: tuple[JobSpec, ExecutionPlan], data: st.DataObject) -> None:
    """Any peers of the right layers in any order, repeats and zero shares included."""
    spec, plan = layout
    dead = data.draw(st.sets(st.sampled_from(plan.working_devices), min_size=1, max_size=4))
    reroutes = []
    for d in sorted(dead):
        p, s = plan.locate(d)
        held = plan.pipelines[p].layers[s]
        live = [x for q, pipe in enumerate(plan.pipelines) if q != p
                for x, rng in zip(pipe.devices, pipe.layers) if rng == held and x not in dead]
        assume(live)
        peers = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=5))
        quota, n = plan.pipelines[p].micro_batches, len(peers)
        reroutes.append(Reroute(d, p, s, tuple(
            PeerShare(x, (quota - j + n - 1) // n) for j, x in enumerate(peers))))
    rerouted = ExecutionPlan("reroute", 2, plan.pipelines, failed_devices=tuple(sorted(dead)),
                             reroute=tuple(reroutes)).validate()
    assert_same_as_reference(spec, rerouted)


def test_equal_components_anywhere_price_alike() -> None:
    """Two copies of one coupled pair at different places and device ids: one component
    shape, priced once, equal to the full simulation."""
    spec = make_spec([1.0, 2.0, 1.0, 1.0], 12, 16)
    split = ((0, 1), (1, 4))
    pipes = (Pipeline((0, 1), split, 3), Pipeline((2, 3), split, 3),
             Pipeline((9, 8), split, 3), Pipeline((7, 6), split, 3))
    plan = ExecutionPlan("reroute", 1, pipes, failed_devices=(1, 8), reroute=(
        Reroute(1, 0, 1, (PeerShare(3, 3),)), Reroute(8, 2, 1, (PeerShare(6, 3),)))).validate()
    assert [sorted(c) for c in est._coupled_components(plan)] == [[0, 1], [2, 3]]
    lanes = [est._lanes(spec, plan, c, {}) for c in est._coupled_components(plan)]
    assert lanes[0] == lanes[1]
    assert_same_as_reference(spec, plan)
