"""The 1F1B order: known small cases, and invariants over generated symmetric, asymmetric and
rerouted plans (every operation exactly once on its server, no deadlock, bounded in-flight)."""

from __future__ import annotations

import itertools
import random

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.planning.schedule import (
    Op,
    ScheduleError,
    coupled_makespan,
    dependency,
    device_order,
    device_orders,
    fifo_violations,
    in_flight_peak,
    link_messages,
    one_f_one_b,
    pipeline_schedule,
    simulate,
    streams_in_flight_peak,
)

# --------------------------------------------------------------------------- plan builders


def symmetric(dp: int, pp: int, quota: int, layers: int | None = None,
              failed: tuple[int, ...] = ()) -> ExecutionPlan:
    """dp x pp, device = p * pp + s, failed devices rerouted round-robin to their live peers."""
    layers = layers or pp
    cuts = [round(s * layers / pp) for s in range(pp + 1)]
    ranges = tuple((cuts[s], cuts[s + 1]) for s in range(pp))
    pipes = tuple(Pipeline(tuple(p * pp + s for s in range(pp)), ranges, quota)
                  for p in range(dp))
    return _with_reroute(pipes, failed)


def _with_reroute(pipes: tuple[Pipeline, ...], failed: tuple[int, ...],
                  rng: random.Random | None = None) -> ExecutionPlan:
    holders: dict[tuple[int, int], list[int]] = {}
    where: dict[int, tuple[int, int]] = {}
    for p, pipe in enumerate(pipes):
        for s, d in enumerate(pipe.devices):
            holders.setdefault(pipe.layers[s], []).append(d)
            where[d] = (p, s)
    reroutes = []
    for d in failed:
        p, s = where[d]
        peers = [x for x in holders[pipes[p].layers[s]] if x not in failed]
        if rng is not None:
            rng.shuffle(peers)
            peers = peers[: rng.randint(1, len(peers))]
        quota, n = pipes[p].micro_batches, len(peers)
        shares = tuple(PeerShare(x, (quota - j + n - 1) // n) for j, x in enumerate(peers))
        reroutes.append(Reroute(d, p, s, shares))
    policy = "reroute" if failed else "initial"
    return ExecutionPlan(policy, 0, pipes, failed_devices=failed,
                         reroute=tuple(reroutes)).validate()


@st.composite
def plans(draw: st.DrawFn) -> ExecutionPlan:
    """Symmetric, asymmetric (own length and quota per pipeline) and rerouted layouts.

    Pipelines draw their layer split from a few templates so that layer ranges repeat across
    pipelines of different lengths: that is what gives rerouting peers in asymmetric layouts.
    """
    layers = draw(st.integers(2, 9))
    templates = []
    for _ in range(draw(st.integers(1, 2))):
        n = draw(st.integers(1, min(layers, 5)))
        cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=n - 1, max_size=n - 1)))
        bounds = [0, *cuts, layers]
        templates.append(tuple(itertools.pairwise(bounds)))
    same_quota = draw(st.booleans())
    quota0 = draw(st.integers(1, 7))
    pipes = []
    device_ids = draw(st.permutations(range(40)))
    next_id = 0
    for _ in range(draw(st.integers(2, 5))):
        ranges = draw(st.sampled_from(templates))
        quota = quota0 if same_quota else draw(st.integers(0, 7))
        devices = tuple(device_ids[next_id: next_id + len(ranges)])
        next_id += len(ranges)
        pipes.append(Pipeline(devices, ranges, quota))
    holders: dict[tuple[int, int], list[int]] = {}
    for pipe in pipes:
        for s, d in enumerate(pipe.devices):
            holders.setdefault(pipe.layers[s], []).append(d)
    failed: list[int] = []
    if draw(st.integers(0, 3)) > 0:  # mostly rerouted: that is where merging can go wrong
        for group in holders.values():
            if len(group) > 1:
                k = draw(st.integers(0, len(group) - 1))
                failed.extend(draw(st.permutations(group))[:k])
    rng = random.Random(draw(st.integers(0, 2**16)))
    return _with_reroute(tuple(pipes), tuple(failed), rng)


def union_graph(orders: dict[int, tuple[Op, ...]]) -> nx.DiGraph:
    graph = nx.DiGraph()
    for order in orders.values():
        for a, b in itertools.pairwise(order):
            graph.add_edge(a.key, b.key)
        for op in order:
            graph.add_node(op.key)
            dep = dependency(op)
            if dep is not None:
                graph.add_edge(dep, op.key)
    return graph


def unit(op: Op) -> float:
    return 1.0 if op.kind == "F" else 2.0


# --------------------------------------------------------------------------- known answers


def test_one_f_one_b_three_stages_four_micro_batches() -> None:
    # Written from the definition: stage i does min(2 - i, 4) warm-up forwards, then
    # alternates F/B, then drains the backwards.
    assert one_f_one_b(3, 0, 4) == (("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                    ("B", 2), ("B", 3))
    assert one_f_one_b(3, 1, 4) == (("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3),
                                    ("B", 2), ("B", 3))
    assert one_f_one_b(3, 2, 4) == (("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2),
                                    ("F", 3), ("B", 3))


def test_one_f_one_b_fewer_micro_batches_than_stages() -> None:
    assert one_f_one_b(4, 0, 2) == (("F", 0), ("F", 1), ("B", 0), ("B", 1))
    assert one_f_one_b(4, 3, 2) == (("F", 0), ("B", 0), ("F", 1), ("B", 1))
    assert one_f_one_b(2, 0, 0) == ()


def test_one_f_one_b_rejects_a_missing_stage() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        one_f_one_b(3, 3, 4)


def test_device_orders_plain_plan_sources_and_dests() -> None:
    plan = symmetric(dp=2, pp=3, quota=4)
    orders = device_orders(plan)
    assert sorted(orders) == [0, 1, 2, 3, 4, 5]
    mid = orders[4]  # pipeline 1, stage 1
    assert [(op.kind, op.micro_batch) for op in mid] == list(one_f_one_b(3, 1, 4))
    assert all(op.pipeline == 1 and op.stage == 1 and op.device == 4 for op in mid)
    assert {(op.source, op.dest) for op in mid if op.kind == "F"} == {(3, 5)}
    assert {(op.source, op.dest) for op in mid if op.kind == "B"} == {(5, 3)}
    first, last = orders[3], orders[5]
    assert {(op.kind, op.source, op.dest) for op in first} == {("F", None, 4), ("B", 4, None)}
    assert {(op.kind, op.source, op.dest) for op in last} == {("F", 4, None), ("B", None, 4)}


def test_rerouted_peer_merges_the_dead_stage_by_nominal_time() -> None:
    # 2 x 2, device 1 (pipeline 0, stage 1) dead: device 3 serves both last stages.
    plan = symmetric(dp=2, pp=2, quota=2, failed=(1,))
    orders = device_orders(plan)
    assert 1 not in orders
    got = [(op.kind, op.pipeline, op.micro_batch) for op in orders[3]]
    # Nominal starts (F = 1, B = 2) of the last stage: F0 at 1, B0 at 2, F1 at 4, B1 at 5, the
    # same in both pipelines; ties go to the lower pipeline index.
    assert got == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0),
                   ("F", 0, 1), ("F", 1, 1), ("B", 0, 1), ("B", 1, 1)]
    assert all(op.source is None and op.dest == 0 for op in orders[3]
               if op.kind == "B" and op.pipeline == 0)
    assert [op.dest for op in orders[0] if op.kind == "F"] == [3, 3]
    assert in_flight_peak(orders[3]) == 2


def test_pipeline_schedule_matches_the_closed_form_exactly() -> None:
    for stages in range(1, 7):
        for quota in range(1, 10):
            for tf, tb in ((1.0, 2.0), (0.5, 1.25), (3.0, 1.0)):
                ends = pipeline_schedule(((tf, tb),) * stages, quota)
                assert max(ends[0][1]) == (stages + quota - 1) * (tf + tb)


def test_simulate_matches_pipeline_schedule_on_non_uniform_stages() -> None:
    times = ((1.0, 2.5), (0.25, 0.5), (2.0, 3.0))
    pipe = Pipeline((7, 8, 9), ((0, 1), (1, 3), (3, 4)), 5)
    plan = ExecutionPlan("initial", 0, (pipe,)).validate()
    timeline = simulate(device_orders(plan), lambda op: times[op.stage][0 if op.kind == "F" else 1])
    ends = pipeline_schedule(times, 5)
    assert timeline.makespan == max(ends[0][1])
    for s in range(3):
        for m in range(5):
            assert timeline.end[("F", 0, m, s)] == ends[s][0][m]
            assert timeline.end[("B", 0, m, s)] == ends[s][1][m]


def test_simulate_detects_a_deadlock() -> None:
    plan = symmetric(dp=1, pp=2, quota=2)
    orders = device_orders(plan)
    # Stage 0 insists on the backward of micro-batch 1 before the forward that feeds it.
    bad = dict(orders)
    bad[0] = tuple(sorted(orders[0], key=lambda op: (op.kind != "B", -op.micro_batch)))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(bad, unit)
    missing = {1: orders[1]}  # nobody runs stage 0
    with pytest.raises(ScheduleError, match="stuck"):
        simulate(missing, unit)


def test_simulate_rejects_an_operation_scheduled_twice() -> None:
    orders = device_orders(symmetric(dp=1, pp=1, quota=1))
    with pytest.raises(ScheduleError, match="twice"):
        simulate({0: orders[0], 1: orders[0]}, unit)


# --------------------------------------------------------------------------- invariants


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans(), st.randoms(use_true_random=False))
def test_orders_are_complete_deadlock_free_and_bounded(plan: ExecutionPlan,
                                                       rnd: random.Random) -> None:
    orders = device_orders(plan)
    assert sorted(orders) == list(plan.working_devices)
    for device in list(orders)[:3]:
        assert device_order(plan, device) == orders[device]

    seen: dict[tuple, Op] = {}
    for device, order in orders.items():
        for op in order:
            assert op.device == device
            assert op.key not in seen, f"{op.key} appears twice"
            seen[op.key] = op
    expected = {(kind, p, m, s) for p, pipe in enumerate(plan.pipelines)
                for s in range(pipe.num_stages) for m in range(pipe.micro_batches)
                for kind in "FB"}
    assert set(seen) == expected
    for (kind, p, m, s), op in seen.items():
        last = plan.pipelines[p].num_stages - 1
        assert op.device == plan.server(p, s, m)
        before = plan.server(p, s - 1, m) if s > 0 else None
        after = plan.server(p, s + 1, m) if s < last else None
        assert (op.source, op.dest) == ((before, after) if kind == "F" else (after, before))

    assert nx.is_directed_acyclic_graph(union_graph(orders))
    durations = {key: rnd.uniform(0.1, 3.0) for key in seen}
    timeline = simulate(orders, lambda op: durations[op.key])
    for key, op in seen.items():
        dep = dependency(op)
        if dep is not None:
            assert timeline.start[key] >= timeline.end[dep]

    # In flight: own 1F1B bound plus the 1F1B bound of every dead stage the device serves.
    bound = {d: 0 for d in orders}
    for p, pipe in enumerate(plan.pipelines):
        for s, d in enumerate(pipe.devices):
            limit = min(pipe.num_stages - s, pipe.micro_batches)
            if d in plan.failed_devices:
                served = {plan.server(p, s, m) for m in range(pipe.micro_batches)}
                for x in served:
                    bound[x] += limit
            else:
                bound[d] += limit
    for d, order in orders.items():
        assert in_flight_peak(order) <= bound[d]

    if not plan.reroute:
        for d, order in orders.items():
            p, s = plan.locate(d)
            pipe = plan.pipelines[p]
            assert [(op.kind, op.micro_batch) for op in order] == list(
                one_f_one_b(pipe.num_stages, s, pipe.micro_batches))


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 5), st.integers(1, 5), st.integers(1, 9), st.data())
def test_symmetric_layouts_keep_fifo_order_on_every_link(dp: int, pp: int, quota: int,
                                                         data: st.DataObject) -> None:
    devices = list(range(dp * pp))
    failed = []
    for s in range(pp):
        column = [p * pp + s for p in range(dp)]
        failed.extend(data.draw(st.permutations(column))[: data.draw(st.integers(0, dp - 1))])
    plan = symmetric(dp, pp, quota, failed=tuple(sorted(failed)))
    orders = device_orders(plan)
    assert fifo_violations(orders) == []
    sent = sum(len(v) for v in link_messages(orders).values())
    assert sent == 2 * dp * quota * (pp - 1)
    assert set(orders) == set(devices) - set(failed)


def test_device_order_of_one_device() -> None:
    plan = symmetric(dp=3, pp=2, quota=5, failed=(1, 4))
    orders = device_orders(plan)
    for device in plan.working_devices:
        assert device_order(plan, device) == orders[device]
    with pytest.raises(ValueError, match="does not work"):
        device_order(plan, 1)


def test_device_orders_restricted_to_some_pipelines() -> None:
    plan = symmetric(dp=3, pp=2, quota=3, failed=(1,))
    part = device_orders(plan, pipelines=[0, 1])
    assert set(part) == {0, 2, 3, 5}  # device 5 (pipeline 2) serves some of dead device 1's work
    assert {op.pipeline for order in part.values() for op in order} == {0, 1}
    assert all(op.pipeline == 0 for op in part[5])


# --------------------------------------------------------------------------- fast paths


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans(), st.randoms(use_true_random=False))
def test_coupled_makespan_and_streams_match_the_built_orders(plan: ExecutionPlan,
                                                             rnd: random.Random) -> None:
    """The one-pass timing and the Op-free in-flight count against ``simulate`` and
    ``in_flight_peak`` of ``device_orders``, with arbitrary per-stage durations."""
    times = [tuple((rnd.choice([0.25, 0.5, 1.0, 3.0]), rnd.choice([0.5, 1.0, 2.0]))
                   for _ in pipe.devices) for pipe in plan.pipelines]
    reroutes = {r.device: r for r in plan.reroute}
    lanes = [(times[p], pipe.micro_batches,
              tuple(tuple(sh.device for sh in reroutes[d].peers) if d in reroutes else (d,)
                    for d in pipe.devices))
             for p, pipe in enumerate(plan.pipelines)]
    orders = device_orders(plan)
    expected = simulate(orders, lambda op: times[op.pipeline][op.stage][op.kind == "B"])
    assert coupled_makespan(lanes) == expected.makespan

    for d, order in orders.items():
        p, s = plan.locate(d)
        found = [(p, s, 1, (0,))]
        for r in plan.reroute:
            positions = tuple(j for j, sh in enumerate(r.peers) if sh.device == d)
            if positions:
                found.append((r.pipeline, r.stage, len(r.peers), positions))
        pipes = plan.pipelines
        streams = tuple((q, pipes[q].num_stages, st_, pipes[q].micro_batches, period, res)
                        for q, st_, period, res in found)
        assert streams_in_flight_peak(streams) == in_flight_peak(order)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans(), st.randoms(use_true_random=False))
def test_coupled_makespan_with_recomputing_devices_matches_the_built_orders(
        plan: ExecutionPlan, rnd: random.Random) -> None:
    """A recomputing device runs every backward it serves (its own stage's or a dead peer's)
    in ``T_b + T_f``: the one-pass timing against ``simulate`` with those durations."""
    times = [tuple((rnd.choice([0.25, 0.5, 1.0]), rnd.choice([0.5, 1.0, 2.0]))
                   for _ in pipe.devices) for pipe in plan.pipelines]
    recompute = frozenset(d for d in plan.working_devices if rnd.random() < 0.4)
    reroutes = {r.device: r for r in plan.reroute}
    lanes = [(times[p], pipe.micro_batches,
              tuple(tuple(sh.device for sh in reroutes[d].peers) if d in reroutes else (d,)
                    for d in pipe.devices))
             for p, pipe in enumerate(plan.pipelines)]

    def duration(op) -> float:
        tf, tb = times[op.pipeline][op.stage]
        return tf if op.kind == "F" else tb + (tf if op.device in recompute else 0.0)

    expected = simulate(device_orders(plan), duration)
    assert coupled_makespan(lanes, recompute) == expected.makespan
    assert coupled_makespan(lanes, ()) == coupled_makespan(lanes)


def test_a_repeated_peer_runs_each_operation_once() -> None:
    pipes = (Pipeline((0, 1), ((0, 1), (1, 2)), 3), Pipeline((2, 3), ((0, 1), (1, 2)), 3))
    plan = ExecutionPlan("reroute", 1, pipes, failed_devices=(1,), reroute=(
        Reroute(1, 0, 1, (PeerShare(3, 2), PeerShare(3, 1))),)).validate()
    order = device_order(plan, 3)
    assert order == device_orders(plan)[3]
    assert len(order) == len({op.key for op in order}) == 12
