"""Speed factors in the planner: keep, reduce or spare a slow device, by the failure's score."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_search import jobs_and_failures, make_spec

from chameleon_elastic.planning import PlanningError, decide, estimator, initial_plan
from chameleon_elastic.planning.estimator import EstimatorError
from chameleon_elastic.planning.stragglers import decide_speeds, keep_plan
from chameleon_elastic.spec import JobSpec


def _initial(spec: JobSpec):
    try:
        return initial_plan(spec)
    except PlanningError:
        assume(False)


@st.composite
def jobs_and_speeds(draw):
    spec, events, policy = draw(jobs_and_failures())
    plan = _initial(spec)
    if draw(st.booleans()):   # sometimes from a plan after a failure (rerouted or re-planned)
        failed = [d for d in events[0] if d in plan.live_devices]
        if failed and set(failed) < set(plan.live_devices):
            try:
                plan = decide(spec, plan, failed, policy=policy).chosen
            except PlanningError:
                pass
    devices = list(plan.live_devices)
    slow = draw(st.lists(st.sampled_from(devices), min_size=1, max_size=2, unique=True))
    speeds = {d: draw(st.sampled_from([0.2, 0.5, 0.7, 0.9, 1.0, 1.5])) for d in slow}
    return spec, plan, speeds, policy


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs_and_speeds())
def test_the_choice_never_scores_below_keeping_the_layout(case):
    spec, plan, speeds, policy = case
    d = decide_speeds(spec, plan, speeds, policy)
    keep = keep_plan(spec, plan, speeds).estimate.score
    assert d.chosen.estimate.score >= keep
    assert d.chosen.global_micro_batches == spec.training.global_micro_batches
    assert set(d.chosen.live_devices) == set(plan.live_devices)
    for option in d.candidates.values():
        option.validate()
        assert option.estimate.step_time_s == pytest.approx(
            estimator.step_time(spec, option, speeds=speeds))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs_and_failures())
def test_all_factors_one_change_nothing(case):
    spec, events, policy = case
    plan = _initial(spec)
    ones = dict.fromkeys(range(spec.cluster.devices), 1.0)
    assert estimator.evaluate(spec, plan, ones) == estimator.evaluate(spec, plan)
    assert decide_speeds(spec, plan, ones, policy).chosen is not None
    assert decide_speeds(spec, plan, ones, policy).chosen == plan   # kept, same generation
    for failed in events:
        failed = [d for d in failed if d in plan.live_devices]
        if not failed or set(failed) >= set(plan.live_devices):
            continue
        try:
            plan = decide(spec, plan, failed, policy=policy).chosen
        except PlanningError:
            return
        assert estimator.evaluate(spec, plan, ones) == plan.estimate


def test_a_half_speed_device_gets_less_work_and_it_comes_back_when_it_recovers():
    spec = make_spec(layers=8, devices=4, dp=2, pp=2, mbs=8, rate=0.01)
    start = initial_plan(spec)
    slowed = decide_speeds(spec, start, {3: 0.5})
    assert slowed.chosen.policy == "replan" and slowed.chosen.generation == 1
    pipe = next(p for p in slowed.chosen.pipelines if 3 in p.devices)
    stage = pipe.devices.index(3)
    assert pipe.layers[stage][1] - pipe.layers[stage][0] < 4 or pipe.micro_batches < 4
    assert slowed.chosen.estimate.score > slowed.candidates["keep"].estimate.score
    back = decide_speeds(spec, slowed.chosen, {}, before={3: 0.5})
    assert [(p.devices, p.layers, p.micro_batches) for p in back.chosen.pipelines] == [
        (p.devices, p.layers, p.micro_batches) for p in start.pipelines]


def test_a_very_slow_device_is_left_out_when_that_scores_best_and_taken_back_at_speed():
    spec = make_spec(layers=8, devices=4, dp=4, pp=1, mbs=8, rate=0.01)
    d = decide_speeds(spec, initial_plan(spec), {2: 0.1})
    assert 2 in d.chosen.spare_devices and 2 not in d.chosen.working_devices
    back = decide_speeds(spec, d.chosen, {}, before={2: 0.1})
    assert 2 in back.chosen.working_devices and not back.chosen.spare_devices


def test_frequent_failures_keep_the_layout_since_a_switch_never_pays():
    spec = make_spec(layers=8, devices=4, dp=2, pp=2, mbs=8, rate=5000.0)
    d = decide_speeds(spec, initial_plan(spec), {3: 0.9})
    assert d.chosen == initial_plan(spec)


def test_reroute_policy_only_keeps():
    spec = make_spec(layers=8, devices=4, dp=2, pp=2, mbs=8, rate=0.01)
    d = decide_speeds(spec, initial_plan(spec), {3: 0.5}, policy="reroute")
    assert set(d.candidates) == {"keep"}


@pytest.mark.parametrize("factor", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_factors_are_named(factor):
    spec: JobSpec = make_spec(layers=8, devices=4, dp=2, pp=2, mbs=8)
    with pytest.raises(EstimatorError, match="device 1 has speed factor"):
        decide_speeds(spec, initial_plan(spec), {1: factor})
