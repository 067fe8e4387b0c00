"""Goodput at scale: the torchft-like and NVRx-like models, the goodput split, the 16k scenario.

Every assertion follows from a mechanism (what a policy throws away, what it pauses for), never
from a figure the simulator printed once."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from chameleon_elastic.planning.search import initial_plan
from chameleon_elastic.sim import BaselineConstants, make_policy, simulate
from chameleon_elastic.sim.cli import main
from chameleon_elastic.sim.constants import checkpoint_shard_bytes
from chameleon_elastic.sim.engine import Phase
from chameleon_elastic.sim.experiment import fault_free_throughput, run_experiment
from chameleon_elastic.sim.goodput import goodput_rows, goodput_table
from chameleon_elastic.sim.policies.torchft import quorum_phases
from chameleon_elastic.sim.traces import FailureTrace, TraceEvent, poisson_trace
from chameleon_elastic.spec import JobSpec

STANDBY = "tiny-cpu-standby"   # 6 devices: dp 2 x pp 2 and two standbys
NEW = ("torchft", "nvrx")


def trace_of(spec: JobSpec, *events: tuple[float, int, str], horizon: float) -> FailureTrace:
    return FailureTrace(spec.cluster.devices, horizon,
                        tuple(TraceEvent(t, d, k) for t, d, k in events))  # type: ignore[arg-type]


def goodput(name: str, spec: JobSpec, trace: FailureTrace,
            constants: BaselineConstants | None = None) -> float:
    run = simulate(make_policy(name, spec, constants or BaselineConstants()), trace)
    return run.net_samples / (fault_free_throughput(spec) * trace.horizon_s)


def test_quorum_phases_pause_then_run_the_live_share_then_rejoin() -> None:
    full = Phase(math.inf, 2.0, 8.0, 8, "run")
    phases = quorum_phases(full, groups=4, live=3, pause_s=5.0, ready_in_s=[20.0],
                           join_s=0.5)
    assert [p.step_time_s for p in phases] == [None, 2.0, None, 2.0]
    assert [p.duration_s for p in phases] == [5.0, 15.0, 0.5, math.inf]
    assert phases[1].samples_per_step == pytest.approx(6.0)      # 3 of 4 groups' batches
    assert phases[1].working_devices == 6
    assert phases[3].samples_per_step == 8.0 and phases[3].label == "run"
    # A group ready inside the pause joins right after it; no live group: nothing trains.
    early = quorum_phases(full, 4, 3, 5.0, [1.0], 0.0)
    assert [p.duration_s for p in early] == [5.0, math.inf] and early[1].rate == full.rate
    assert quorum_phases(full, 4, 0, 0.0, [], 0.0)[0].rate == 0.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", NEW)
def test_no_failure_means_goodput_one(name: str) -> None:
    spec = JobSpec.preset(STANDBY)
    trace = FailureTrace(spec.cluster.devices, 3600.0, ())
    assert goodput(name, spec, trace) == pytest.approx(1.0, rel=1e-12)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ("chameleon", *NEW, "checkpoint"))
def test_more_failures_less_goodput(name: str) -> None:
    spec = JobSpec.preset(STANDBY)
    one = trace_of(spec, (900.0, 0, "fail"), horizon=3600.0)
    two = trace_of(spec, (900.0, 0, "fail"), (2000.0, 3, "fail"), horizon=3600.0)
    assert goodput(name, spec, two) < goodput(name, spec, one) < 1.0


@pytest.mark.timeout(60)
def test_torchft_group_leaves_then_heals_onto_a_standby() -> None:
    spec = JobSpec.preset(STANDBY)
    c = BaselineConstants()
    run = simulate(make_policy("torchft", spec, c), trace_of(spec, (600.0, 1, "fail"),
                                                             horizon=3600.0))
    plan = initial_plan(spec)
    heal = c.torchft_restart_s + (checkpoint_shard_bytes(spec, plan)
                                  / c.torchft_heal_bandwidth_bytes_per_s)
    full = fault_free_throughput(spec)
    rates = [(s.start_s, s.rate) for s in run.timeline.segments]
    # Survivors pause for the quorum change, then train at half rate (one of two groups)
    # until the healed group joins; then the whole batch again.
    assert (600.0, 0.0) in rates
    half = [t for t, r in rates if r == pytest.approx(full / 2)]
    assert half == [pytest.approx(600.0 + c.torchft_failure_s)]
    assert run.timeline.segments[-1].rate == pytest.approx(full)
    assert run.timeline.segments[-1].start_s == pytest.approx(600.0 + heal + c.torchft_join_s)


@pytest.mark.timeout(60)
def test_torchft_without_a_replacement_keeps_the_group_out_until_a_repair() -> None:
    spec = JobSpec.preset("llama2-7b-910b")   # dp 2 x pp 4, no standby
    full = fault_free_throughput(spec)
    groups = spec.training.dp
    out = simulate(make_policy("torchft", spec, BaselineConstants()),
                   trace_of(spec, (600.0, 1, "fail"), horizon=3600.0))
    assert out.timeline.segments[-1].rate == pytest.approx(full * (groups - 1) / groups)
    back = simulate(make_policy("torchft", spec, BaselineConstants()),
                    trace_of(spec, (600.0, 1, "fail"), (1800.0, 1, "join"), horizon=3600.0))
    assert back.timeline.segments[-1].rate == pytest.approx(full)


@pytest.mark.timeout(60)
def test_nvrx_is_a_cheaper_checkpoint_restart_and_torchft_redoes_only_the_step() -> None:
    # Same checkpoint interval and load; NVRx restarts in process (1.5 s + a step, less than
    # the job's restart_s) and saves asynchronously: it never trails checkpoint-restart. A
    # quorum policy throws away only the step in flight, NVRx the work since its checkpoint.
    spec = JobSpec.preset(STANDBY)
    assert BaselineConstants().nvrx_restart_s < spec.cluster.restart_s
    for seed in range(3):
        trace = poisson_trace(spec.cluster.devices, 0.5, 2.0, seed=seed, mttr_s=900.0)
        runs = {n: simulate(make_policy(n, spec, BaselineConstants()), trace)
                for n in ("nvrx", "checkpoint", "torchft")}
        assert trace.failures > 0
        assert runs["nvrx"].net_samples > runs["checkpoint"].net_samples
        assert runs["torchft"].timeline.lost_samples <= runs["nvrx"].timeline.lost_samples


@pytest.mark.timeout(60)
def test_goodput_shares_sum_to_one_and_goodput_is_the_relative_throughput() -> None:
    spec = JobSpec.preset(STANDBY)
    traces = [(s, poisson_trace(spec.cluster.devices, 1.0, 2.0, seed=s)) for s in (0, 1)]
    result = run_experiment(spec, traces, ("chameleon", *NEW, "checkpoint"))
    for row in goodput_rows(result):
        assert row.goodput.mean + row.paused + row.redone + row.slowed == pytest.approx(1.0)
        assert row.goodput.mean == pytest.approx(result.spread(row.policy,
                                                               "relative_throughput").mean)
        assert row.paused >= 0 and row.redone >= 0
    assert goodput_table(result).row_count == 4


def test_shard_bytes_per_distinct_range_equal_the_per_device_sum() -> None:
    # The shortcut against the per-role sum it replaced, with a failed device in the plan.
    spec = JobSpec.preset("llama2-7b-910b-32")
    plan = initial_plan(spec)
    plan = replace(plan, failed_devices=(plan.pipelines[0].devices[0],))
    by_role = max(sum(spec.model.transfer_bytes(i) for i in range(r.layer_start, r.layer_end))
                  for r in plan.roles())
    assert checkpoint_shard_bytes(spec, plan) == by_role


@pytest.mark.timeout(60)
def test_the_16k_scenario_runs_in_seconds_and_reports_goodput(capsys, tmp_path) -> None:
    out = tmp_path / "g"
    assert main(["--scenario", "goodput-16k", "--seeds", "1", "--hours", "4", "--jobs", "1",
                 "--no-progress", "--json", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["setting"]["devices"] == 16512 and doc["setting"]["units"] == 2064
    # 1.8 h MTTF over the 16,384 training cards.
    rate = doc["setting"]["failure_rate_per_hour"]
    assert 1.0 / (rate * 16384) == pytest.approx(1.8, rel=1e-3)
    assert set(doc["goodput"]) == {"chameleon", "torchft", "nvrx", "checkpoint"}
    assert all(0.0 < g["goodput"]["mean"] <= 1.0 for g in doc["goodput"].values())
    assert (out / "goodput.png").stat().st_size > 0
    # An explicit flag wins over the scenario's.
    assert main(["--scenario", "goodput-16k", "--seeds", "1", "--hours", "1",
                 "--policies", "torchft", "--jobs", "1", "--no-progress", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["goodput"]) == {"torchft"}
