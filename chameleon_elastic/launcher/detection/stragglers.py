"""The straggler watch: the speed of each local device, and when a change is worth a decision.

Each worker sends its :class:`~chameleon_elastic.channel.Pace` with its beats: steps trained
in the current generation and the seconds it spent computing (``busy_s``), waiting for peers
and data (``wait_s``) and summing gradients (``sync_s``). Nothing is added to a step: the
worker adds up times it takes anyway, its beat thread sends them.

A device's speed in a step is the plan's expected compute for its work
(``estimator.expected_compute``: its micro-batches times its layers' profiled times) over its
measured ``busy_s``. Waiting is not compute: a device that waits for a slow peer or a slow link
is not slow itself, so only the slow device is named. The speeds are divided by their median
(three devices or more measured) or by the fastest (fewer), so a profile that is off for every
device alike names none (capped at 1.0: faster than its peers is not news).

A change is worth a decision (a straggler event) when, for ``window`` steps in a row (the
generation's first step left out: it warms up), and then at the median of those steps:

- a device the plan takes at 1.0 runs below ``threshold`` (it becomes slow, at its measured
  speed);
- a device the plan takes as slow runs at ``recover`` or more (it is back at 1.0), or below
  ``threshold`` times its planned speed (it slowed further).

Between the two bounds nothing changes: that is the hysteresis that keeps plans from flapping.

A slowdown must also have lasted long enough to pay for a switch: the compute it has cost so far
(each step of the streak, its busy time times ``1 - speed``) at least ``PAYBACK`` times the job's
fixed switch cost (``cluster.switch_s``: a regroup in place, a restart otherwise). Expecting a
slowdown to last about as long again as it has lasted, switching then wins back at least what it
costs; a dip of a few steps on a shared machine, where every process is slow in turn, does not
spend a transition or a standby. Each event says why, in figures (:attr:`StragglerWatch.why`),
and the recovery line carries them: ``device 3 slow (0.50x for 6 steps, 0.6 s lost; a switch
~0.3 s)``.

A device left spare for being slow does no work, so nothing measures it. It is tried again
(planned at 1.0) once the job has trained ``PROBATION`` windows of steps without it; if it is
still slow it is found again within a window, and its next probation is twice as long.
The factors a plan was made for come back with every decision (``adopt``), so a plan chosen
for a failure, which is made at profiled speeds, lets the watch find a slow device again.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chameleon_elastic import channel
from chameleon_elastic.plan import ExecutionPlan
from chameleon_elastic.spec import JobSpec, StragglerSpec

__all__ = ["PAYBACK", "PROBATION", "Samples", "StragglerWatch", "speeds_of"]

#: windows of steps a device left spare for being slow waits before it is tried again
PROBATION = 4
#: a slowdown is planned around once the compute it cost is this many times a switch's cost
PAYBACK = 2.0
#: seconds between two reads of the paces: steps take longer, and a tick (every
#: ``--monitor-interval``) should not pay a store read per worker
READ_EVERY_S = 0.2


@dataclass
class Samples:
    """One device's paces in one generation, oldest first (cumulative, so any two give the
    mean between them)."""

    generation: int
    paces: list[channel.Pace] = field(default_factory=list)

    def busy_per_step(self, window: int) -> float | None:
        """Mean compute seconds per step over the last ``window`` steps (over more when a read
        missed a step), leaving out the generation's first step (it warms up); None until
        there are that many."""
        if not self.paces:
            return None
        now = self.paces[-1]
        then = next((p for p in reversed(self.paces)
                     if 1 <= p.steps <= now.steps - window), None)
        if then is None or now.busy_s <= then.busy_s:
            return None
        return (now.busy_s - then.busy_s) / (now.steps - then.steps)


def speeds_of(expected: Mapping[int, float], busy: Mapping[int, float]) -> dict[int, float]:
    """Speed per device measured (expected compute over measured compute), divided by the
    median when three or more are measured, else by the fastest (the profile alone is no
    reference: a rough one named every device of a two-device node slow), capped at 1.0."""
    raw = {d: expected[d] / b for d, b in busy.items() if b > 0 and expected.get(d, 0) > 0}
    if not raw:
        return {}
    reference = statistics.median(raw.values()) if len(raw) >= 3 else max(raw.values())
    return {d: min(1.0, r / reference) for d, r in raw.items()}


class StragglerWatch:
    """Reads the local workers' paces each tick; ``check`` returns the factors to plan with
    when a device's speed has changed enough for long enough (the module docstring)."""

    def __init__(self, settings: StragglerSpec) -> None:
        self.settings = settings
        self.planned: dict[int, float] = {}   # device -> factor the plan was made for (< 1)
        self.found: dict[int, float] | None = None   # factors of the last event, until adopted
        self._samples: dict[int, Samples] = {}
        #: device -> (speed, compute seconds) of each step seen past a bound
        self._streak: dict[int, list[tuple[float, float]]] = {}
        self.why: dict[int, str] = {}   # the last event's devices: the figures behind it
        self._seen: dict[int, int] = {}   # device -> steps when its last speed was counted
        self._probation: dict[int, int] = {}   # spared device -> windows it waits next time
        self._expected: tuple[int, dict[int, float]] | None = None   # (generation, per device)
        self._read_at = -math.inf

    def due(self) -> bool:
        """Whether a read is due (one every ``READ_EVERY_S``)."""
        now = time.monotonic()
        if now - self._read_at < READ_EVERY_S:
            return False
        self._read_at = now
        return True

    def adopt(self, speeds: Mapping[int, float]) -> None:
        """The factors the new plan was made for; measurements start afresh."""
        self.planned = {d: f for d, f in speeds.items() if f != 1.0}
        self.found = None
        self._samples.clear()
        self._streak.clear()
        self._seen.clear()

    def read(self, store: Any, devices: Mapping[int, int], generation: int) -> None:
        """One pace per local device (``devices``: card -> plan device) of ``generation``."""
        for card, device in devices.items():
            pace = channel.read(store, channel.pace_key(card))
            if pace is None:
                continue
            pace = channel.Pace.from_dict(pace)
            if pace.generation != generation:
                continue
            samples = self._samples.get(device)
            if samples is None or samples.generation != generation:
                samples = self._samples[device] = Samples(generation)
            if not samples.paces or samples.paces[-1].steps < pace.steps:
                samples.paces.append(pace)
                del samples.paces[:-4 * self.settings.window - 4]

    def check(self, spec: JobSpec, plan: ExecutionPlan) -> dict[int, float] | None:
        """The factors of this node's devices to plan with now, or None (nothing to decide).
        ``spec`` is the planner's (units), ``plan`` the one running."""
        from chameleon_elastic.planning.estimator import expected_compute

        window = self.settings.window
        busy = {d: b for d, s in self._samples.items() if s.generation == plan.generation
                and (b := s.busy_per_step(1)) is not None}
        if self._expected is None or self._expected[0] != plan.generation:
            self._expected = (plan.generation, expected_compute(spec, plan))
        speeds = speeds_of(self._expected[1], busy)
        changed = False
        for device, speed in speeds.items():
            steps = self._samples[device].paces[-1].steps
            if self._seen.get(device) == steps:
                continue   # no new step since the last look
            self._seen[device] = steps
            if self._crossed(device, speed):
                self._streak.setdefault(device, []).append((speed, busy[device]))
            else:
                self._streak.pop(device, None)
            changed |= self._ripe(device, spec.cluster.switch_s)
        trial = self._trial(plan)
        if not changed and not trial:
            return None
        out = {d: f for d, f in self.planned.items() if d not in trial}
        self.why = {}
        for device, seen in self._streak.items():
            if self._ripe(device, spec.cluster.switch_s):
                speed = round(statistics.median(s for s, _ in seen[-window:]), 2)
                if speed >= self.settings.recover:
                    out.pop(device, None)
                else:
                    out[device] = speed
                self.why[device] = self._figures(device, speed, spec.cluster.switch_s)
        self.found = out
        return out

    def _lost_s(self, device: int) -> float:
        """Compute seconds the streak of ``device`` has cost against full speed."""
        return sum(b * (1 - min(s, 1.0)) for s, b in self._streak.get(device, ()))

    def _ripe(self, device: int, switch_s: float) -> bool:
        """A streak long enough to decide on: ``window`` steps, and a slowdown from full speed
        that has cost ``PAYBACK`` switches (the module docstring)."""
        seen = self._streak.get(device, ())
        if len(seen) < self.settings.window:
            return False
        slowing = self.planned.get(device, 1.0) == 1.0
        return not slowing or self._lost_s(device) >= PAYBACK * switch_s

    def _figures(self, device: int, speed: float, switch_s: float) -> str:
        """``0.50x for 6 steps, 0.6 s lost; a switch ~0.3 s`` (a slowdown), ``0.95x for 5
        steps`` (back at speed, or slower still)."""
        steps = len(self._streak[device])
        if self.planned.get(device, 1.0) != 1.0:
            return f"{speed:.2f}x for {steps} steps"
        return (f"{speed:.2f}x for {steps} steps, {self._lost_s(device):.1f} s lost; a switch "
                f"~{switch_s:.1f} s")

    def _trial(self, plan: ExecutionPlan) -> set[int]:
        """Spared slow devices whose probation is over: the job trained that many steps in
        this generation (as far as this node's workers say)."""
        spared = [d for d in self.planned if d not in plan.working_devices]
        steps = max((s.paces[-1].steps for s in self._samples.values()
                     if s.generation == plan.generation and s.paces), default=0)
        out = set()
        for d in spared:
            windows = self._probation.setdefault(d, PROBATION)
            if steps >= windows * self.settings.window:
                self._probation[d] = 2 * windows
                out.add(d)
        return out

    def report(self, devices: set[int]) -> dict[int, float]:
        """The factors of ``devices`` (this node's) that the next plan should be made for."""
        speeds = self.found if self.found is not None else self.planned
        return {d: f for d, f in speeds.items() if d in devices}

    def _crossed(self, device: int, speed: float) -> bool:
        """Past a bound: below the threshold (of its planned factor), or recovered."""
        planned = self.planned.get(device, 1.0)
        if planned == 1.0:
            return speed < self.settings.threshold
        return speed >= self.settings.recover or speed < self.settings.threshold * planned
