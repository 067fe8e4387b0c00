"""The unit view of a tensor-parallel job (planning/units.py): hand-computed figures, the
identity for tp = 1 on every preset, and what the planner makes of a unit that loses a card."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from chameleon_elastic.planning import decide, initial_plan, tp_allreduce_s, unit_spec
from chameleon_elastic.planning import estimator as est
from chameleon_elastic.spec import JobSpec, preset_names, units_of


def tp_job(tp: int = 4, efficiency: float = 0.5, precision: str = "bf16",
           boundary: list[float] | None = None, tp_bandwidth: float | None = 150.0) -> JobSpec:
    """Two layers on 8 cards, figures chosen so the view's numbers are easy by hand."""
    cluster = {"devices": 8, "device_memory_bytes": 1e6, "bandwidth_bytes_per_s": 100.0,
               "restart_s": 2.0, "failure_rate_per_hour": 0.1}
    if tp_bandwidth is not None:
        cluster["tp_bandwidth_bytes_per_s"] = tp_bandwidth
    model = {"layers": 2, "forward_s": [0.08, 0.16], "backward_s": [0.16, 0.32],
             "param_bytes": 800.0, "optimizer_bytes": 1600.0, "activation_bytes": [400.0, 200.0]}
    if boundary is not None:
        model["boundary_bytes"] = boundary
    return JobSpec.from_dict({
        "model": model, "cluster": cluster,
        "training": {"dp": 2, "pp": 1, "global_micro_batches": 4, "tp": tp,
                     "tp_efficiency": efficiency, "precision": precision},
    }, name="tp-job")


def test_unit_view_by_hand():
    spec = tp_job(boundary=[100.0, 60.0])
    view = unit_spec(spec)
    # 8 cards as 2 units of 4; a unit fails when any of its 4 cards does.
    assert view.cluster.devices == 2
    assert view.cluster.failure_rate_per_hour == pytest.approx(0.4)
    assert view.cluster.device_memory_bytes == 1e6  # per card, unchanged
    # Each card holds a quarter of the layer state and of the activations.
    assert view.model.param_bytes == (200.0, 200.0)
    assert view.model.optimizer_bytes == (400.0, 400.0)
    assert view.model.activation_bytes == (100.0, 50.0)
    # Stage inputs are whole on every card of a unit.
    assert view.model.boundary_bytes == (100.0, 60.0)
    # All-reduce of a layer's output, bf16 from fp32 figures (x 2/4), over 4 cards at 150 B/s:
    # 2 (4 - 1) / 4 x 50 / 150 = 0.5 s; layer 1: 2 x 3/4 x 30 / 150 = 0.3 s.
    assert tp_allreduce_s(spec, 0) == pytest.approx(0.5)
    assert tp_allreduce_s(spec, 1) == pytest.approx(0.3)
    # Compute over 4 cards at 50% efficiency: / 2; plus one all-reduce per direction.
    assert view.model.forward_s == pytest.approx((0.08 / 2 + 0.5, 0.16 / 2 + 0.3))
    assert view.model.backward_s == pytest.approx((0.16 / 2 + 0.5, 0.32 / 2 + 0.3))
    # The view is its own view: its devices are units already.
    assert (view.training.tp, view.training.tp_efficiency) == (1, 1.0)
    assert unit_spec(view) is view
    assert unit_spec(spec) is view  # memoised: the planner's memos key on this object


def test_absent_boundary_is_the_whole_layers_activations():
    # Without boundary_bytes the output falls back on the activations: the unsharded ones.
    spec = tp_job(precision="fp32", boundary=None)
    view = unit_spec(spec)
    assert view.model.boundary_figures == (400.0, 200.0)
    assert view.model.activation_bytes == (100.0, 50.0)
    assert tp_allreduce_s(spec, 0) == pytest.approx(2 * 3 / 4 * 400.0 / 150.0)


def test_intra_unit_link_defaults_to_the_cluster_link():
    spec = tp_job(tp_bandwidth=None, precision="fp32", boundary=[100.0, 100.0])
    assert spec.cluster.tp_bandwidth == 100.0
    assert tp_allreduce_s(spec, 0) == pytest.approx(2 * 3 / 4 * 100.0 / 100.0)


def test_the_estimator_prices_cards_through_the_view():
    spec = tp_job(boundary=[100.0, 60.0])
    view = unit_spec(spec)
    plan = initial_plan(view)  # 2 pipelines of one unit, 2 micro-batches each
    assert [p.devices for p in plan.pipelines] == [(0,), (1,)]
    # Per card: 2 x param + optimizer + autocast's bf16 copy (param x 2/4), plus one
    # micro-batch of bf16 activations in flight: (2 x 200 + 400 + 100) x 2 + (100 + 50) / 2.
    assert plan.estimate.peak_memory_bytes[0] == pytest.approx(2 * 900.0 + 75.0)
    # Data-parallel all-reduce of each card's shard over its own link: 2 (2-1)/2 x 400 / 100.
    assert est.allreduce_time(view, plan) == pytest.approx(4.0)
    step = 2 * (0.54 + 0.38 + 0.58 + 0.46)  # (1 + 2 - 1) x (T_f + T_b) + the all-reduce
    assert plan.estimate.step_time_s == pytest.approx(step + 4.0)


@pytest.mark.parametrize("name", [n for n in preset_names()
                                  if JobSpec.preset(n).training.tp == 1])
def test_tp_1_changes_nothing_on_any_preset(name):
    spec = JobSpec.preset(name)
    view = unit_spec(spec)
    assert view is spec
    plan = initial_plan(view)
    assert plan == initial_plan(spec) and plan.estimate == initial_plan(spec).estimate
    for failed in ([0], [1], [0, spec.cluster.devices - 1]):
        ours, theirs = decide(view, plan, failed), decide(spec, plan, failed)
        assert ours.chosen == theirs.chosen
        assert ours.chosen.estimate == theirs.chosen.estimate
        assert ours.rejected == theirs.rejected


def test_the_tp8_preset_plans_four_units_and_a_card_loses_its_unit():
    job = JobSpec.preset("llama2-7b-910b-tp8")
    assert (job.cluster.devices, job.training.tp) == (32, 8)
    assert (job.training.pp, job.training.dp) == (2, 2)
    view = unit_spec(job)
    assert view.cluster.devices == 4
    assert view.cluster.failure_rate_per_hour == pytest.approx(0.8)
    plan = initial_plan(view)
    assert [p.devices for p in plan.pipelines] == [(0, 1), (2, 3)]
    # Per card: 16 layers of (2 x 404 MB + 2424 MB) / 8 and 2 x 16 x 285 MB / 8 in flight.
    assert plan.estimate.peak_memory_bytes[0] == pytest.approx(
        16 * (2 * 4.04e8 + 2.424e9) / 8 + 2 * 16 * 2.85e8 / 8)
    decision = decide(view, plan, units_of([5], 8))  # card 5: unit 0
    chosen = decision.chosen
    assert chosen.policy == "replan" and len(chosen.live_devices) == 3
    assert 0 not in chosen.working_devices
    assert sum(p.micro_batches for p in chosen.pipelines) == 64
    assert math.isclose(chosen.estimate.throughput / plan.estimate.throughput, 0.744, abs_tol=0.01)


def test_a_lower_efficiency_only_slows_compute():
    fast, slow = (unit_spec(tp_job(efficiency=e, boundary=[100.0, 60.0])) for e in (1.0, 0.5))
    assert slow.model.forward_s[0] - fast.model.forward_s[0] == pytest.approx(0.08 / 2 - 0.08 / 4)
    assert replace(slow.model, forward_s=fast.model.forward_s,
                   backward_s=fast.model.backward_s) == fast.model


def test_whole_layer_times_invert_the_unit_views_timing():
    """A profile measured on units (chameleon-run --profile-out) goes back to what [model]
    states: the unit view of the result reproduces the measured unit times."""
    from chameleon_elastic.planning.units import unit_spec, whole_layer_times

    spec = JobSpec.preset("llama2-7b-910b-tp8")
    planned = unit_spec(spec)
    back = whole_layer_times(spec, planned.model.forward_s)
    assert back == pytest.approx(spec.model.forward_s, rel=1e-12)
    one = JobSpec.preset("tiny-cpu")
    assert whole_layer_times(one, (0.5, 0.25)) == (0.5, 0.25)
