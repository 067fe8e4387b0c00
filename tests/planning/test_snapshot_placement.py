"""The planner's side of in-memory snapshots: partners, host memory, the default interval, and
the re-plan that takes lost layers from a snapshot, priced with the steps trained again."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from chameleon_elastic.plan import ExecutionPlan, Pipeline
from chameleon_elastic.planning import decide, estimator, initial_plan, resolve_snapshots, snapshots
from chameleon_elastic.planning.search import PlanningError
from chameleon_elastic.spec import JobSpec, SpecError


def _job(dp: int = 1, pp: int = 4, per_node: int | None = None, every: int | None = 4,
         host: float | None = None) -> JobSpec:
    spec = JobSpec.preset("tiny-cpu")
    spec = replace(spec, training=replace(spec.training, dp=dp, pp=pp, precision="fp32"),
                   cluster=replace(spec.cluster, devices_per_node=per_node,
                                   host_memory_bytes=host))
    return spec.with_snapshot_every(every)


def _layers(plan: ExecutionPlan) -> dict[int, tuple[int, int]]:
    return {d: r for p in plan.pipelines for d, r in zip(p.devices, p.layers)}


def test_partners_on_one_node_form_a_ring_and_on_two_nodes_cross_them():
    plan = initial_plan(_job())
    assert snapshots.partners(plan, None) == {0: 1, 1: 2, 2: 3, 3: 0}
    # two nodes of two: devices walked 0, 2, 1, 3; each copy on the other node
    assert snapshots.partners(plan, 2) == {0: 2, 2: 1, 1: 3, 3: 0}


def test_no_partner_holds_a_layer_it_keeps_and_other_nodes_come_first():
    for dp, pp, per_node in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4)):
        if dp * pp > 4 or 4 % per_node:
            continue
        plan = initial_plan(_job(dp, pp, per_node))
        ranges = _layers(plan)
        pairs = snapshots.partners(plan, per_node)
        for d, p in pairs.items():
            a, b = ranges[d], ranges[p]
            assert p != d and (b[1] <= a[0] or a[1] <= b[0]), (dp, pp, per_node, d, p)
            elsewhere = [c for c, r in ranges.items() if c // per_node != d // per_node
                         and (r[1] <= a[0] or a[1] <= r[0])]
            assert not elsewhere or p // per_node != d // per_node, (dp, pp, per_node, d, p)
        if pp == 1:   # pure data parallelism: a replica of every layer is everywhere
            assert pairs == {}
        elif dp == 1:   # no shared layers: each device keeps exactly one copy
            assert sorted(pairs.values()) == sorted(pairs)


def test_host_memory_counts_own_and_kept_copies_two_deep_per_node():
    spec = _job(per_node=2, host=1e8)
    plan = initial_plan(spec)
    # each device: 2 layers of (1 MB + 2 MB), its own and its partner's, two snapshots
    assert snapshots.host_bytes(spec, plan) == {0: 2 * 2 * 12e6, 1: 2 * 2 * 12e6}
    assert snapshots.host_memory_problem(spec, plan) is None
    tight = _job(per_node=2, host=4e7)
    assert snapshots.host_memory_problem(tight, plan) == (
        "node 0 would keep 0.05 GB of snapshots in host memory but cluster.host_memory_bytes "
        "is 0.04 GB")
    with pytest.raises(PlanningError, match="in-memory snapshots do not fit: node 0 would keep"):
        initial_plan(tight)
    assert snapshots.host_bytes(_job(every=0), plan) == {}


def test_the_default_interval_keeps_snapshots_within_two_percent_of_the_step():
    spec = _job(every=None)
    plan = initial_plan(spec)
    # 6 MB per device: 3 ms into host memory at 2 GB/s, 6 ms to the partner at 1 GB/s
    assert snapshots.snapshot_s(spec, plan) == pytest.approx(0.009)
    k = snapshots.default_every(spec, plan)
    step = plan.estimate.step_time_s
    assert k == math.ceil(0.009 / (0.02 * step))
    assert 0.009 / k <= 0.02 * step < 0.009 / (k - 1)
    assert resolve_snapshots(spec).recovery.snapshot_every == k
    assert resolve_snapshots(spec.with_snapshot_every(7)).recovery.snapshot_every == 7
    relaunch = spec.with_recovery("relaunch")
    assert resolve_snapshots(relaunch).recovery.snapshot_every == 0
    assert snapshots.every(relaunch.with_snapshot_every(3)) == 0   # a relaunch keeps none


def test_a_replan_takes_lost_layers_from_a_live_partners_snapshot_and_prices_the_redo():
    spec = _job(per_node=2)
    plan = initial_plan(spec)
    d = decide(spec, plan, [2, 3])   # node 1: stages 2-3, layers 4-7
    chosen = d.chosen
    assert chosen.checkpoint_layers == () and chosen.snapshot_layers == (4, 5, 6, 7)
    # 2's copy is on 1, 3's on 0
    assert {x: t.src for t in chosen.transfers if t.snapshot for x in t.layers} == {
        4: 1, 5: 1, 6: 0, 7: 0}

    est = chosen.estimate
    plain = estimator.transfer_time(spec, chosen.transfers) + spec.cluster.switch_s
    assert est.transition_time_s == pytest.approx(plain + 4 / 2 * est.step_time_s)
    # without snapshots the same loss loads those layers from the checkpoint
    off = decide(spec.with_snapshot_every(0), plan, [2, 3]).chosen
    assert off.checkpoint_layers == (4, 5, 6, 7) and off.snapshot_layers == ()


def test_a_partner_lost_with_its_device_leaves_the_checkpoint():
    spec = _job()   # one node: 0->1, 1->2, 2->3, 3->0
    chosen = decide(spec, initial_plan(spec), [2, 3]).chosen
    assert chosen.checkpoint_layers == (4, 5)      # 2's copy was on 3
    assert chosen.snapshot_layers == (6, 7)        # 3's copy is on 0


def test_snapshot_transfers_survive_the_json_round_trip():
    spec = _job(per_node=2)
    chosen = decide(spec, initial_plan(spec), [2, 3]).chosen
    again = ExecutionPlan.from_json(chosen.to_json())
    assert again.transfers == chosen.transfers and again.snapshot_layers == (4, 5, 6, 7)
    assert "snapshot" not in initial_plan(spec).to_json()
    hand = ExecutionPlan("replan", 1, (Pipeline((0,), ((0, 8),), 8),))
    assert hand.snapshot_layers == ()


def test_the_recovery_table_and_node_keys_are_checked_in_one_sentence():
    text = (JobSpec.preset("tiny-cpu").to_dict())
    bad = {**text, "recovery": {"snapshot_every": -1}}
    with pytest.raises(SpecError, match=r"^recovery.snapshot_every = -1 is invalid; expected "
                                        r"an integer >= 0.$"):
        JobSpec.from_dict(bad)
    with pytest.raises(SpecError, match=r"unknown key recovery.every; the keys of \[recovery\]"):
        JobSpec.from_dict({**text, "recovery": {"every": 3}})
    with pytest.raises(SpecError, match="cluster.devices_per_node = 3 does not divide"):
        JobSpec.from_dict({**text, "cluster": {**text["cluster"], "devices_per_node": 3}})
    with pytest.raises(SpecError, match="cluster.host_memory_bytes = 0 is invalid"):
        JobSpec.from_dict({**text, "cluster": {**text["cluster"], "host_memory_bytes": 0}})
    with pytest.raises(SpecError, match="recovery.snapshot_every = -2 is invalid"):
        JobSpec.preset("tiny-cpu").with_snapshot_every(-2)
    spec = JobSpec.from_dict({**text, "recovery": {"snapshot_every": 5},
                              "cluster": {**text["cluster"], "devices_per_node": 2,
                                          "host_memory_bytes": 8e9}})
    assert spec.recovery.snapshot_every == 5 and spec.cluster.node_of(3) == 1
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert JobSpec.preset("tiny-cpu").to_dict()["recovery"] == {}   # the default stays absent
