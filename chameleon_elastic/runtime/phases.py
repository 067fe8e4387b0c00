"""Entering a phase of a training step: progress for the agent, then the test hook.

Every phase of a step (``forward``, ``backward``, ``sync``, ``vote``, ``apply``, ``applied``,
``enter`` as a plan is entered, and ``evaluate`` as an evaluation starts) passes through one :class:`Phases` object, which the trainer
hands down to the executor. Why one object: the executor and the step only need "a phase
begins", not the trainer; so nothing below the trainer calls back into it. A phase is progress
for the agent's hang detection (``beat``: the channel's counter, set once the worker trains in
``trainer.run``), then the fault-injection hook of tests (``on_phase(step, phase)``).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["PhaseHook", "Phases"]

PhaseHook = Callable[[int, str], None]


class Phases:
    """``beat``: progress for the agent (None until the worker trains in ``run``); ``hook``:
    the fault-injection hook, called with (step, phase)."""

    def __init__(self, hook: PhaseHook | None = None) -> None:
        self.hook = hook
        self.beat: Callable[[], None] | None = None

    def __call__(self, step: int, phase: str) -> None:
        if self.beat is not None:
            self.beat()
        if self.hook is not None:
            self.hook(step, phase)
