"""Failure traces: when each device fails and, optionally, when it comes back.

A trace is the only source of randomness in a simulation. Every policy is replayed over the same
trace, so their differences come from their decisions and models alone, never from luck. Two
generators are provided:

* ``poisson``: every live device fails after an exponential time with mean ``1 / rate`` hours
  (a memoryless per-device failure process, the model behind the paper's "10% per device-hour").
* ``hourly``: the model of the Bamboo and Oobleck simulators: at the start of every hour each
  live device fails with probability ``rate`` (clamped to 1), at a time uniform within that hour.

With ``mttr_s`` set, a failed device is repaired after an exponential time with that mean and
rejoins (a ``join`` event); it can then fail again. Without it, a failure is permanent.

Traces are written and read as CSV (``time_s,device,event``) with ``#`` comment lines carrying
the device count, the horizon and how the trace was made, so a trace from a real cluster log can
be replayed by every policy.

A trace may also slow devices down: a ``slow`` event gives a device a speed factor from then on
(a ``factor`` column: 0.5 half speed, 1.0 back at speed; the column is written only when a trace
has such events, and read when present). Slow events never change who is alive, and come in
groups of their own, so a policy decides about a straggler apart from a failure at the same
instant.

With tensor parallelism (``training.tp > 1``) the simulator runs on units of ``tp`` cards, but
a cluster log names cards: ``cards_to_units`` turns a card trace into the unit trace the
policies replay (a unit is down while any of its cards is), and ``units_to_cards`` writes a
unit trace back as cards (each unit event as its first card's), so that a written trace
replays to the same unit trace.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Literal

import numpy as np

from ..spec import cards_of, unit_of

__all__ = [
    "TRACE_MODELS",
    "EventGroup",
    "EventKind",
    "FailureTrace",
    "TraceError",
    "TraceEvent",
    "cards_to_units",
    "generate_trace",
    "hourly_trace",
    "poisson_trace",
    "read_trace",
    "units_to_cards",
    "write_trace",
]

EventKind = Literal["fail", "join", "slow"]
TRACE_MODELS: tuple[str, ...] = ("poisson", "hourly")


class TraceError(ValueError):
    """A trace or trace request that cannot be used; the message names the problem and fix."""


@dataclass(frozen=True)
class TraceEvent:
    time_s: float
    device: int
    kind: EventKind
    factor: float = 1.0   # a ``slow`` event's speed factor (1.0: back at speed)


@dataclass(frozen=True)
class EventGroup:
    """Events at one instant: the simulator makes one decision for all of them. A group is
    either failures and joins, or speed changes (``slowed``: device -> factor)."""

    time_s: float
    failed: tuple[int, ...]
    joined: tuple[int, ...]
    slowed: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class FailureTrace:
    devices: int
    horizon_s: float
    events: tuple[TraceEvent, ...]
    description: str = ""

    def __post_init__(self) -> None:
        _check(self)

    @property
    def failures(self) -> int:
        return sum(1 for e in self.events if e.kind == "fail")

    def groups(self) -> Iterator[EventGroup]:
        """Events inside the horizon, grouped by time (failures and joins first, then speed
        changes at the same instant), in time order."""
        inside = (e for e in self.events if e.time_s < self.horizon_s)
        for (t, slow), batch in groupby(inside, key=lambda e: (e.time_s, e.kind == "slow")):
            items = list(batch)
            if slow:
                yield EventGroup(t, (), (), tuple(sorted({e.device: e.factor
                                                          for e in items}.items())))
                continue
            yield EventGroup(
                time_s=t,
                failed=tuple(sorted(e.device for e in items if e.kind == "fail")),
                joined=tuple(sorted(e.device for e in items if e.kind == "join")),
            )

    def live_at(self, time_s: float) -> int:
        """Number of live devices just after ``time_s``."""
        live = self.devices
        for e in self.events:
            if e.time_s > time_s:
                break
            live += {"fail": -1, "join": 1}.get(e.kind, 0)
        return live


def _check(trace: FailureTrace) -> None:
    if trace.devices < 1:
        raise TraceError(f"a trace needs at least one device, got devices = {trace.devices}.")
    if not (trace.horizon_s > 0 and math.isfinite(trace.horizon_s)):
        raise TraceError(
            f"trace horizon {trace.horizon_s!r} s is invalid; pass a positive number of hours."
        )
    alive = [True] * trace.devices
    last = 0.0
    for i, e in enumerate(trace.events):
        where = f"trace event {i} ({e.kind} of device {e.device} at {e.time_s:g} s)"
        if not (0 <= e.device < trace.devices):
            raise TraceError(
                f"{where} names a device outside 0..{trace.devices - 1}; fix the device id or "
                "simulate a job with more devices."
            )
        if not (math.isfinite(e.time_s) and e.time_s >= last):
            raise TraceError(f"{where} is out of time order; sort the trace by time_s.")
        if e.kind not in ("fail", "join", "slow"):
            raise TraceError(f"{where} has unknown event kind; use 'fail', 'join' or 'slow'.")
        if e.kind == "slow":
            if not (math.isfinite(e.factor) and e.factor > 0):
                raise TraceError(f"{where} has speed factor {e.factor!r}; give a positive "
                                 "factor (0.5 half speed, 1.0 back at speed).")
            last = e.time_s
            continue
        if (e.kind == "fail") != alive[e.device]:
            state = "already dead" if e.kind == "fail" else "still alive"
            raise TraceError(
                f"{where} is impossible because the device is {state}; a device must alternate "
                "fail, join, fail, ..."
            )
        alive[e.device] = e.kind == "join"
        last = e.time_s


# --------------------------------------------------------------------------- generators


def _validate_request(devices: int, rate_per_hour: float, hours: float,
                      mttr_s: float | None) -> None:
    if devices < 1:
        raise TraceError(f"devices = {devices} is invalid; a job needs at least one device.")
    if not (math.isfinite(rate_per_hour) and rate_per_hour >= 0):
        raise TraceError(
            f"failure rate {rate_per_hour!r} per device-hour is invalid; pass a number >= 0 "
            "(0.1 means 10% per device per hour)."
        )
    if not (math.isfinite(hours) and hours > 0):
        raise TraceError(f"hours = {hours!r} is invalid; pass a positive number of hours.")
    if mttr_s is not None and not (math.isfinite(mttr_s) and mttr_s > 0):
        raise TraceError(
            f"MTTR {mttr_s!r} s is invalid; pass a positive mean repair time or leave it out "
            "for permanent failures."
        )


def poisson_trace(devices: int, rate_per_hour: float, hours: float, seed: int,
                  mttr_s: float | None = None) -> FailureTrace:
    """Exponential time to failure per device; exponential repair with mean ``mttr_s``."""
    _validate_request(devices, rate_per_hour, hours, mttr_s)
    rng = np.random.default_rng(seed)
    horizon = hours * 3600.0
    events: list[TraceEvent] = []
    if rate_per_hour > 0:
        mean_up = 3600.0 / rate_per_hour
        for d in range(devices):
            t = 0.0
            while True:
                t += float(rng.exponential(mean_up))
                if t >= horizon:
                    break
                events.append(TraceEvent(t, d, "fail"))
                if mttr_s is None:
                    break
                t += float(rng.exponential(mttr_s))
                if t >= horizon:
                    break
                events.append(TraceEvent(t, d, "join"))
    desc = f"poisson rate={rate_per_hour:g}/h seed={seed}" + (
        f" mttr={mttr_s:g}s" if mttr_s is not None else "")
    return FailureTrace(devices, horizon, _sorted(events), desc)


def hourly_trace(devices: int, rate_per_hour: float, hours: float, seed: int,
                 mttr_s: float | None = None) -> FailureTrace:
    """Bamboo/Oobleck model: per hour, each live device fails with probability ``rate``
    at a uniform time inside that hour; repairs as in :func:`poisson_trace`."""
    _validate_request(devices, rate_per_hour, hours, mttr_s)
    rng = np.random.default_rng(seed)
    horizon = hours * 3600.0
    p = min(1.0, rate_per_hour)
    down_until = [0.0] * devices  # a device is live from this time on (inf: never again)
    events: list[TraceEvent] = []
    for hour in range(math.ceil(hours)):
        start = hour * 3600.0
        draws = rng.random(devices)
        offsets = rng.random(devices) * 3600.0
        for d in range(devices):
            t = start + float(offsets[d])
            if draws[d] >= p or t < down_until[d] or t >= horizon:
                continue
            events.append(TraceEvent(t, d, "fail"))
            if mttr_s is None:
                down_until[d] = math.inf
                continue
            back = t + float(rng.exponential(mttr_s))
            down_until[d] = back
            if back < horizon:
                events.append(TraceEvent(back, d, "join"))
    desc = f"hourly rate={rate_per_hour:g}/h seed={seed}" + (
        f" mttr={mttr_s:g}s" if mttr_s is not None else "")
    return FailureTrace(devices, horizon, _sorted(events), desc)


def generate_trace(model: str, devices: int, rate_per_hour: float, hours: float, seed: int,
                   mttr_s: float | None = None) -> FailureTrace:
    if model == "poisson":
        return poisson_trace(devices, rate_per_hour, hours, seed, mttr_s)
    if model == "hourly":
        return hourly_trace(devices, rate_per_hour, hours, seed, mttr_s)
    raise TraceError(f"unknown trace model {model!r}; choose one of: {', '.join(TRACE_MODELS)}.")


def _sorted(events: list[TraceEvent]) -> tuple[TraceEvent, ...]:
    # A join and a later failure of the same device never tie in practice; order joins first
    # at equal times so that the alternation check holds.
    return tuple(sorted(events, key=lambda e: (e.time_s, e.kind == "slow", e.kind != "join",
                                               e.device)))


# --------------------------------------------------------------------------- cards and units


def cards_to_units(trace: FailureTrace, tp: int) -> FailureTrace:
    """The unit trace of a card trace: a unit fails when the first of its cards fails (it
    cannot run a sharded layer without every card) and rejoins when its last failed card is
    back. Other cards of an already failed unit change nothing. ``tp = 1``: the trace itself."""
    if tp == 1:
        return trace
    if trace.devices % tp:
        raise TraceError(
            f"the trace covers {trace.devices} cards, not a multiple of training.tp = {tp}; "
            "use a trace of the job's cluster.devices cards."
        )
    down = [0] * (trace.devices // tp)  # failed cards per unit
    events = []
    for e in trace.events:
        unit = unit_of(e.device, tp)
        before = down[unit]
        down[unit] += {"fail": 1, "join": -1}.get(e.kind, 0)
        if e.kind == "slow":   # a unit runs at its card's pace
            events.append(TraceEvent(e.time_s, unit, "slow", e.factor))
            continue
        if (before == 0) != (down[unit] == 0):  # the unit went down, or came back whole
            events.append(TraceEvent(e.time_s, unit, e.kind))
    where = f"{trace.description}; " if trace.description else ""
    # In the card trace's order, which is a valid order for the units too.
    return FailureTrace(trace.devices // tp, trace.horizon_s, tuple(events),
                        f"{where}units of tp={tp} cards")


def units_to_cards(trace: FailureTrace, tp: int) -> FailureTrace:
    """A unit trace written in cards, each unit event as its first card's: ``cards_to_units``
    of the result is ``trace`` again. ``tp = 1``: the trace itself."""
    if tp == 1:
        return trace
    events = tuple(TraceEvent(e.time_s, cards_of(e.device, tp)[0], e.kind, e.factor)
                   for e in trace.events)
    note = f"unit events as each unit's first card, tp={tp}"
    where = f"{trace.description}; " if trace.description else ""
    return FailureTrace(trace.devices * tp, trace.horizon_s, events, f"{where}{note}")


# --------------------------------------------------------------------------- CSV


def write_trace(trace: FailureTrace, path: str | Path | None = None) -> str:
    """CSV text of ``trace`` (also written to ``path`` when given)."""
    buf = io.StringIO()
    buf.write(f"# devices={trace.devices}\n# horizon_s={trace.horizon_s!r}\n")
    if trace.description:
        buf.write(f"# description={trace.description}\n")
    w = csv.writer(buf, lineterminator="\n")
    slow = any(e.kind == "slow" for e in trace.events)
    w.writerow(["time_s", "device", "event", *(["factor"] if slow else [])])
    for e in trace.events:
        w.writerow([repr(e.time_s), e.device, e.kind, *([repr(e.factor)] if slow else [])])
    text = buf.getvalue()
    if path is not None:
        Path(path).write_text(text)
    return text


def read_trace(path: str | Path, devices: int | None = None,
               horizon_s: float | None = None) -> FailureTrace:
    """Load a CSV trace. ``devices`` / ``horizon_s`` override the file's comment lines and are
    required when the file has none (e.g. a trace cut from a cluster log)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(
            f"cannot read trace file {str(path)!r} ({exc.strerror}); pass an existing CSV "
            "written by chameleon-sim or with columns time_s,device,event."
        ) from exc
    meta: dict[str, str] = {}
    rows: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            key, _, value = line[1:].strip().partition("=")
            meta[key.strip()] = value.strip()
        elif line.strip():
            rows.append(line)
    reader = csv.DictReader(rows)
    if reader.fieldnames is None or not {"time_s", "device", "event"} <= set(reader.fieldnames):
        raise TraceError(
            f"trace file {str(path)!r} needs a header row with columns time_s,device,event."
        )
    events = []
    for n, row in enumerate(reader, start=2):
        try:
            factor = (row.get("factor") or "").strip()
            events.append(TraceEvent(float(row["time_s"]), int(row["device"]),
                                     row["event"].strip(),  # type: ignore[arg-type]
                                     float(factor) if factor else 1.0))
        except (TypeError, ValueError) as exc:
            raise TraceError(
                f"trace file {str(path)!r} row {n} ({row}) is malformed: time_s must be a "
                "number, device an integer, event 'fail', 'join' or 'slow', and factor "
                "(slow events) a number."
            ) from exc
    try:
        n_dev = devices if devices is not None else int(meta["devices"])
        horizon = horizon_s if horizon_s is not None else float(meta["horizon_s"])
    except (KeyError, ValueError) as exc:
        raise TraceError(
            f"trace file {str(path)!r} does not say how many devices and how long it covers; "
            "add '# devices=N' and '# horizon_s=S' lines or pass the job and --hours."
        ) from exc
    return FailureTrace(n_dev, horizon, _sorted(events), meta.get("description", path.name))
