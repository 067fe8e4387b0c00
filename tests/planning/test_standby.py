"""Standby devices: the cluster's devices beyond the job's size (training.dp x training.pp) stay
spare, and a lost device of the layout can be replaced by one (``swap``), priced next to
rerouting and re-planning by the same score."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chameleon_elastic.plan import CHECKPOINT
from chameleon_elastic.planning import PlanningError, decide, initial_plan
from chameleon_elastic.planning.estimator import transfer_time
from chameleon_elastic.planning.search import reroute_plan, swap_plan
from chameleon_elastic.spec import JobSpec


def standby_job(*, devices: int = 6, memory: float = 2.5e7, snapshot_every: int = 0,
                rate: float = 0.1) -> JobSpec:
    """tiny-cpu's model on 2 nodes x 2 devices as (PP, DP) = (2, 2), plus ``devices - 4``
    standby devices. 2.5e7 bytes of device memory hold at most half the model per device, so
    the (2, 2) layout is the best on four devices and nothing else competes with a swap on
    step time."""
    return JobSpec.from_dict({
        "model": {"layers": 8, "forward_s": 0.002, "backward_s": 0.004, "param_bytes": 1e6,
                  "optimizer_bytes": 2e6, "activation_bytes": 2e5},
        "cluster": {"devices": devices, "device_memory_bytes": memory,
                    "bandwidth_bytes_per_s": 1e9, "restart_s": 2.0,
                    "failure_rate_per_hour": rate, "regroup_s": 0.3,
                    "devices_per_node": 2 if devices % 2 == 0 else 1},
        "training": {"dp": 2, "pp": 2, "global_micro_batches": 8},
        "recovery": {"snapshot_every": snapshot_every},
    })


def test_devices_beyond_the_job_size_start_spare():
    spec = standby_job()
    plan = initial_plan(spec)
    assert spec.training.size == 4
    assert [p.devices for p in plan.pipelines] == [(0, 1), (2, 3)]
    assert plan.spare_devices == (4, 5)


def test_a_lost_device_is_swapped_for_a_standby_that_keeps_the_throughput():
    spec = standby_job()
    plan = initial_plan(spec)
    decision = decide(spec, plan, [3])
    swap = decision.candidates["swap"]
    assert decision.chosen is swap and swap.policy == "swap"
    assert [p.devices for p in swap.pipelines] == [(0, 1), (2, 4)]
    assert [p.layers for p in swap.pipelines] == [p.layers for p in plan.pipelines]
    assert swap.spare_devices == (5,) and swap.failed_devices == ()
    # one stage moves: layers 4-7 (weights + Adam state) from its live replica, device 1
    assert [(t.src, t.dst, t.layers) for t in swap.transfers] == [(1, 4, (4, 5, 6, 7))]
    assert swap.transfers[0].bytes == pytest.approx(4 * 3e6)
    assert swap.estimate.step_time_s == pytest.approx(plan.estimate.step_time_s)
    assert swap.estimate.transition_time_s == pytest.approx(
        transfer_time(spec, swap.transfers) + spec.cluster.switch_s)
    # rerouting slows every step; the best re-plan is this very layout (a re-plan may use
    # the standbys too, up to the job's size), placed the same way, and a tie goes to the swap
    reroute, replanned = decision.candidates["reroute"], decision.candidates["replan"]
    assert reroute.estimate.step_time_s > swap.estimate.step_time_s
    assert swap.estimate.score > reroute.estimate.score
    assert replanned.pipelines == swap.pipelines
    assert replanned.estimate.score == pytest.approx(swap.estimate.score)


def test_without_standbys_the_survivors_re_plan_onto_fewer_devices():
    spec = standby_job(devices=4)
    decision = decide(spec, initial_plan(spec), [3])
    with_standby = decide(standby_job(), initial_plan(standby_job()), [3]).chosen
    assert decision.chosen.policy in ("reroute", "replan")
    assert decision.chosen.estimate.step_time_s > 1.3 * with_standby.estimate.step_time_s


def test_a_lost_node_is_swapped_for_a_standby_node():
    spec = standby_job()
    decision = decide(spec, initial_plan(spec), [2, 3])
    assert decision.chosen.policy == "swap"
    assert [p.devices for p in decision.chosen.pipelines] == [(0, 1), (4, 5)]
    assert sorted((t.src, t.dst) for t in decision.chosen.transfers) == [(0, 4), (1, 5)]


def test_without_a_standby_no_swap_is_priced_or_mentioned():
    spec = standby_job(devices=4)
    decision = decide(spec, initial_plan(spec), [3])
    assert "swap" not in decision.candidates and "swap" not in decision.rejected
    # a standby's own loss leaves the layout whole: nothing to swap, rerouting costs nothing
    spec = standby_job()
    decision = decide(spec, initial_plan(spec), [5])
    assert "swap" not in decision.candidates and decision.chosen.policy == "reroute"
    assert decision.chosen.spare_devices == (4,)


def test_too_few_standbys_is_a_rejected_swap_with_a_reason():
    spec = standby_job(devices=5)
    decision = decide(spec, initial_plan(spec), [2, 3])
    assert "swap" not in decision.candidates
    assert "2 device(s) of the layout are lost but only 1 standby" in decision.rejected["swap"]


def test_a_standby_that_joins_later_replaces_a_device_left_dead_by_a_reroute():
    spec = standby_job(devices=6)
    plan = initial_plan(spec)
    rerouted = reroute_plan(spec, plan, [3, 4, 5])   # the standbys were not there yet
    assert rerouted.failed_devices == (3,) and rerouted.spare_devices == ()
    decision = decide(spec, rerouted, joined=[4, 5])
    assert decision.chosen.policy == "swap"
    assert [p.devices for p in decision.chosen.pipelines] == [(0, 1), (2, 4)]
    assert decision.chosen.spare_devices == (5,)


def test_layers_without_a_live_replica_come_to_the_standby_from_a_snapshot():
    spec = standby_job(snapshot_every=4)
    plan = initial_plan(spec)
    swap = swap_plan(spec, plan, [1, 3])   # both holders of layers 4-7
    assert {t.src for t in swap.transfers} == {CHECKPOINT}
    decision = decide(spec, plan, [1, 3])
    chosen = decision.chosen
    assert chosen.policy == "swap" and "reroute" in decision.rejected
    assert chosen.snapshot_layers == (4, 5, 6, 7) and not chosen.checkpoint_layers
    assert {t.dst for t in chosen.transfers} == {4, 5}


def test_swap_refuses_a_layout_with_no_lost_device():
    spec = standby_job()
    with pytest.raises(PlanningError, match="no device of the layout"):
        swap_plan(spec, initial_plan(spec), [5])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(extra=st.integers(1, 4), data=st.data())
def test_no_plan_puts_more_devices_to_work_than_the_job_size(extra, data):
    """Re-plans, swaps and reroutes alike leave the devices beyond dp x pp spare, after one
    failure or several, so a standby is never absorbed by a re-plan."""
    spec = replace(standby_job(devices=4 + extra, memory=64e9), name="many")
    plan = initial_plan(spec)
    for _ in range(data.draw(st.integers(1, 3))):
        live = list(plan.live_devices)
        if len(live) < 2:
            break
        failed = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live) - 1,
                                    unique=True))
        try:
            plan = decide(spec, plan, failed).chosen
        except PlanningError:
            break
        assert len(plan.working_devices) <= spec.training.size
        assert set(plan.live_devices) == set(live) - set(failed)
