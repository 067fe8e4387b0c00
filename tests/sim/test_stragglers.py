"""Slow devices in the simulator: ``slow`` trace events, replayed by every policy; chameleon
decides about them as the launcher does, the others run at the slowest device's pace."""

from __future__ import annotations

import json
import math

import pytest

from chameleon_elastic.sim.cli import main
from chameleon_elastic.sim.engine import Phase, Reaction, simulate
from chameleon_elastic.sim.policies.chameleon import ChameleonPolicy
from chameleon_elastic.sim.traces import (
    FailureTrace,
    TraceError,
    TraceEvent,
    cards_to_units,
    read_trace,
    write_trace,
)
from chameleon_elastic.spec import JobSpec

SLOW = FailureTrace(4, 3600.0, (TraceEvent(600.0, 1, "fail"),
                                TraceEvent(600.0, 3, "slow", 0.5),
                                TraceEvent(2400.0, 3, "slow", 1.0)))


class Ignoring:
    """Runs 2 s steps of 10 samples and never re-plans."""

    name = "ignoring"

    def start(self):
        return (Phase(math.inf, 2.0, 10.0, 4, "run"),)

    def react(self, ctx, failed, joined):
        return Reaction(ctx.remaining, 0.0, "nothing")


def test_slow_events_round_trip_and_come_in_groups_of_their_own(tmp_path):
    path = tmp_path / "t.csv"
    write_trace(SLOW, path)
    assert "time_s,device,event,factor" in path.read_text()
    again = read_trace(path)
    assert again.events == SLOW.events and again.live_at(3000.0) == 3
    groups = list(again.groups())
    assert [(g.time_s, g.failed, g.slowed) for g in groups] == [
        (600.0, (1,), ()), (600.0, (), ((3, 0.5),)), (2400.0, (), ((3, 1.0),))]
    plain = FailureTrace(4, 10.0, (TraceEvent(1.0, 2, "fail"),))
    assert "factor" not in write_trace(plain)   # traces without slow events are as they were
    assert cards_to_units(FailureTrace(4, 10.0, (TraceEvent(1.0, 3, "slow", 0.5),)), 2
                          ).events == (TraceEvent(1.0, 1, "slow", 0.5),)


@pytest.mark.parametrize("factor", [0.0, -1.0, math.inf])
def test_a_bad_factor_is_named(factor):
    with pytest.raises(TraceError, match="speed factor"):
        FailureTrace(4, 10.0, (TraceEvent(1.0, 2, "slow", factor),))


def test_a_policy_that_does_nothing_runs_at_the_slowest_devices_pace():
    trace = FailureTrace(4, 1000.0, (TraceEvent(100.0, 3, "slow", 0.5),
                                     TraceEvent(500.0, 3, "slow", 1.0)))
    run = simulate(Ignoring(), trace)
    assert run.net_samples == pytest.approx(5.0 * 100 + 2.5 * 400 + 5.0 * 500)
    dead = FailureTrace(4, 1000.0, (TraceEvent(100.0, 3, "slow", 0.5),
                                    TraceEvent(500.0, 3, "fail")))
    assert simulate(Ignoring(), dead).net_samples == pytest.approx(500 + 1000 + 2500)


def test_chameleon_plans_around_a_straggler_and_back_and_beats_ignoring_it():
    spec = JobSpec.preset("tiny-cpu")
    trace = FailureTrace(4, 3600.0, (TraceEvent(600.0, 3, "slow", 0.5),
                                     TraceEvent(2400.0, 3, "slow", 1.0)))
    run = simulate(ChameleonPolicy(spec), trace)
    assert [d.kind for d in run.decisions] == ["reduce", "reduce"]
    ignored = simulate(_Kept(spec), trace)
    assert run.net_samples > ignored.net_samples
    after_failure = simulate(ChameleonPolicy(spec), SLOW)
    assert after_failure.decisions[0].kind in ("replan", "reroute")
    assert after_failure.decisions[1].kind in ("keep", "reduce", "spare")


class _Kept(ChameleonPolicy):
    """Chameleon that never decides about slow devices (the engine stretches its steps)."""

    slow = None


def test_chameleon_sim_replays_a_trace_with_slow_events(tmp_path, capsys):
    path = tmp_path / "t.csv"
    write_trace(FailureTrace(4, 3600.0, (TraceEvent(600.0, 3, "slow", 0.5),)), path)
    assert main(["--preset", "tiny-cpu", "--trace", str(path), "--no-progress",
                 "--policies", "chameleon,recycle", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["policies"]["chameleon"]["decisions_total"] == {"reduce": 1}
    assert doc["policies"]["recycle"]["decisions_total"] == {"slowed": 1}
    assert (doc["policies"]["chameleon"]["avg_throughput"]
            > doc["policies"]["recycle"]["avg_throughput"])
