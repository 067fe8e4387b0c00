"""Hang timeouts that set themselves: from each worker's measured phase times.

A fixed hang timeout must be long enough for the slowest legitimate pause of any job, so it is
far too long for most (60 s while a step takes 0.1 s), and users had to tune it. As NVIDIA's
launcher does, the timeout is instead derived from what is measured: each runtime worker times
the gaps between its phases (forward, backward, sync, vote, apply, applied: the beats of
runtime/phases.py), and its agent convicts it only after ``FACTOR`` x the ``QUANTILE`` of its
recent gaps without progress, within ``[FLOOR_S, ceiling]``. The ceiling is the fixed default
(``Timeouts.hang_s``: 60 s, or half the collective timeout).

Expected-slow phases are not measured and not convicted on the measured figure: entering a plan
(the first step of every generation: lazy set-up, transfers), a checkpoint and an evaluation
each start a *slow stretch* that lasts until the end of the next committed step; meanwhile the
worker says so on its channel and the ceiling applies. Before ``MIN_GAPS`` gaps are measured the
ceiling applies too. ``--hang-timeout S`` (or ``CHAMELEON_HANG_TIMEOUT_S``) fixes the timeout
instead; 0 turns detection off.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["FACTOR", "FLOOR_S", "MIN_GAPS", "QUANTILE", "SLOW_PHASES", "GapWindow",
           "derive_hang_s", "describe"]

QUANTILE = 0.99
FACTOR = 5.0
#: no auto timeout below this: scheduling hiccups of a loaded host, the beat's own delivery
#: (every 0.1 s) and the agent's polling all fit well inside it
FLOOR_S = 5.0
MIN_GAPS = 20
WINDOW = 256
#: phases that begin a stretch expected to be slow (until the next ``applied``)
SLOW_PHASES = frozenset({"enter", "evaluate", "checkpoint"})


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
        ordered = sorted(self._gaps)
        return ordered[min(len(ordered) - 1, math.ceil(QUANTILE * len(ordered)) - 1)]


def derive_hang_s(typical_gap_s: float | None, ceiling_s: float, slow: bool = False) -> float:
    """The hang timeout in force for one worker: ``FACTOR`` x its typical gap, clamped to
    ``[FLOOR_S, ceiling_s]``; the ceiling while it is in a slow stretch or not yet measured."""
    if slow or typical_gap_s is None:
        return ceiling_s
    return min(ceiling_s, max(FLOOR_S, FACTOR * typical_gap_s))


def describe(hang_s: float, auto: bool) -> str:
    """``5 s (auto)``, ``3 s``, ``off``: the timeout in force, for the status line."""
    if not hang_s:
        return "off"
    return f"{hang_s:.3g} s" + (" (auto)" if auto else "")
