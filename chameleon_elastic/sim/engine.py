"""Event loop: replay one failure trace against one policy model and record what it produced.

Protocol between the loop and a policy:

1. ``policy.start()`` returns the fault-free schedule: a sequence of :class:`Phase` values
   (a pause, then running at some step time, ...), the last one usually open-ended.
2. At every group of simultaneous trace events the loop first executes the schedule up to that
   instant, then calls ``policy.react(ctx, failed, joined)``. The policy answers with a
   :class:`Reaction`: the samples its failure model throws away (the in-flight step, or all the
   work since the last checkpoint) and a new schedule starting now. The rest of the old schedule
   is dropped: a failure during a transition starts a new transition.
3. After the last event the schedule runs to the horizon.

Slow devices (``slow`` events in the trace, a group of their own): a policy with a
``slow(ctx, speeds)`` method decides about them itself (``speeds``: every slowed live device's
factor); any other policy does nothing about them and runs at the pace of the slowest slowed
device, every running phase's step stretched by ``1 / min(factor)`` while it lasts (pessimistic
when that device is a spare; a device that fails leaves the map, and comes back at speed).

Throughput is fluid inside a running phase (samples accrue at ``samples_per_step /
step_time_s``); discreteness comes back through the loss at a failure, where the partial step
in flight is what :attr:`EventContext.inflight_samples` reports. The loop never looks inside a
plan: every number comes from the policy, and every policy takes its step times from the
planning estimator, so all of them are timed by one model.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from .traces import FailureTrace

__all__ = [
    "EventContext",
    "EventRecord",
    "Phase",
    "PolicyModel",
    "PolicyRun",
    "Reaction",
    "Segment",
    "Timeline",
    "simulate",
]


@dataclass(frozen=True)
class Phase:
    """A stretch of constant behaviour. ``step_time_s`` None means paused (transition,
    restart, or no feasible layout); ``duration_s`` may be ``math.inf``."""

    duration_s: float
    step_time_s: float | None
    samples_per_step: float
    working_devices: int
    label: str

    @property
    def rate(self) -> float:
        return 0.0 if self.step_time_s is None else self.samples_per_step / self.step_time_s


@dataclass(frozen=True)
class Reaction:
    phases: tuple[Phase, ...]
    lost_samples: float
    kind: str  # what the policy did, e.g. "reroute", "replan", "restart", "ignore"


@dataclass(frozen=True)
class Segment:
    start_s: float
    end_s: float
    rate: float
    working_devices: int
    label: str


@dataclass
class Timeline:
    """Executed segments and losses; answers "how many samples between t0 and t1"."""

    segments: list[Segment] = field(default_factory=list)
    losses: list[tuple[float, float]] = field(default_factory=list)  # (time, samples)
    _cum: list[float] = field(default_factory=list)  # samples produced before segment i
    _starts: list[float] = field(default_factory=list)

    def add(self, seg: Segment) -> None:
        if seg.end_s <= seg.start_s:
            return
        prev = 0.0
        if self.segments:
            last = self.segments[-1]
            prev = self._cum[-1] + last.rate * (last.end_s - last.start_s)
        self.segments.append(seg)
        self._cum.append(prev)
        self._starts.append(seg.start_s)

    def lose(self, time_s: float, samples: float) -> None:
        if samples > 0:
            self.losses.append((time_s, samples))

    def produced_until(self, t: float) -> float:
        """Gross samples produced in [0, t), losses not subtracted."""
        if not self.segments:
            return 0.0
        i = bisect.bisect_right(self._starts, t) - 1
        if i < 0:
            return 0.0
        seg = self.segments[i]
        return self._cum[i] + seg.rate * (min(t, seg.end_s) - seg.start_s)

    def net_between(self, t0: float, t1: float) -> float:
        lost = sum(s for t, s in self.losses if t0 <= t < t1)
        return self.produced_until(t1) - self.produced_until(t0) - lost

    @property
    def lost_samples(self) -> float:
        return sum(s for _, s in self.losses)

    @property
    def paused_s(self) -> float:
        return sum(s.end_s - s.start_s for s in self.segments if s.rate == 0.0)

    def binned(self, bins: int, horizon_s: float) -> tuple[list[float], list[float], list[float]]:
        """(bin centres, mean gross rate, mean working devices) over equal bins."""
        width = horizon_s / bins
        centres = [(i + 0.5) * width for i in range(bins)]
        rate = [0.0] * bins
        devices = [0.0] * bins
        for seg in self.segments:
            first = int(seg.start_s // width)
            last = min(bins - 1, int(seg.end_s // width))
            for b in range(first, last + 1):
                lo, hi = max(seg.start_s, b * width), min(seg.end_s, (b + 1) * width)
                if hi > lo:
                    rate[b] += seg.rate * (hi - lo) / width
                    devices[b] += seg.working_devices * (hi - lo) / width
        return centres, rate, devices


@dataclass(frozen=True)
class EventContext:
    now_s: float
    timeline: Timeline
    current: Phase
    inflight_samples: float  # work of the step in flight, lost unless the policy says otherwise
    remaining: tuple[Phase, ...]  # the rest of the current schedule from now: "carry on"

    def net_since(self, t0: float) -> float:
        return self.timeline.net_between(t0, self.now_s)


class PolicyModel(Protocol):
    name: str

    def start(self) -> tuple[Phase, ...]: ...

    def react(self, ctx: EventContext, failed: Sequence[int],
              joined: Sequence[int]) -> Reaction: ...


@dataclass(frozen=True)
class EventRecord:
    """What a policy did at one event group (not the planner's Decision)."""

    time_s: float
    failed: tuple[int, ...]
    joined: tuple[int, ...]
    kind: str
    lost_samples: float
    pause_s: float  # the paused phases the reaction scheduled (may be cut by the next event)
    latency_s: float  # wall time the policy took to decide, in this process


@dataclass(frozen=True)
class PolicyRun:
    policy: str
    trace: FailureTrace
    timeline: Timeline
    decisions: tuple[EventRecord, ...]

    @property
    def horizon_s(self) -> float:
        return self.trace.horizon_s

    @property
    def net_samples(self) -> float:
        return self.timeline.net_between(0.0, self.horizon_s)

    @property
    def avg_throughput(self) -> float:
        return self.net_samples / self.horizon_s


def _execute(timeline: Timeline, phases: Sequence[Phase], start_s: float,
             until_s: float) -> tuple[Phase, float, tuple[Phase, ...]]:
    """Run ``phases`` from ``start_s`` up to ``until_s``; return the phase active at
    ``until_s``, when it began, and the schedule left from ``until_s`` on."""
    t = start_s
    for i, phase in enumerate(phases):
        end = t + phase.duration_s
        timeline.add(Segment(t, min(end, until_s), phase.rate, phase.working_devices, phase.label))
        if end > until_s:
            rest = (replace(phase, duration_s=end - until_s),) + tuple(phases[i + 1:])
            return phase, t, rest
        t = end
    idle = Phase(math.inf, None, 0.0, 0, "idle")
    timeline.add(Segment(t, until_s, 0.0, 0, "idle"))
    return idle, t, (idle,)


def _repaced(phases: Sequence[Phase], ratio: float) -> tuple[Phase, ...]:
    """Running phases with their step stretched by ``ratio`` (slow devices, a policy that does
    nothing about them)."""
    if ratio == 1.0:
        return tuple(phases)
    return tuple(p if p.step_time_s is None else replace(p, step_time_s=p.step_time_s * ratio)
                 for p in phases)


def _pace(speeds: dict[int, float]) -> float:
    return 1.0 / min(speeds.values(), default=1.0)


def _react(policy: PolicyModel, ctx: EventContext, group, speeds: dict[int, float]
           ) -> Reaction:
    """The policy's reaction to one group; ``speeds`` (slowed devices) is updated in place."""
    if group.slowed:
        speeds.update(group.slowed)
        for d in [d for d, f in speeds.items() if f == 1.0]:
            del speeds[d]
        deciding = getattr(policy, "slow", None)
        if deciding is not None:
            return deciding(ctx, dict(speeds))
        return Reaction(ctx.remaining, 0.0, "slowed")
    for d in group.failed:
        speeds.pop(d, None)
    return policy.react(ctx, group.failed, group.joined)


def simulate(policy: PolicyModel, trace: FailureTrace) -> PolicyRun:
    timeline = Timeline()
    decisions: list[EventRecord] = []
    phases = policy.start()
    sched_start = 0.0
    speeds: dict[int, float] = {}
    # A policy that decides about slow devices times them itself; any other sees its own
    # schedule, which runs stretched to the slowest slowed device's pace.
    stretch = 1.0
    for group in trace.groups():
        current, began, rest = _execute(timeline, _repaced(phases, stretch), sched_start,
                                        group.time_s)
        rest = _repaced(rest, 1.0 / stretch)
        inflight = 0.0
        if current.step_time_s is not None:
            done = (group.time_s - began) / current.step_time_s
            inflight = (done - math.floor(done)) * current.samples_per_step
        ctx = EventContext(group.time_s, timeline, current, inflight, rest)
        tic = time.perf_counter()
        reaction = _react(policy, ctx, group, speeds)
        latency = time.perf_counter() - tic
        if getattr(policy, "slow", None) is None:
            stretch = _pace(speeds)
        timeline.lose(group.time_s, reaction.lost_samples)
        pause = 0.0
        for p in reaction.phases:
            if p.step_time_s is not None:
                break
            pause += p.duration_s
        decisions.append(EventRecord(group.time_s, group.failed, group.joined, reaction.kind,
                                  reaction.lost_samples, pause, latency))
        phases, sched_start = reaction.phases, group.time_s
    _execute(timeline, _repaced(phases, stretch), sched_start, trace.horizon_s)
    return PolicyRun(policy.name, trace, timeline, tuple(decisions))
