"""Activation recomputation and training precision: known answers for the memory and 1F1B time
of recomputed stages, the planner's ``planner.recompute`` policies, and the invariants (a plan
never exceeds device memory; ``auto`` never recomputes a stage that fits without it)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chameleon_elastic.plan import ExecutionPlan, Pipeline
from chameleon_elastic.planning import PlanningError, decide, initial_plan
from chameleon_elastic.planning import estimator as est
from chameleon_elastic.planning import memory as mem
from chameleon_elastic.planning.layer_splits import recompute_flags, stage_recompute
from chameleon_elastic.planning.schedule import device_orders, simulate
from chameleon_elastic.planning.search import reroute_plan
from chameleon_elastic.spec import JobSpec


def job(*, layers=2, devices=2, dp=1, pp=2, mbs=3, memory=1e12, fwd=1.0, bwd=2.0, param=10.0,
        optimizer=20.0, activation=100.0, boundary=5.0, recompute="auto", precision="fp32",
        model_precision="fp32") -> JobSpec:
    model = {"layers": layers, "forward_s": fwd, "backward_s": bwd, "param_bytes": param,
             "optimizer_bytes": optimizer, "activation_bytes": activation,
             "precision": model_precision}
    if boundary is not None:
        model["boundary_bytes"] = boundary
    return JobSpec.from_dict({
        "model": model,
        "cluster": {"devices": devices, "device_memory_bytes": memory,
                    "bandwidth_bytes_per_s": 1e9, "restart_s": 2.0,
                    "failure_rate_per_hour": 0.1},
        "training": {"dp": dp, "pp": pp, "global_micro_batches": mbs, "precision": precision},
        "planner": {"recompute": recompute},
    })


# --------------------------------------------------------------------------- known answers


def test_stage_memory_by_hand() -> None:
    # 4 layers of param 10, optimizer 20, activations 100, output 5; stages [0, 2) and [2, 4).
    spec = job(layers=4)
    # Resident 2 * (2 * 10 + 20) = 80.
    assert mem.stage_memory(spec, 0, 2, 2) == 80 + 2 * 200
    # Recomputed from layer 0: the input is data (0 bytes), plus one micro-batch rebuilt.
    assert mem.stage_memory(spec, 0, 2, 2, True) == 80 + 0 + 200
    assert mem.stage_memory(spec, 2, 4, 1) == 80 + 200
    # Recomputed from layer 2: layer 1's output per micro-batch in flight.
    assert mem.stage_memory(spec, 2, 4, 1, True) == 80 + 1 * 5 + 200
    assert mem.stage_memory(spec, 2, 4, 3, True) == 80 + 3 * 5 + 200
    assert mem.stage_memory(spec, 2, 4, 0, True) == 80  # nothing in flight, nothing rebuilt


def test_precision_scales_activations_and_adds_the_autocast_weight_copy() -> None:
    # bf16 autocast over figures measured in fp32: activations and inputs halve; a bf16 copy
    # of the weights (param_bytes are fp32: half of them) is held once: 2 x 10 / 2 = 10.
    bf16 = job(layers=4, precision="bf16")
    assert mem.stage_memory(bf16, 0, 2, 2) == 80 + 10 + 2 * 100
    assert mem.stage_memory(bf16, 2, 4, 3, True) == 80 + 10 + 3 * 2.5 + 100
    fp16 = job(layers=4, precision="fp16")
    assert mem.stage_memory(fp16, 2, 4, 3, True) == mem.stage_memory(bf16, 2, 4, 3, True)
    # Figures measured in bf16, trained in fp32: activations double, no weight copy.
    up = job(layers=4, model_precision="bf16")
    assert mem.stage_memory(up, 2, 4, 1) == 80 + 400
    assert mem.stage_memory(up, 2, 4, 1, True) == 80 + 10 + 400
    # Same precision both sides: bytes as given, the weight copy still counts below fp32.
    same = job(layers=4, precision="bf16", model_precision="bf16")
    assert mem.stage_memory(same, 2, 4, 1) == 80 + 10 + 200
    # Times are never converted.
    assert est.stage_times(bf16, 0, 4) == est.stage_times(job(layers=4), 0, 4) == (4.0, 8.0)


def test_boundary_bytes_default_to_the_activations() -> None:
    spec = job(layers=4, boundary=None)
    assert spec.model.boundary_figures == spec.model.activation_bytes
    assert mem.stage_memory(spec, 2, 4, 3, True) == 80 + 3 * 100 + 200


def test_recomputed_backward_runs_the_forward_again() -> None:
    spec = job(layers=4, fwd=[1.0, 1.5, 1.0, 1.0], bwd=2.0)
    assert est.stage_times(spec, 0, 2) == (2.5, 4.0)
    assert est.stage_times(spec, 0, 2, True) == (2.5, 6.5)


def test_one_f_one_b_time_of_a_recomputed_pipeline_by_hand() -> None:
    # Two one-layer stages (T_f 1, T_b 2), 3 micro-batches, stage 0 recomputes (T_b 3).
    # Stage 0 runs F0 F1 B0 F2 B1 B2, stage 1 F0 B0 F1 B1 F2 B2:
    #   S0 F0 0-1, F1 1-2 | S1 F0 1-2, B0 2-4 | S0 B0 4-7 | S1 F1 4-5, B1 5-7
    #   S0 F2 7-8 | S1 F2 8-9, B2 9-11 | S0 B1 8-11, B2 11-14.
    spec = job()
    layers = ((0, 1), (1, 2))
    assert est.pipeline_time(spec, layers, 3, (True, False)) == 14.0
    # Equal stages keep the closed form (N_pp + N_m - 1)(T_f + T_b), with or without.
    assert est.pipeline_time(spec, layers, 3) == (2 + 3 - 1) * 3.0
    assert est.pipeline_time(spec, layers, 3, (True, True)) == (2 + 3 - 1) * 4.0
    plan = ExecutionPlan("initial", 0, (Pipeline((0, 1), layers, 3, (True, False)),)).validate()
    assert est.compute_time(spec, plan) == 14.0
    # Stage 0 holds min(2, 3) = 2 micro-batches, stage 1 one: 40 resident each.
    assert mem.in_flight(plan) == {0: 2, 1: 1}
    assert mem.peak_memory(spec, plan) == {0: 40 + 0 + 100, 1: 40 + 100}


def test_auto_recomputes_only_the_stage_that_does_not_fit() -> None:
    # Stage 0: 40 + 2 x 100 = 240 without, 140 with; stage 1: 140 without, 145 with.
    spec = job(memory=200.0)
    assert recompute_flags(spec, ((0, 1), (1, 2)), 3) == (True, False)
    plan = initial_plan(spec)
    assert plan.pipelines[0].recompute == (True, False)
    assert plan.estimate.step_time_s == 14.0
    assert plan.estimate.peak_memory_bytes == {0: 140.0, 1: 140.0}
    always = initial_plan(job(memory=200.0, recompute="always"))
    assert always.pipelines[0].recompute == (True, True)
    assert always.estimate.step_time_s == 16.0
    with pytest.raises(PlanningError, match="planner.recompute = never"):
        initial_plan(job(memory=200.0, recompute="never"))
    # Plenty of memory: auto and never agree, nobody recomputes.
    assert initial_plan(job()) == initial_plan(job(recompute="never"))
    assert initial_plan(job()).pipelines[0].recompute == (False, False)


def test_stage_recompute_by_policy() -> None:
    fits_both, fits_with, fits_neither = 300.0, 200.0, 100.0  # stage [0, 1) with 2 in flight
    for memory, auto, never, always in ((fits_both, False, False, True),
                                        (fits_with, True, None, True),
                                        (fits_neither, None, None, None)):
        for policy, want in (("auto", auto), ("never", never), ("always", always)):
            assert stage_recompute(job(memory=memory, recompute=policy), 0, 1, 2) is want


# --------------------------------------------------------------------------- rerouting


def rerouting_job(recompute: str = "auto") -> JobSpec:
    # dp 2 x pp 2, 4 layers, quota 4 each. Stage 0: 80 + 2 x 200 = 480 of 500 without.
    # A peer absorbing stage 0 of the other pipeline holds up to 4: 880 without, 280 with.
    return job(layers=4, devices=4, dp=2, pp=2, mbs=8, memory=500.0, recompute=recompute)


def reference_compute_time(spec: JobSpec, plan: ExecutionPlan) -> float:
    """The executed orders simulated op by op: a backward takes T_b + T_f on a recomputing
    device, whoever's micro-batch it is."""
    flag = {d: r for p in plan.pipelines for d, r in zip(p.devices, p.recompute)}

    def duration(op) -> float:
        tf, tb = est.stage_times(spec, *plan.pipelines[op.pipeline].layers[op.stage])
        if op.kind == "F":
            return tf
        return tb + (tf if flag[op.device] else 0.0)

    return simulate(device_orders(plan), duration).makespan


def test_a_rerouting_peer_that_would_overflow_recomputes() -> None:
    spec = rerouting_job()
    base = initial_plan(spec)
    assert all(p.recompute == (False, False) for p in base.pipelines)
    plan = reroute_plan(spec, base, [2])
    assert [p.recompute for p in plan.pipelines] == [(True, False), (False, False)]
    assert mem.in_flight(plan)[0] == 4
    assert plan.estimate.peak_memory_bytes[0] == 80 + 0 + 200
    assert max(plan.estimate.peak_memory_bytes.values()) <= spec.cluster.device_memory_bytes
    # Mixed flags: no closed form; the executed orders with the peer's slower backward.
    assert est.reroute_closed_form(spec, plan) is None
    assert est.compute_time(spec, plan) == reference_compute_time(spec, plan)
    roomy = replace(spec, cluster=replace(spec.cluster, device_memory_bytes=1e12))
    assert est.compute_time(spec, plan) > est.compute_time(roomy, reroute_plan(roomy, base, [2]))
    # Under never the peer does not fit: rerouting is impossible, as it always was.
    with pytest.raises(PlanningError, match="cannot reroute"):
        reroute_plan(rerouting_job("never"), base, [2])


def test_a_peer_that_fits_keeps_its_flag_and_decide_prices_the_reroute() -> None:
    spec = rerouting_job()
    base = initial_plan(spec)
    plan = reroute_plan(spec, base, [3])  # stage 1 peers absorb: 280 + 200 more fits in 500
    assert all(p.recompute == (False, False) for p in plan.pipelines)
    decision = decide(spec, base, [2], policy="reroute")
    assert decision.chosen.pipelines[0].recompute == (True, False)


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", ["tiny-cpu", "llama2-7b-910b", "llama2-7b-910b-32"])
def test_presets_plan_exactly_as_without_recomputation(name: str) -> None:
    spec = JobSpec.preset(name)
    assert spec.planner.recompute == "auto"
    never = replace(spec, planner=replace(spec.planner, recompute="never"))
    plan = initial_plan(spec)
    assert plan == initial_plan(never) and plan.estimate == initial_plan(never).estimate
    assert not any(f for p in plan.pipelines for f in p.recompute)
    for d in plan.live_devices:
        chosen = decide(spec, plan, [d]).chosen
        assert chosen == decide(never, plan, [d]).chosen
        assert not any(f for p in chosen.pipelines for f in p.recompute)


# --------------------------------------------------------------------------- invariants


@st.composite
def tight_jobs(draw):
    pp = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 4))
    layers = draw(st.integers(pp, 10))
    mbs = draw(st.integers(dp, 16))
    activation = [draw(st.sampled_from([1e5, 1e6, 5e6])) for _ in range(layers)]
    boundary = draw(st.one_of(st.none(), st.sampled_from([1e4, 1e5, 1e6])))
    spec = JobSpec.from_dict({
        "model": {"layers": layers, "forward_s": 0.01, "backward_s": 0.02,
                  "param_bytes": 1e6, "optimizer_bytes": 2e6, "activation_bytes": activation,
                  **({} if boundary is None else {"boundary_bytes": boundary})},
        "cluster": {"devices": dp * pp + draw(st.integers(0, 2)),
                    "device_memory_bytes": draw(st.sampled_from([1.5e7, 2.5e7, 4e7, 1e10])),
                    "bandwidth_bytes_per_s": 1e9, "restart_s": 2.0,
                    "failure_rate_per_hour": draw(st.sampled_from([0.01, 0.1, 50.0]))},
        "training": {"dp": dp, "pp": pp, "global_micro_batches": mbs,
                     "precision": draw(st.sampled_from(["fp32", "bf16"]))},
        "planner": {"recompute": draw(st.sampled_from(["auto", "auto", "never", "always"]))},
    })
    events = [draw(st.lists(st.integers(0, spec.cluster.devices - 1), min_size=1, max_size=2,
                            unique=True)) for _ in range(draw(st.integers(1, 3)))]
    return spec, events, draw(st.sampled_from(["auto", "reroute", "replan"]))


def check_recomputation(spec: JobSpec, plan: ExecutionPlan) -> None:
    limit = spec.cluster.device_memory_bytes
    assert max(plan.estimate.peak_memory_bytes.values()) <= limit
    assert plan.estimate.peak_memory_bytes == mem.peak_memory(spec, plan)
    dead = set(plan.failed_devices)
    loads = mem.in_flight(plan)
    for pipe in plan.pipelines:
        for d, (a, b), flag in zip(pipe.devices, pipe.layers, pipe.recompute):
            if d in dead:
                continue
            if spec.planner.recompute == "never":
                assert not flag
            elif spec.planner.recompute == "auto" and flag:
                # auto never recomputes a stage that would fit without it
                assert mem.stage_memory(spec, a, b, loads[d]) > limit
            elif spec.planner.recompute == "always" and plan.policy != "reroute":
                assert flag
    if plan.reroute:
        assert est.compute_time(spec, plan, simulate_reroute=True) == pytest.approx(
            reference_compute_time(spec, plan), rel=1e-12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_jobs())
def test_plans_never_exceed_memory_and_auto_recomputes_only_what_must(case) -> None:
    spec, events, policy = case
    try:
        plan = initial_plan(spec)
    except PlanningError:
        return
    check_recomputation(spec, plan)
    for event in events:
        failed = [d for d in event if d in plan.live_devices]
        if not failed or len(failed) >= len(plan.live_devices):
            continue
        try:
            decision = decide(spec, plan, failed, policy=policy, price_all=True)
        except PlanningError:
            break
        for candidate in decision.candidates.values():
            candidate.validate()
            check_recomputation(spec, candidate)
        plan = decision.chosen
