"""Plan generations abandoned before they committed a step, as one agent counts them.

Why: a failure that comes back in every generation (chameleon_elastic/retries.py) must end the
job with one sentence instead of recovering forever. The workers count the generations they
entered; the agent counts the generations it leaves after a failure, with what it can see of
them on its node's channel: a generation in which any local worker said how it resumed
(``resumed/<gen>/<card>``) committed a step, and ends the streak. The cause of a failure is
the failed workers' own reason, or, for a peer lost on another node, what the workers wrote on
the channel (the first one's words: a missed recovery deadline, a broken connection).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from chameleon_elastic import channel
from chameleon_elastic.retries import FailureStreak

from ..failures import Trigger, WorkerFailure
from ..reactions import Reaction, Tick

__all__ = ["AbandonedGenerations"]

# what abandons a generation (a node joining or a device coming back does not)
_FAILURES = frozenset(Trigger) - {Trigger.MEMBERSHIP, Trigger.REJOINED}


class AbandonedGenerations:
    """The agent's streak of failed generations, capped at ``cap`` (0: no cap). The cap is
    handed to the workers on ``store`` (the node's channel; None without a job), which count
    their own up to the same cap."""

    def __init__(self, cap: int, store: Any) -> None:
        self._streak = FailureStreak(cap)
        self._store = store
        self._counted = False      # the last reaction counted a generation as failed
        self._progressed = False   # and that generation had committed a step
        self._went_on: int | None = None   # a generation left and then kept (quiet)
        if store is not None:
            channel.write(store, channel.MAX_FAILED, cap)

    def past_cap(self, r: Reaction, tick: Tick, generation: int, cards: Iterable[int]) -> bool:
        """Reaction ``r`` to ``tick`` leaves ``generation``: True when that makes one failed
        generation past the cap. Only runtime workers can say a generation committed a step
        (registered ones, or ones that reported trouble before they could register), and a
        node joining or a device coming back abandons nothing."""
        peer_lost = r.trigger is Trigger.PEER_LOST
        self._counted = False
        if r.trigger not in _FAILURES or not (tick.runtime or peer_lost):
            return False
        return self.abandoned(generation, cards, tick.failures, peer_lost, r.trigger.value)

    def abandoned(self, generation: int, cards: Iterable[int],
                  failures: tuple[WorkerFailure, ...], peer_lost: bool, trigger: str) -> bool:
        """``generation`` is being left after ``failures`` (or a peer lost elsewhere); True
        when that is one failed generation past the cap."""
        if self._store is None:
            return False
        self._counted = True
        keys = [channel.resumed_key(generation, c) for c in cards]
        self._progressed = any(self._store.check([k]) for k in keys) or (
            generation == self._went_on)
        if self._progressed:
            self._streak.progressed()
        for key in keys:   # a relaunch with no device changed keeps the generation's number
            self._store.delete_key(key)
        return self._streak.failed(self.cause(generation, failures, peer_lost) or trigger)

    def kept(self, generation: int) -> None:
        """The generation just counted as left goes on after all (a quiet decision: only
        standbys were lost, and no worker was told): its failure is taken back, and the step
        it had committed still counts when it is left later (its records were cleared)."""
        if self._counted:
            self._streak.forget_last()
            self._went_on = generation if self._progressed else self._went_on
        self._counted = False

    def cause(self, generation: int, failures: tuple[WorkerFailure, ...],
              peer_lost: bool) -> str:
        """Why ``generation`` fails: the failed workers' reasons, else (a peer lost on
        another node) the workers' own words on the channel; empty when nothing says."""
        said = "; ".join(f"device {f.device}: {f.reason}" for f in failures)
        if not said and peer_lost and self._store is not None:
            said = channel.read(self._store, channel.cause_key(generation)) or ""
        return said

    def sentence(self) -> str:
        return f"giving up: {self._streak.sentence()}"
