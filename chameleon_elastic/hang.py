"""Hang timeouts that set themselves: from each worker's measured phase times.

A fixed hang timeout must be long enough for the slowest legitimate pause of any job, so it is
far too long for most (60 s while a step takes 0.1 s), and users had to tune it. As NVIDIA's
launcher does, the timeout is instead derived from what is measured: each runtime worker times
the gaps between its phases (forward, backward, sync, vote, apply, applied: the beats of
runtime/execution/phases.py), and its agent convicts it only after ``FACTOR`` x the ``QUANTILE`` of its
recent gaps without progress, within ``[FLOOR_S, ceiling]``. The ceiling is the fixed default
(``Timeouts.hang_s``: 60 s, or half the collective timeout).

Expected-slow phases are not measured and not convicted on the measured figure: regrouping and
entering a plan (up to the end of the first step of every generation: lazy set-up, transfers), a
checkpoint and an evaluation each start a *slow stretch* that lasts until the end of the next
committed step; meanwhile the worker says so on its channel, with the stretch's own allowance
when it can be derived: a survivor's recovery (:func:`recovery_deadlines`: each phase after the
decision is given ``FACTOR`` x what this process measured for it, the transfer by its bytes over
the measured bandwidth). Only a stretch that nothing measures (a fresh process's first plan, a
checkpoint, an evaluation) is held to the ceiling: a worker frozen while the others recover is
cut out in seconds, not at the 60 s ceiling. Before ``MIN_GAPS`` gaps are measured the ceiling
applies too. ``--hang-timeout S`` (or ``CHAMELEON_HANG_TIMEOUT_S``) fixes the timeout instead;
0 turns detection off.

The same deadlines bound the recovery from the worker's side (runtime/recovery/deadlines.py): a phase
that runs past ``WORKER_MARGIN`` x its deadline ends its generation, so a stall that no process
causes by freezing (every one of them asleep, waiting) never waits for a collective or store
timeout. The margin lets a frozen peer be cut out by its agent first. And since a healthy
worker either finishes its phase or gives it up by then, one asleep without progress well past
that time (:func:`asleep_past_deadline`: in a deadlock of its own, not waiting for a peer) is
convicted too: no recovery phase can keep a job waiting for longer.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["FACTOR", "FLOOR_S", "MIN_GAPS", "PRIOR_BANDWIDTH", "QUANTILE", "RECOVERY_PHASES",
           "REGROUP_PRIOR_PER_RANK_S",
           "SLOW_PHASES", "WORKER_MARGIN", "GapWindow", "PhaseDeadline", "RecoveryDeadlines",
           "asleep_past_deadline", "derive_hang_s", "describe", "quantile",
           "recovery_deadlines"]

QUANTILE = 0.99
FACTOR = 5.0
#: no auto timeout below this: scheduling hiccups of a loaded host, the beat's own delivery
#: (every 0.1 s) and the agent's polling all fit well inside it
FLOOR_S = 5.0
MIN_GAPS = 20
WINDOW = 256
#: phases that begin a stretch expected to be slow (until the next ``applied``)
SLOW_PHASES = frozenset({"regroup", "enter", "evaluate", "checkpoint"})
#: the phases of a recovery after the decision, each with a deadline of its own
RECOVERY_PHASES = ("regroup", "enter", "first step")
#: bytes per second a transfer is assumed to reach before one was measured: a slow link
#: (1 Gbit/s), so that the first transfer's deadline errs on the long side
PRIOR_BANDWIDTH = 125e6
#: seconds of regroup per rank of the world before one was measured: a full mesh on one store
#: costs O(ranks) per rank (docs/rendezvous.md: about 38 s at 1k gloo ranks); a job's first
#: join is no measure (it waits for every process to start)
REGROUP_PRIOR_PER_RANK_S = 0.04
#: a worker gives a phase up at this multiple of its deadline (its agent convicts a frozen
#: peer at 1x: the survivors must not give the generation up first)
WORKER_MARGIN = 2.0


class GapWindow:
    """The most recent gaps between a worker's phases (seconds), outside slow stretches."""

    def __init__(self, size: int = WINDOW) -> None:
        self._gaps: deque[float] = deque(maxlen=size)

    def add(self, gap_s: float) -> None:
        self._gaps.append(gap_s)

    def __len__(self) -> int:
        return len(self._gaps)

    def typical(self) -> float | None:
        """The ``QUANTILE`` of the window; None until ``MIN_GAPS`` gaps were measured."""
        if len(self._gaps) < MIN_GAPS:
            return None
        return quantile(self._gaps)


def quantile(values: Iterable[float], q: float = QUANTILE) -> float | None:
    """The ``q`` quantile of ``values`` (the largest of fewer than 1 / (1 - q)); None if empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True)
class PhaseDeadline:
    """What a worker in a recovery phase announces on its channel: ``deadline_s``, which its
    agent convicts it on when it is awake without progress (frozen, spinning), and
    ``give_up_s``, when it gives the phase up itself (which is progress). A worker asleep
    without progress past ``give_up_s`` (+ ``FLOOR_S``) did neither: it is hung too, asleep in
    something that is not a wait for a peer."""

    deadline_s: float
    give_up_s: float
    phase: str = ""   # regroup, enter, first step
    why: str = ""     # where the figure comes from, for the status line (RecoveryDeadlines)

    @classmethod
    def from_json(cls, value: object) -> PhaseDeadline | bool:
        """The channel's value: a deadline, or True (a stretch nothing measures)."""
        if isinstance(value, dict):
            return cls(float(value["deadline_s"]), float(value["give_up_s"]),
                       str(value.get("phase", "")), str(value.get("why", "")))
        return True

    def said(self) -> str:
        """``regroup deadline 25 s (a process starts for it: 5 x its 4.0 s start-up)``: the
        figure with its phase and its reason, for the status line: a deadline of seconds
        beside steps of a tenth of one must say why it is that long."""
        text = f"{self.phase or 'recovery phase'} deadline {self.deadline_s:.3g} s"
        return f"{text} ({self.why})" if self.why else text


def derive_hang_s(typical_gap_s: float | None, ceiling_s: float,
                  slow: bool | PhaseDeadline = False) -> float:
    """The hang timeout in force for one worker: ``FACTOR`` x its typical gap, clamped to
    ``[FLOOR_S, ceiling_s]``; the ceiling while it is not yet measured. ``slow``: False outside
    a slow stretch; True in one that nothing measured (the ceiling); a :class:`PhaseDeadline`
    in a recovery's phase: its deadline, never below ``FLOOR_S``."""
    if slow is True:
        return ceiling_s
    if isinstance(slow, PhaseDeadline):
        return max(FLOOR_S, slow.deadline_s)
    if typical_gap_s is None:
        return ceiling_s
    return min(ceiling_s, max(FLOOR_S, FACTOR * typical_gap_s))


def asleep_past_deadline(idle_s: float, slow: bool | PhaseDeadline) -> bool:
    """Whether a worker asleep without progress for ``idle_s`` is hung all the same: past the
    time its recovery phase gives itself up (+ ``FLOOR_S`` for the news to arrive)."""
    return isinstance(slow, PhaseDeadline) and idle_s >= slow.give_up_s + FLOOR_S


@dataclass(frozen=True)
class RecoveryDeadlines:
    """Seconds each phase of a recovery after the decision may last: ``regroup`` (joining the
    new generation's process group), ``enter`` (agreeing on the resume step, moving layers from
    peers, forming the plan's groups) and ``first step`` (the first step committed under the
    plan)."""

    regroup_s: float
    enter_s: float
    first_step_s: float
    #: where each figure comes from, in the same order (``5 x the 0.9 s measured``)
    why: tuple[str, str, str] = ("", "", "")

    def of(self, phase: str) -> float:
        return {"regroup": self.regroup_s, "enter": self.enter_s,
                "first step": self.first_step_s}[phase]

    def why_of(self, phase: str) -> str:
        return self.why[RECOVERY_PHASES.index(phase)]


def recovery_deadlines(regroups_s: Iterable[float], entries_s: Iterable[float],
                       steps_s: Iterable[float], transfer_bytes: float,
                       bandwidth: float | None, world_size: int,
                       start_s: float = 0.0) -> RecoveryDeadlines:
    """Each phase's deadline: ``FACTOR`` x the ``QUANTILE`` of what this process measured for it
    (its regroups, ``REGROUP_PRIOR_PER_RANK_S`` x ``world_size`` before the first; its plan
    entries less their transfers; its committed steps), at least ``FLOOR_S``; the transfer adds
    ``FACTOR`` x its bytes over the measured bandwidth (``PRIOR_BANDWIDTH`` before one was
    measured). ``start_s``: when processes start for the generation (a crashed worker
    restarted), this process's own start-up as measured (imports, the script, the model; not
    its waits for others, runtime/world/join.py):
    the regroup waits for theirs, ``FACTOR`` x that longer. No ceiling: every figure is
    measured, and a large transfer legitimately takes long. Each figure comes with its
    reason, the largest term's (:attr:`RecoveryDeadlines.why`)."""

    def bound(measured: Iterable[float], prior_s: float = 0.0, extra_s: float = 0.0,
              extra_why: str = "") -> tuple[float, str]:
        p = quantile(measured)
        base = FACTOR * (prior_s if p is None else p)
        if extra_s > max(FLOOR_S, base):
            why = extra_why
        elif base <= FLOOR_S:
            why = f"at least {FLOOR_S:g} s for any phase"
        elif p is None:
            why = f"{FACTOR:g} x {prior_s:.2g} s guessed for {world_size} ranks"
        else:
            why = f"{FACTOR:g} x the {p:.2g} s measured"
        return max(FLOOR_S, base) + extra_s, why

    rate = bandwidth or PRIOR_BANDWIDTH
    moving_s = transfer_bytes / rate
    regroup = bound(regroups_s, REGROUP_PRIOR_PER_RANK_S * world_size, FACTOR * start_s,
                    f"a process starts for it: {FACTOR:g} x {start_s:.2g} s, this worker's own "
                    "start-up")
    enter = bound(entries_s, extra_s=FACTOR * moving_s,
                  extra_why=f"{FACTOR:g} x {transfer_bytes / 1e6:.3g} MB at "
                            f"{rate / 1e6:.3g} MB/s{'' if bandwidth else ' (not measured yet)'}")
    first = bound(steps_s)
    return RecoveryDeadlines(regroup[0], enter[0], first[0], (regroup[1], enter[1], first[1]))


def describe(hang_s: float, auto: bool, why: str = "") -> str:
    """``5 s (auto)``, ``60 s (auto: not measured yet)``, ``3 s``, ``off``: the timeout in
    force, for the status line; ``why``: what makes an auto timeout far from the step time."""
    if not hang_s:
        return "off"
    return f"{hang_s:.3g} s" + (f" (auto: {why})" if auto and why else " (auto)" if auto else "")
