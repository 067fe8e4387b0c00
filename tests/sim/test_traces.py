"""Failure traces: generators are seeded and follow their model; CSV round-trips; bad input
fails with a message that names the fix."""

from __future__ import annotations

import math

import pytest

from chameleon_elastic.sim.traces import (
    FailureTrace,
    TraceError,
    TraceEvent,
    cards_to_units,
    generate_trace,
    hourly_trace,
    poisson_trace,
    read_trace,
    units_to_cards,
    write_trace,
)


@pytest.mark.parametrize("model", ["poisson", "hourly"])
def test_same_seed_same_trace_other_seed_other_trace(model: str) -> None:
    a = generate_trace(model, 64, 0.1, 9, seed=3)
    b = generate_trace(model, 64, 0.1, 9, seed=3)
    c = generate_trace(model, 64, 0.1, 9, seed=4)
    assert a == b
    assert a.events != c.events


@pytest.mark.parametrize("model", ["poisson", "hourly"])
def test_zero_rate_has_no_failures(model: str) -> None:
    assert generate_trace(model, 32, 0.0, 9, seed=0).events == ()


def test_poisson_failure_count_matches_exponential_model() -> None:
    # Without repair a device fails at most once: P(fail within 9 h) = 1 - exp(-0.9).
    counts = [poisson_trace(512, 0.1, 9, seed).failures for seed in range(10)]
    mean = sum(counts) / len(counts)
    expected = 512 * (1 - math.exp(-0.9))
    assert abs(mean - expected) < 0.05 * expected


def test_hourly_model_fails_each_live_device_with_probability_rate_per_hour() -> None:
    # Survival after 9 hourly draws at p = 0.1 is 0.9^9.
    counts = [hourly_trace(512, 0.1, 9, seed).failures for seed in range(10)]
    mean = sum(counts) / len(counts)
    expected = 512 * (1 - 0.9 ** 9)
    assert abs(mean - expected) < 0.05 * expected
    trace = hourly_trace(512, 0.1, 9, seed=1)
    assert all(0 <= e.time_s < 9 * 3600 for e in trace.events)


@pytest.mark.parametrize("model", ["poisson", "hourly"])
def test_repairs_alternate_with_failures_and_devices_fail_again(model: str) -> None:
    trace = generate_trace(model, 16, 0.5, 9, seed=2, mttr_s=600.0)
    joins = [e for e in trace.events if e.kind == "join"]
    assert joins, "with a 10-minute MTTR some devices must come back within 9 hours"
    per_device: dict[int, list[str]] = {}
    for e in trace.events:
        per_device.setdefault(e.device, []).append(e.kind)
    assert any(kinds.count("fail") > 1 for kinds in per_device.values())
    for kinds in per_device.values():
        assert kinds[::2] == ["fail"] * len(kinds[::2])
        assert kinds[1::2] == ["join"] * len(kinds[1::2])


def test_groups_merge_simultaneous_events_and_live_count_tracks_them() -> None:
    events = (TraceEvent(10.0, 1, "fail"), TraceEvent(10.0, 2, "fail"),
              TraceEvent(20.0, 1, "join"), TraceEvent(99.0, 3, "fail"))
    trace = FailureTrace(4, 50.0, events)
    groups = list(trace.groups())
    assert [(g.time_s, g.failed, g.joined) for g in groups] == [
        (10.0, (1, 2), ()), (20.0, (), (1,))]  # the event past the horizon is not replayed
    assert trace.live_at(15.0) == 2 and trace.live_at(25.0) == 3


def test_csv_round_trip(tmp_path) -> None:
    trace = poisson_trace(32, 0.3, 2, seed=5, mttr_s=900.0)
    path = tmp_path / "t.csv"
    write_trace(trace, path)
    back = read_trace(path)
    assert back.events == trace.events
    assert back.devices == 32 and back.horizon_s == trace.horizon_s


def test_csv_without_metadata_needs_devices_and_horizon(tmp_path) -> None:
    path = tmp_path / "log.csv"
    path.write_text("time_s,device,event\n5.5,3,fail\n1.0,2,fail\n")
    with pytest.raises(TraceError, match="how many devices"):
        read_trace(path)
    trace = read_trace(path, devices=4, horizon_s=100.0)
    assert [(e.time_s, e.device) for e in trace.events] == [(1.0, 2), (5.5, 3)]


@pytest.mark.parametrize("body, message", [
    ("time_s,device,event\n1,9,fail\n", "outside 0..3"),
    ("time_s,device,event\n1,1,fail\n2,1,fail\n", "already dead"),
    ("time_s,device,event\n1,1,join\n", "still alive"),
    ("time_s,device,event\nsoon,1,fail\n", "row 2"),
    ("when,who\n1,1\n", "header row"),
    ("time_s,device,event\n1,1,explode\n", "unknown event kind"),
])
def test_bad_trace_files_are_rejected_with_the_fix(tmp_path, body: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(TraceError, match=message):
        read_trace(path, devices=4, horizon_s=100.0)


def test_missing_file_and_bad_requests() -> None:
    with pytest.raises(TraceError, match="cannot read trace file"):
        read_trace("/nonexistent/trace.csv")
    with pytest.raises(TraceError, match="failure rate"):
        poisson_trace(4, -0.1, 1, 0)
    with pytest.raises(TraceError, match="hours"):
        hourly_trace(4, 0.1, 0, 0)
    with pytest.raises(TraceError, match="MTTR"):
        poisson_trace(4, 0.1, 1, 0, mttr_s=0.0)
    with pytest.raises(TraceError, match="unknown trace model"):
        generate_trace("weibull", 4, 0.1, 1, 0)


# --------------------------------------------------------------------------- cards and units


def test_card_traces_map_to_units():
    cards = FailureTrace(8, 100.0, (
        TraceEvent(1.0, 1, "fail"),   # unit 0 goes down
        TraceEvent(2.0, 0, "fail"),   # unit 0 already down: nothing
        TraceEvent(3.0, 6, "fail"),   # unit 1 goes down
        TraceEvent(4.0, 1, "join"),   # card 0 still down: unit 0 stays down
        TraceEvent(5.0, 0, "join"),   # unit 0 whole again
        TraceEvent(6.0, 5, "fail"),   # unit 1 already down
    ))
    units = cards_to_units(cards, 4)
    assert units.devices == 2 and units.horizon_s == 100.0
    assert [(e.time_s, e.device, e.kind) for e in units.events] == [
        (1.0, 0, "fail"), (3.0, 1, "fail"), (5.0, 0, "join")]
    assert cards_to_units(cards, 1) is cards


def test_unit_traces_written_as_cards_replay_to_the_same_units(tmp_path):
    units = poisson_trace(4, 0.8, 3.0, seed=5, mttr_s=1800.0)
    cards = units_to_cards(units, 8)
    assert cards.devices == 32 and all(e.device % 8 == 0 for e in cards.events)
    write_trace(cards, tmp_path / "t.csv")
    back = cards_to_units(read_trace(tmp_path / "t.csv"), 8)
    assert back.events == units.events and back.devices == 4
    assert units_to_cards(units, 1) is units


def test_a_card_trace_that_is_not_whole_units_is_refused():
    with pytest.raises(TraceError, match="not a multiple of training.tp = 4"):
        cards_to_units(FailureTrace(6, 10.0, ()), 4)
