"""Deadlines for a recovery's phases, worker side: measured, announced, enforced.

Why: every wait of a recovery used to be bounded only by a collective or store timeout (120 s
and 60 s), so a recovery whose phases each take milliseconds could still wait minutes: for a
peer frozen while it entered the plan (its agent held it to the hang ceiling), or for a
connection that never completed. Now each phase after the decision has a deadline derived from
what this process measured (chameleon_elastic/hang.py, :func:`~chameleon_elastic.hang.
recovery_deadlines`), and

- the worker announces the deadline of the phase it is in on its channel (its agent convicts
  it, frozen or spinning, once it goes that long without progress, and shows the deadline on
  the status line);
- the worker enforces ``WORKER_MARGIN`` x the deadline on itself, counting the phase before
  it, which its peers may still be in: past it, :class:`RecoveryClock` shuts the generation's
  sockets down from a timer thread, the blocked call fails at once as if a peer had died, and
  the recovery chain gives the generation up with the missed phase as its cause (it counts
  against ``--max-failed-generations``; the agents form the next generation).

The margin orders the two: a frozen peer is cut out by its agent at 1x, before the survivors
waiting for it give up at 2x; a stall that no frozen process explains (every process asleep,
waiting) ends at 2x instead of a timeout.

Phases, in order: ``regroup`` (joining the generation's process group), ``enter`` (agree,
transfer, rebuild), ``first step`` (until the first step under the plan commits).
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
from collections.abc import Callable

from chameleon_elastic.hang import (
    RECOVERY_PHASES,
    WORKER_MARGIN,
    PhaseDeadline,
    RecoveryDeadlines,
    recovery_deadlines,
)
from chameleon_elastic.plan import ExecutionPlan

from ..world.abort import Sockets, open_sockets

__all__ = ["RecoveryClock", "transfer_bytes"]

log = logging.getLogger("chameleon_elastic.runtime.recovery.deadlines")

#: how many measurements of each kind are kept (recoveries are rare; steps are not)
_KEPT = 64


def transfer_bytes(plan: ExecutionPlan, device: int) -> float:
    """Bytes ``device`` sends or receives when entering ``plan``."""
    return sum(t.bytes for t in plan.transfers if device in (t.src, t.dst))


class RecoveryClock:
    """Measures this process's regroups, plan entries and steps; times a recovery's phases.

    ``unblock(sockets)``: makes calls blocked on ``sockets`` fail (the device plugin's);
    ``sockets()``: the generation's sockets known now (its groups'); ``announce(deadline)``:
    tells the agent the deadline of the phase begun (None: no phase is timed)."""

    def __init__(self, unblock: Callable[[Sockets], None], sockets: Callable[[], Sockets],
                 announce: Callable[[PhaseDeadline | None], None],
                 spare_port: int | None = None) -> None:
        self._unblock = unblock
        self._sockets = sockets
        self._announce = announce
        self._spare_port = spare_port   # the agent channel's: never cut
        self._regroups: collections.deque[float] = collections.deque(maxlen=_KEPT)
        self._entries: collections.deque[float] = collections.deque(maxlen=_KEPT)
        self._steps: collections.deque[float] = collections.deque(maxlen=_KEPT)
        self._bandwidth: float | None = None
        self._start_s = 0.0   # this process's start-up: imports, its first world
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._before: Sockets = frozenset()       # open as the current phase began
        self._recovering: Sockets = frozenset()   # open as the current recovery began
        self.deadlines: RecoveryDeadlines | None = None
        self.phase: str | None = None
        #: (phase, seconds) of the phase given up at its deadline, until the next recovery
        self.missed: tuple[str, float] | None = None

    # ------------------------------------------------------------------ measurements

    def regrouped(self, seconds: float) -> None:
        self._regroups.append(seconds)

    def entered(self, seconds: float, moved_bytes: float, transfer_s: float) -> None:
        """A plan entered in ``seconds``, ``transfer_s`` of them moving ``moved_bytes``."""
        self._entries.append(max(0.0, seconds - transfer_s))
        if moved_bytes >= 1e6 and transfer_s > 0:   # large enough to say something
            self._bandwidth = moved_bytes / transfer_s

    def stepped(self, seconds: float) -> None:
        self._steps.append(seconds)

    def started_up(self, seconds: float) -> None:
        """This process took ``seconds`` from its creation to its first plan: what a process
        started for a later generation (a restarted peer's) takes too, about."""
        self._start_s = seconds

    # ------------------------------------------------------------------ one recovery

    def begin(self, plan_bytes: float, world_size: int,
              starting: bool = False) -> RecoveryDeadlines:
        """A recovery starts (the decision is known): its deadlines, from what was measured;
        ``starting``: processes start for the generation, and the regroup waits for them."""
        self.deadlines = recovery_deadlines(self._regroups, self._entries, self._steps,
                                            plan_bytes, self._bandwidth, world_size,
                                            self._start_s if starting else 0.0)
        self.missed = None
        self._recovering = open_sockets()
        return self.deadlines

    def generation_sockets(self) -> Sockets:
        """The sockets of the generation being entered or trained: its groups', and the ones
        opened since its recovery began (a store client, a group still forming), never the
        agent channel's."""
        return self._sockets() | self._opened_since(self._recovering)

    def enter_phase(self, name: str) -> None:
        """``name`` begins: announce its deadline, and give it up at ``WORKER_MARGIN`` x that
        plus the phase before (peers may still be in it)."""
        self._stop()
        if self.deadlines is None:
            return
        at = RECOVERY_PHASES.index(name)
        limit = self.deadlines.of(name)
        before = self.deadlines.of(RECOVERY_PHASES[at - 1]) if at else 0.0
        give_up_s = WORKER_MARGIN * (limit + before)
        self._before = open_sockets()
        timer = threading.Timer(give_up_s, self._expire, (name, give_up_s))
        timer.daemon = True
        timer.name = "chameleon-deadline"
        with self._lock:
            self.phase, self._timer = name, timer
        self._announce(PhaseDeadline(limit, give_up_s, name, self.deadlines.why_of(name)))
        timer.start()

    def cancel(self) -> None:
        """No phase is timed any more: the generation was given up (its worker now waits for
        the agents, for as long as they take), or the recovery is over."""
        if self._stop():
            self._announce(None)

    def done(self) -> None:
        """The first step under the plan committed: the recovery is over."""
        if self.deadlines is not None:
            self.cancel()
            self.deadlines = None

    def _stop(self) -> bool:
        """Stop the phase's timer; whether a phase was timed (its timer may have fired)."""
        with self._lock:
            timer, self._timer, phase, self.phase = self._timer, None, self.phase, None
        if timer is not None:
            timer.cancel()
        return phase is not None

    def explain(self, message: str) -> str:
        """The cause to give for a failed generation: the missed deadline, when one was."""
        if self.missed is None:
            return message
        phase, seconds = self.missed
        return (f"{phase} missed its deadline of {seconds:.3g} s ({WORKER_MARGIN:g} x the "
                f"measured figure); {message.splitlines()[0] if message else ''}").rstrip("; ")

    def _expire(self, name: str, seconds: float) -> None:
        with self._lock:
            if self.phase != name or self._timer is None:
                return   # ended meanwhile
            self._timer, self.missed = None, (name, seconds)
        log.warning("%s missed its deadline of %.3g s: giving the generation up", name, seconds)
        # sockets opened in the phase: ours while regrouping and entering; in the first step
        # the script runs, and its own connections are never cut
        fresh = self._opened_since(self._before) if name != "first step" else frozenset()
        self._unblock(self._sockets() | fresh)

    def _opened_since(self, before: Sockets) -> Sockets:
        return frozenset(s for s in open_sockets() - before
                         if not _talks_to(s[0], self._spare_port))


def _talks_to(fd: int, port: int | None) -> bool:
    """Whether socket ``fd`` is connected to ``port`` on this host (the agent channel)."""
    if port is None:
        return False
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        return sock.getpeername()[1] == port
    except (OSError, IndexError, TypeError):
        return False
    finally:
        sock.detach()
