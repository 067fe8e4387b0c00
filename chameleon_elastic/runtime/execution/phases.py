"""Entering a phase of a training step: progress for the agent, then the test hook.

Every phase of a step (``forward``, ``backward``, ``sync``, ``vote``, ``apply``, ``applied``,
``enter`` as a plan is entered, ``evaluate`` as an evaluation starts and ``checkpoint`` as a
checkpoint starts) passes through one :class:`Phases` object, which the trainer hands down to
the executor. Why one object: the executor and the step only need "a phase begins", not the
trainer; so nothing below the trainer calls back into it. A phase is progress for the agent's
hang detection (``beat``: the channel's counter, set once the worker trains in
``trainer.run``), then the fault-injection hook of tests (``on_phase(step, phase)``).

The same object times the gaps between phases, from which the agent derives this worker's hang
timeout (chameleon_elastic/hang.py): ``enter``, ``evaluate`` and ``checkpoint`` begin a stretch
expected to be slow, which is not measured, and which the worker announces on its channel
until the end of the next committed step. Timing a phase costs a clock read and a list append.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from chameleon_elastic.hang import SLOW_PHASES, GapWindow, PhaseDeadline

__all__ = ["PhaseHook", "Phases"]

PhaseHook = Callable[[int, str], None]


class Phases:
    """``beat``: progress for the agent (None until the worker trains in ``run``); ``hook``:
    the fault-injection hook, called with (step, phase)."""

    def __init__(self, hook: PhaseHook | None = None) -> None:
        self.hook = hook
        self.beat: Callable[[], None] | None = None
        self.gaps = GapWindow()
        self._say_slow: Callable[[bool | PhaseDeadline], None] | None = None
        self._slow = False
        self._allowance: PhaseDeadline | None = None   # the stretch's own deadline, if derived
        self._last: float | None = None

    def report_to(self, link: Any) -> None:
        """Beat on ``link`` (a WorkerLink), and tell it the measured gaps and slow stretches."""
        self.beat = link.beat
        self._say_slow = link.slow
        link.gaps(self.gaps.typical)
        if self._slow:
            link.slow(self._said())

    def __call__(self, step: int, phase: str) -> None:
        now = time.perf_counter()
        if self._last is not None and not self._slow and phase not in SLOW_PHASES:
            self.gaps.add(now - self._last)
        self._last = now
        if phase in SLOW_PHASES and not self._slow:
            self._slow_stretch(True)
        elif phase == "applied" and self._slow:
            self._slow_stretch(False)
        if self.beat is not None:
            self.beat()
        if self.hook is not None:
            self.hook(step, phase)

    def allow(self, deadline: PhaseDeadline | None) -> None:
        """The current slow stretch's deadline, derived from measurements (a recovery's phase:
        runtime/recovery/deadlines.py); None: held to the ceiling. Said at once while in a stretch;
        forgotten when the stretch ends."""
        self._allowance = deadline
        if self._slow and self._say_slow is not None:
            self._say_slow(self._said())

    def _said(self) -> bool | PhaseDeadline:
        return True if self._allowance is None else self._allowance

    def _slow_stretch(self, on: bool) -> None:
        self._slow = on
        if not on:
            self._allowance = None
        if self._say_slow is not None:
            self._say_slow(self._said() if on else False)
