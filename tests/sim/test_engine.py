"""The event loop's bookkeeping, checked by hand on a policy with round numbers.

The policy here is a fixture of the engine's protocol (a plain class with fixed numbers), so
that every expected figure below can be computed on paper; the real policies are exercised in
test_policies.py.
"""

from __future__ import annotations

import math

import pytest

from chameleon_elastic.sim.engine import EventContext, Phase, Reaction, simulate
from chameleon_elastic.sim.traces import FailureTrace, TraceEvent


class Stepper:
    """10 samples per 2 s step; a failure costs a 30 s pause and the step in flight, then the
    step takes 4 s. ``carry_on_join``: a join changes nothing."""

    name = "stepper"

    def __init__(self) -> None:
        self.contexts: list[EventContext] = []

    def start(self) -> tuple[Phase, ...]:
        return (Phase(math.inf, 2.0, 10.0, 8, "run"),)

    def react(self, ctx, failed, joined) -> Reaction:
        self.contexts.append(ctx)
        if not failed:
            return Reaction(ctx.remaining, 0.0, "spare")
        return Reaction((Phase(30.0, None, 0.0, 0, "pause"), Phase(math.inf, 4.0, 10.0, 7, "run")),
                        ctx.inflight_samples, "replan")


def trace(*events: tuple[float, int, str], horizon: float = 1000.0) -> FailureTrace:
    return FailureTrace(8, horizon, tuple(TraceEvent(t, d, k) for t, d, k in events))  # type: ignore[arg-type]


def test_no_events_runs_the_fault_free_schedule_to_the_horizon() -> None:
    run = simulate(Stepper(), trace())
    assert run.net_samples == pytest.approx(5.0 * 1000)
    assert run.avg_throughput == pytest.approx(5.0)
    assert run.timeline.lost_samples == 0 and run.timeline.paused_s == 0


def test_a_failure_loses_the_step_in_flight_and_pauses() -> None:
    # At t = 101 s, 50 steps are done and the 51st is half-way: 5 samples lost.
    policy = Stepper()
    run = simulate(policy, trace((101.0, 3, "fail")))
    assert policy.contexts[0].inflight_samples == pytest.approx(5.0)
    assert run.timeline.lost_samples == pytest.approx(5.0)
    assert run.timeline.paused_s == pytest.approx(30.0)
    produced = 101 * 5.0 + (1000 - 131) * 2.5
    assert run.net_samples == pytest.approx(produced - 5.0)
    assert [d.kind for d in run.decisions] == ["replan"]
    assert run.decisions[0].pause_s == pytest.approx(30.0)


def test_a_failure_during_a_pause_restarts_the_pause_and_loses_nothing_more() -> None:
    policy = Stepper()
    run = simulate(policy, trace((100.0, 3, "fail"), (110.0, 4, "fail")))
    assert policy.contexts[1].current.label == "pause"
    assert policy.contexts[1].inflight_samples == 0.0
    assert run.timeline.paused_s == pytest.approx(10.0 + 30.0)
    assert run.net_samples == pytest.approx(100 * 5.0 + (1000 - 140) * 2.5)


def test_carrying_on_keeps_the_rest_of_the_schedule() -> None:
    # The join lands inside the 30 s pause; carrying on keeps the 20 s left of it.
    run = simulate(Stepper(), trace((100.0, 3, "fail"), (110.0, 3, "join")))
    assert run.timeline.paused_s == pytest.approx(30.0)
    assert run.net_samples == pytest.approx(100 * 5.0 + (1000 - 130) * 2.5)


def test_net_since_counts_production_minus_losses() -> None:
    policy = Stepper()
    simulate(policy, trace((101.0, 3, "fail"), (500.0, 4, "fail")))
    ctx = policy.contexts[1]
    # Between 50 s and 500 s: 51 s at 5/s, 30 s paused, 369 s at 2.5/s, minus the 5 lost at 101.
    assert ctx.net_since(50.0) == pytest.approx(51 * 5.0 + 369 * 2.5 - 5.0)


def test_binned_timeline_averages_rate_and_devices() -> None:
    run = simulate(Stepper(), trace((100.0, 3, "fail"), horizon=200.0))
    centres, rate, devices = run.timeline.binned(2, 200.0)
    assert centres == [50.0, 150.0]
    assert rate == pytest.approx([5.0, 2.5 * 70 / 100])
    assert devices == pytest.approx([8.0, 7 * 70 / 100])
