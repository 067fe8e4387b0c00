"""What the simulator's charts draw, checked on the data behind them.

Two hand-made policies with round numbers replay hand-made traces (as in test_engine.py), so
every expected figure can be worked out on paper: ``fast`` pauses 30 s at a failure and goes
on at 2.5 samples/s on 7 devices, ``slow`` pauses 60 s and goes on at 2.0 samples/s on 6.
"""

from __future__ import annotations

import math

import pytest

from chameleon_elastic.sim.engine import Phase, Reaction, simulate
from chameleon_elastic.sim.experiment import ExperimentResult, summarise
from chameleon_elastic.sim.plots import (
    figures,
    live_devices,
    mean_curves,
    pause_spans,
    relative_curves,
    trace_curves,
)
from chameleon_elastic.sim.traces import FailureTrace, TraceEvent
from chameleon_elastic.spec import load_job


class Pauser:
    """10 samples per 2 s step on 8 devices; a failure pauses ``pause_s`` and then runs a
    ``step_s`` step on ``devices``; with ``stall_at`` failures, no layout is left."""

    def __init__(self, name: str, pause_s: float, step_s: float, devices: int,
                 stall_at: int = 0) -> None:
        self.name, self.pause_s, self.step_s, self.devices = name, pause_s, step_s, devices
        self.stall_at, self.failures = stall_at, 0

    def start(self) -> tuple[Phase, ...]:
        return (Phase(math.inf, 2.0, 10.0, 8, "run"),)

    def react(self, ctx, failed, joined) -> Reaction:
        self.failures += len(failed)
        if self.stall_at and self.failures >= self.stall_at:
            return Reaction((Phase(math.inf, None, 0.0, 0, "stalled"),), 0.0, "stalled")
        return Reaction((Phase(self.pause_s, None, 0.0, 0, "transition"),
                         Phase(math.inf, self.step_s, 10.0, self.devices, "run")), 0.0, "replan")


def trace(*times: float, horizon: float = 1000.0) -> FailureTrace:
    return FailureTrace(8, horizon, tuple(TraceEvent(t, i, "fail") for i, t in enumerate(times)))


def experiment(traces: list[FailureTrace]) -> ExperimentResult:
    spec = load_job(None, "llama2-7b-910b")
    result = ExperimentResult(spec, ("fast", "slow"), tuple(range(len(traces))), 5.0)
    for name, pause, step, devices in (("fast", 30.0, 4.0, 7), ("slow", 60.0, 5.0, 6)):
        runs = [simulate(Pauser(name, pause, step, devices), t) for t in traces]
        result.runs[name] = runs
        result.summaries[name] = [summarise(r, i, 5.0) for i, r in enumerate(runs)]
    return result


def test_a_pause_is_a_span_and_a_gap_not_a_drop_to_zero() -> None:
    result = experiment([trace(100.0)])
    assert pause_spans(result.runs["fast"][0]) == [(100.0, 130.0)]
    curves = trace_curves(result, "slow")
    assert curves.pauses_h == [(100.0 / 3600, 160.0 / 3600)] and curves.paused_s == 60.0
    gap = [t for t, r in zip(curves.times_h, curves.rate) if math.isnan(r)]
    assert gap == pytest.approx([100 / 3600, 160 / 3600])
    assert [math.isnan(d) for d in curves.devices] == [math.isnan(r) for r in curves.rate]
    # Nothing drawn is 0: the curve holds 5 samples/s, a gap, then 2 samples/s on 6 devices.
    drawn = [r for r in curves.rate if not math.isnan(r)]
    assert set(drawn) == {5.0, 2.0}
    assert {d for d in curves.devices if not math.isnan(d)} == {8.0, 6.0}


def test_a_failure_during_a_pause_makes_one_longer_pause() -> None:
    # The second failure restarts fast's 30 s pause: one pause 100 .. 140, not two.
    result = experiment([trace(100.0, 110.0)])
    assert pause_spans(result.runs["fast"][0]) == [(100.0, 140.0)]


def test_no_layout_left_is_drawn_at_zero_and_is_no_pause() -> None:
    spec = load_job(None, "llama2-7b-910b")
    run = simulate(Pauser("fast", 30.0, 4.0, 7, stall_at=2), trace(100.0, 500.0))
    result = ExperimentResult(spec, ("fast",), (0,), 5.0, {"fast": [run]})
    curves = trace_curves(result, "fast")
    assert pause_spans(run) == [(100.0, 130.0)]
    assert curves.rate[-1] == 0.0 and curves.devices[-1] == 0.0


def test_the_mean_device_count_keeps_a_pause_at_the_layout_it_leads_to() -> None:
    # Two 100 s bins; fast pauses 100 .. 130 and then runs 7 devices: the second bin shows 7
    # devices in the layout (not 7 x 70%), while its throughput counts the pause as 0.
    result = experiment([trace(100.0, horizon=200.0)])
    centres, rate, layout, live = mean_curves(result, "fast", 2)
    assert centres == pytest.approx([50 / 3600, 150 / 3600])
    assert rate == pytest.approx([5.0, 2.5 * 70 / 100])
    assert layout == pytest.approx([8.0, 7.0])
    assert live == pytest.approx([8.0, 7.0])


def test_the_relative_curve_ends_at_the_reported_paired_ratio() -> None:
    result = experiment([trace(100.0), trace(300.0, 700.0)])
    times, curves = relative_curves(result, "fast", 20)
    assert set(curves) == {"slow"} and times[-1] == pytest.approx(1000.0 / 3600)
    assert curves["slow"][-1] == pytest.approx(result.ratio("fast", "slow").mean)
    # Before the first failure both trained the same; afterwards fast leads.
    assert curves["slow"][0] == pytest.approx(1.0)
    assert all(v >= 1.0 - 1e-12 for v in curves["slow"]) and curves["slow"][-1] > 1.05


@pytest.mark.timeout(60)
def test_every_panel_names_every_policy() -> None:
    import matplotlib.pyplot as plt

    result = experiment([trace(100.0), trace(300.0, 700.0)])
    figs = figures(result, bins=10)
    try:
        assert set(figs) == {"throughput", "relative", "devices"}
        for key, fig in figs.items():
            for ax in fig.axes:
                legend = ax.get_legend()
                if legend is None:   # the pause strip: its rows are labelled instead
                    labels = [t.get_text() for t in ax.get_yticklabels()]
                    assert labels == ["fast: 1, 30 s", "slow: 1, 60 s"], key
                    continue
                text = " ".join(t.get_text() for t in legend.get_texts())
                wanted = ("fast", "slow") if key != "relative" else ("fast / slow",)
                assert all(w in text for w in wanted), (key, ax.get_title(), text)
    finally:
        for fig in figs.values():
            plt.close(fig)


def test_live_devices_step_down_at_each_failure_for_every_policy_alike() -> None:
    result = experiment([trace(100.0, 400.0)])
    t, live = live_devices(result)
    assert t == pytest.approx([0.0, 100 / 3600, 100 / 3600, 400 / 3600, 400 / 3600,
                               1000 / 3600])
    assert live == [8.0, 8.0, 7.0, 7.0, 6.0, 6.0]
