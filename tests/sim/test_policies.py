"""Policy models against the planner and estimator: the issue's sanity checks and each
baseline's failure model, on small jobs and short horizons."""

from __future__ import annotations

from dataclasses import replace

import pytest

from chameleon_elastic.sim import BaselineConstants, make_policy, simulate
from chameleon_elastic.sim.experiment import fault_free_throughput, run_experiment
from chameleon_elastic.sim.policies import POLICY_NAMES, parse_policies
from chameleon_elastic.sim.traces import FailureTrace, TraceEvent, poisson_trace
from chameleon_elastic.spec import JobSpec

SMALL = "llama2-7b-910b"        # 8 devices, dp=2 x pp=4
PAPER = "llama2-7b-910b-32"     # 32 devices, dp=8 x pp=4


def one_event_trace(spec: JobSpec, *events: tuple[float, int, str],
                    horizon: float) -> FailureTrace:
    return FailureTrace(spec.cluster.devices, horizon,
                        tuple(TraceEvent(t, d, k) for t, d, k in events))  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_zero_failure_rate_gives_every_policy_the_fault_free_throughput() -> None:
    spec = JobSpec.preset(SMALL)
    spec = replace(spec, cluster=replace(spec.cluster, failure_rate_per_hour=0.0))
    trace = poisson_trace(spec.cluster.devices, 0.0, 1.0, seed=0)
    result = run_experiment(spec, [(0, trace)], POLICY_NAMES)
    for name in POLICY_NAMES:
        (summary,) = result.summaries[name]
        assert summary.avg_throughput == pytest.approx(result.fault_free_throughput, rel=1e-12)
        assert summary.transition_s == 0 and summary.lost_samples == 0


@pytest.mark.timeout(60)
def test_one_failure_recycle_loses_less_than_oobleck_over_the_next_hour() -> None:
    # The regime where rerouting's instant recovery pays: a reconfiguration that costs minutes
    # (a 10-minute restart, as a large job's full relaunch takes) against a 1-in-8 reroute.
    base = JobSpec.preset(PAPER)
    spec = replace(base, cluster=replace(base.cluster, restart_s=600.0))
    trace = one_event_trace(spec, (600.0, 5, "fail"), horizon=600.0 + 3600.0)
    ff = fault_free_throughput(spec)
    lost = {}
    for name in ("recycle", "oobleck", "chameleon"):
        run = simulate(make_policy(name, spec, BaselineConstants()), trace)
        lost[name] = 3600.0 - run.timeline.net_between(600.0, 4200.0) / ff
    assert lost["recycle"] < lost["oobleck"]
    # Chameleon prices both and must not do worse than rerouting here.
    assert lost["chameleon"] <= lost["recycle"] + 1e-6


@pytest.mark.timeout(60)
def test_many_failures_oobleck_beats_recycle() -> None:
    spec = JobSpec.preset(PAPER)
    traces = [(s, poisson_trace(32, 0.3, 3.0, seed=s)) for s in (1, 2)]
    assert all(t.failures >= 10 for _, t in traces)
    result = run_experiment(spec, traces, ("oobleck", "recycle"))
    for ours, theirs in zip(result.summaries["oobleck"], result.summaries["recycle"]):
        assert ours.avg_throughput > theirs.avg_throughput


@pytest.mark.timeout(60)
def test_checkpoint_loses_the_work_since_its_last_checkpoint() -> None:
    spec = JobSpec.preset(SMALL)
    constants = BaselineConstants(checkpoint_interval_s=100.0)
    policy = make_policy("checkpoint", spec, constants)
    trace = one_event_trace(spec, (1000.0, 2, "fail"), horizon=2000.0)
    run = simulate(policy, trace)
    first = run.timeline.segments[0]
    save = constants.save_s(spec, policy.plan)  # the layout after the restart has the same pp
    period = 100.0 + save
    since = 1000.0 - (1000.0 // period) * period
    assert run.timeline.lost_samples == pytest.approx(first.rate * since)
    assert [d.kind for d in run.decisions] == ["restart"]
    assert run.decisions[0].pause_s == pytest.approx(spec.cluster.restart_s + save)
    # 7 live devices hold one full 4-stage pipeline; the other 3 idle.
    assert run.timeline.segments[-1].working_devices == 4


@pytest.mark.timeout(60)
def test_recycle_reroutes_until_a_stage_has_no_replica_then_restarts() -> None:
    spec = JobSpec.preset(SMALL)  # pipelines (0,1,2,3) and (4,5,6,7)
    trace = one_event_trace(spec, (100.0, 1, "fail"), (200.0, 5, "fail"), horizon=1000.0)
    run = simulate(make_policy("recycle", spec, BaselineConstants()), trace)
    assert [d.kind for d in run.decisions] == ["reroute", "restart"]
    labels = [s.label for s in run.timeline.segments]
    assert labels == ["run", "reroute", "restart", "run"]
    assert run.timeline.segments[1].working_devices == 7
    assert run.timeline.segments[1].rate < run.timeline.segments[0].rate


@pytest.mark.timeout(60)
def test_chameleon_takes_a_repaired_device_back_and_oobleck_does_not() -> None:
    spec = JobSpec.preset(SMALL)
    trace = one_event_trace(spec, (100.0, 3, "fail"), (700.0, 3, "join"), horizon=3000.0)
    cham = simulate(make_policy("chameleon", spec, BaselineConstants()), trace)
    oob = simulate(make_policy("oobleck", spec, BaselineConstants()), trace)
    assert cham.timeline.segments[-1].working_devices == 8
    assert oob.timeline.segments[-1].working_devices == 7
    assert [d.kind for d in oob.decisions] == ["replan", "spare"]


@pytest.mark.timeout(60)
def test_hybrid_trains_while_staging_so_it_never_trails_chameleon_on_one_failure() -> None:
    spec = JobSpec.preset(PAPER)
    trace = one_event_trace(spec, (600.0, 9, "fail"), horizon=4200.0)
    cham = simulate(make_policy("chameleon", spec, BaselineConstants()), trace)
    hyb = simulate(make_policy("hybrid", spec, BaselineConstants()), trace)
    assert hyb.net_samples >= cham.net_samples - 1e-6
    assert hyb.timeline.paused_s <= cham.timeline.paused_s


def test_policy_names_are_validated() -> None:
    assert parse_policies("chameleon, oobleck,chameleon") == ("chameleon", "oobleck")
    with pytest.raises(ValueError, match="unknown policy 'bamboo'"):
        parse_policies("chameleon,bamboo")
    with pytest.raises(ValueError, match="no policy named"):
        parse_policies(" , ")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["chameleon", "hybrid"])
def test_chameleon_restarts_from_a_checkpoint_when_a_layer_loses_every_replica(name) -> None:
    # The planner's re-plan loads layers [8, 16) from the checkpoint; the model reads that as
    # lost state and restarts from the checkpoint, as before the planner accepted such events.
    spec = JobSpec.preset(SMALL)  # layers [8, 16) live only on devices 1 and 5
    trace = one_event_trace(spec, (1000.0, 1, "fail"), (1000.0, 5, "fail"), horizon=3000.0)
    run = simulate(make_policy(name, spec, BaselineConstants()), trace)
    assert [d.kind for d in run.decisions] == ["restart"]
    assert run.decisions[0].pause_s > spec.cluster.restart_s  # restart + loading the shard
    # The work since the last checkpoint is lost, more than the one step in flight.
    assert run.timeline.lost_samples > spec.training.global_micro_batches
    assert run.timeline.segments[-1].working_devices == 4  # one full pipeline of 6 live


@pytest.mark.timeout(60)
def test_schedule_timing_overlaps_the_penalties_the_closed_form_adds() -> None:
    spec = JobSpec.preset(PAPER)  # devices 1 and 6 sit at stages 1 and 2 of different pipelines
    trace = one_event_trace(spec, (100.0, 1, "fail"), (200.0, 6, "fail"), horizon=1000.0)
    rates = {}
    for timing in ("closed-form", "schedule"):
        constants = BaselineConstants(reroute_timing=timing)  # type: ignore[arg-type]
        run = simulate(make_policy("recycle", spec, constants), trace)
        rates[timing] = [s.rate for s in run.timeline.segments]
    assert rates["schedule"][0] == rates["closed-form"][0]  # fault-free: same plan, same time
    assert rates["schedule"][-1] > rates["closed-form"][-1]
    with pytest.raises(ValueError, match="reroute timing"):
        BaselineConstants(reroute_timing="guess")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_hybrid_restages_when_a_spare_dies_during_staging() -> None:
    base = JobSpec.preset(SMALL)  # 8 devices in dp=2 x pp=4, plus two spares
    slow = base.cluster.bandwidth_bytes_per_s / 100  # transfers long enough to be interrupted
    spec = replace(base, cluster=replace(base.cluster, devices=10, bandwidth_bytes_per_s=slow))
    policy = make_policy("hybrid", spec, BaselineConstants())
    # Device 2 dies; while the re-plan's weights are being staged, spare 9 dies too.
    trace = one_event_trace(spec, (100.0, 2, "fail"), (100.5, 9, "fail"), horizon=2000.0)
    run = simulate(policy, trace)
    assert run.decisions[0].kind == "reroute+replan"
    assert run.timeline.segments[1].label == "staging"
    # Whatever it does next, the job ends on the plan the policy holds, without device 9.
    final = policy.staged.plan if policy.staged is not None else policy.plan
    assert final is not None and 9 not in final.live_devices and 2 not in final.live_devices
    assert run.timeline.segments[-1].working_devices == len(final.working_devices)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_runs_a_job_that_fits_only_with_recomputation(name) -> None:
    # 30 GB: stages 0-2 of the paper's 4-stage layout hold 2-4 micro-batches of 2.3 GB on
    # 25.9 GB of state and must recompute; the last stage (one in flight) fits without.
    base = JobSpec.preset(SMALL)
    spec = replace(base, cluster=replace(base.cluster, device_memory_bytes=30e9))
    policy = make_policy(name, spec, BaselineConstants())
    trace = one_event_trace(spec, (100.0, 2, "fail"), (400.0, 6, "fail"), horizon=2000.0)
    run = simulate(policy, trace)
    assert run.net_samples > 0
    plan = getattr(policy, "plan", None)
    if plan is not None and name != "oobleck":  # oobleck's templates ignore recomputation
        assert any(f for p in plan.pipelines for f in p.recompute)
        assert max(plan.estimate.peak_memory_bytes.values()) <= 30e9
