"""The Oobleck-like model's mix choice: the class-level, branch-and-bound search against its
definition (every mix built as a full plan, quotas handed out one micro-batch at a time)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chameleon_elastic.plan import ExecutionPlan, Pipeline
from chameleon_elastic.planning import estimator, memory
from chameleon_elastic.sim.policies.common import finish
from chameleon_elastic.sim.policies.oobleck import (
    MIN_PIPELINES,
    OobleckPolicy,
    quotas_by_class,
    template_layers,
)
from chameleon_elastic.spec import JobSpec


def throughput_quotas(stage_costs, total):
    """Oobleck's batch rule as defined: one micro-batch at a time (at least one each) to the
    pipeline whose (stages + quota) x slowest stage is least, ties to the lowest index;
    ``stage_costs[i]`` = (stages, slowest stage F+B seconds)."""
    quotas = [1] * len(stage_costs)
    for _ in range(total - len(stage_costs)):
        best = min(range(len(quotas)),
                   key=lambda i: ((stage_costs[i][0] + quotas[i]) * stage_costs[i][1], i))
        quotas[best] += 1
    return tuple(quotas)


def defined_choice(policy: OobleckPolicy, live: list[int]) -> ExecutionPlan | None:
    """Every feasible k priced as a full plan; least step (to 1e-9 s), ties to smaller k."""
    spec, total = policy.spec, policy.spec.training.global_micro_batches
    best = None
    for k in range(MIN_PIPELINES, min(len(live) // policy.min_stages, total) + 1):
        q, r = divmod(len(live), k)
        sizes = [q + 1] * r + [q] * (k - r)
        if sizes[0] > spec.model.layers:
            continue
        splits = [template_layers(spec.model.layers, n) for n in sizes]
        costs = [(n, max(sum(estimator.stage_times(spec, a, b)) for a, b in s))
                 for n, s in zip(sizes, splits)]
        quotas = throughput_quotas(costs, total)
        it = iter(live)
        pipelines = tuple(Pipeline(tuple(next(it) for _ in range(n)), s, m)
                          for n, s, m in zip(sizes, splits, quotas))
        plan = finish(spec, ExecutionPlan("replan", 1, pipelines))
        if memory.fits_in_memory(spec, plan):
            key = (round(plan.estimate.step_time_s, 9), k)
            if best is None or key < best[0]:
                best = (key, plan)
    return None if best is None else best[1]


@st.composite
def clusters(draw):
    layers = draw(st.integers(4, 20))
    devices = draw(st.integers(4, 40))
    spec = JobSpec.from_dict({
        "model": {"layers": layers, "forward_s": draw(st.sampled_from([0.01, 0.007])),
                  "backward_s": 0.02, "param_bytes": draw(st.sampled_from([1e6, 1e8])),
                  "optimizer_bytes": 2e6, "activation_bytes": 1e6},
        "cluster": {"devices": devices, "device_memory_bytes": draw(st.sampled_from([64e9, 8e8])),
                    "bandwidth_bytes_per_s": draw(st.sampled_from([1e9, 25e9])),
                    "restart_s": 5.0, "failure_rate_per_hour": 0.1},
        "training": {"dp": 1, "pp": min(layers, 4),
                     "global_micro_batches": draw(st.integers(2, 3 * devices))},
    })
    live = draw(st.permutations(range(devices)))[: draw(st.integers(2, devices))]
    return spec, list(live)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_mix_choice_matches_pricing_every_mix_as_a_plan(case):
    spec, live = case
    policy = OobleckPolicy(spec)
    if policy.min_stages is None:
        return
    want = defined_choice(policy, live)
    got = policy._instantiate(live, 1)
    if want is None:
        assert got is None
    else:
        assert got is not None and got.pipelines == want.pipelines
        assert got.estimate == want.estimate


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.sampled_from([0.03, 0.05, 0.08]),
                          st.integers(1, 6)), min_size=1, max_size=3),
       st.integers(0, 80))
def test_quotas_by_class_hand_out_what_the_per_micro_batch_greedy_does(classes, extra):
    total = sum(c for *_, c in classes) + extra
    per_pipeline = throughput_quotas([(n, cost) for n, cost, c in classes for _ in range(c)],
                                     total)
    by_class = []
    for (_, _, count), (base, plus) in zip(classes, quotas_by_class(classes, total)):
        by_class += [base + 1] * plus + [base] * (count - plus)
    assert tuple(by_class) == per_pipeline


def test_a_2048_device_failure_is_priced_without_building_every_mix():
    # 1023 feasible mixes; the floor leaves a handful to price in full.
    base = JobSpec.preset("llama2-7b-910b-32")
    spec = replace(base, cluster=replace(base.cluster, devices=2048),
                   training=replace(base.training, dp=512, pp=4, global_micro_batches=2048))
    policy = OobleckPolicy(spec)
    priced = []
    original = policy._price
    policy._price = lambda n, k: priced.append(k) or original(n, k)  # type: ignore[method-assign]
    plan = policy._instantiate(list(range(2047)), 1)
    assert plan is not None and len(plan.working_devices) == 2047
    assert 0 < len(priced) < 50
