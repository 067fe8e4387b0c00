"""Failure classification: did the device die, or did the program crash on a healthy device?

The distinction drives the recovery. A worker killed by a signal that software does not send to
ask for a clean stop (SIGKILL from the OOM killer or a dead host, SIGSEGV / SIGBUS / SIGILL from
broken hardware or a driver) is taken as the loss of its device: the device is excluded and the
planner chooses a layout without it. A Python exception (exit code 1, or any other non-zero
code) is a crash on a healthy device: the same plan is restarted on the same devices, budgeted
by ``--max-restarts`` exactly as torchrun does. SIGTERM / SIGINT / SIGHUP mean "someone asked
the worker to stop" and count as a crash, never as a lost device. So does SIGABRT: the program
aborted itself (C++ ``std::terminate``, a failed assert, NCCL's watchdog); seen after a Python
exception when a native thread is still alive at exit, which must not cost the device.

Shells report a signal death as ``128 + signo``; that spelling is recognised as well.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass

__all__ = ["FailureEvent", "FailureKind", "RestartBudget", "Trigger", "WorkerFailure",
           "classify_exit"]

_POLITE_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
_POLITE_NAMES = frozenset(s.name for s in _POLITE_SIGNALS)
_SELF_INFLICTED = frozenset({signal.SIGABRT})


class FailureKind(str, enum.Enum):
    DEVICE_LOST = "device_lost"   # the device is presumed gone: exclude it and re-plan
    CRASH = "crash"               # program error on a healthy device: restart in place


@dataclass(frozen=True)
class WorkerFailure:
    """One failed worker as the agent saw it."""

    device: int
    local_rank: int
    exitcode: int
    signal: str | None
    kind: FailureKind
    reason: str
    since: float | None = None   # Unix time the failure began, when earlier than its sighting
                                 # (a hang: the worker's last progress)
    hang_s: float | None = None  # a hang: the timeout in force, and whether it was derived
    hang_auto: bool = False
    pid: int | None = None       # the process, and its global rank when it ended
    rank: int | None = None

    @property
    def said(self) -> str:
        """What died, as torchrun names it: ``rank 1 (local rank 1, pid 5590) was killed by
        SIGKILL``, ``... exited with code 1``; a worker the agent stopped: its reason (a hang)."""
        who = f"rank {self.rank}" if self.rank is not None else f"device {self.device}"
        where = f"local rank {self.local_rank}" + (f", pid {self.pid}" if self.pid else "")
        if self.signal is None and self.exitcode > 0:
            return f"{who} ({where}) exited with code {self.exitcode}"
        if self.signal is not None and self.pid is not None:
            return f"{who} ({where}) was killed by {self.signal}"
        return f"{who} ({where}): {self.reason}"

    @property
    def stopped_on_request(self) -> bool:
        """Ended by a polite signal: usually the agent stopping the rest of a failed group."""
        return self.signal in _POLITE_NAMES


def _signal_of(exitcode: int) -> signal.Signals | None:
    if exitcode < 0:
        number = -exitcode
    elif 128 < exitcode < 128 + 65:
        number = exitcode - 128
    else:
        return None
    try:
        return signal.Signals(number)
    except ValueError:
        return None


def classify_exit(exitcode: int, device: int, local_rank: int, pid: int | None = None,
                  rank: int | None = None) -> WorkerFailure:
    """Classify a worker's exit code (negative = killed by that signal, Popen convention);
    ``pid`` and ``rank``: the process and its global rank, for the line that names it."""
    sig = _signal_of(exitcode)
    if sig is not None and sig not in _POLITE_SIGNALS | _SELF_INFLICTED:
        return WorkerFailure(device, local_rank, exitcode, sig.name, FailureKind.DEVICE_LOST,
                             f"worker killed by {sig.name}", pid=pid, rank=rank)
    name = sig.name if sig is not None else None
    if sig in _SELF_INFLICTED:
        reason = f"worker aborted ({name})"
    else:
        reason = f"worker stopped by {name}" if name else f"worker exited with code {exitcode}"
    return WorkerFailure(device, local_rank, exitcode, name, FailureKind.CRASH, reason, pid=pid,
                         rank=rank)


class Trigger(str, enum.Enum):
    """Why the agents form a new plan generation."""

    DEVICE_LOST = "device_lost"          # a worker died by signal, or failed its health check
    CRASH = "crash"                      # a worker raised: same plan, restart budget
    PEER_LOST = "peer_lost"              # our workers lost a peer we do not run (another node)
    MEMBERSHIP = "membership"            # another agent waits in the rendezvous
    RENDEZVOUS_LOST = "rendezvous_lost"  # the rendezvous store's host is gone
    REJOINED = "device_rejoined"         # a device passes its health check again
    NODE_LOST = "node_lost"              # another node's etcd lease expired
    FENCED = "fenced"                    # our own lease was lost: our plan may be stale
    PEER_RECOVERY = "peer_recovery"      # another agent opened a quick round (rounds.py)
    STRAGGLER = "straggler"              # a local device's speed changed (stragglers.py)


@dataclass(frozen=True)
class FailureEvent:
    """One event, classified once: what happened, which local devices are lost or back, and
    the plan generation it happened in, and when it was seen (``wall``, Unix seconds)."""

    trigger: Trigger
    generation: int
    lost: frozenset[int] = frozenset()
    joined: frozenset[int] = frozenset()
    failures: tuple[WorkerFailure, ...] = ()
    wall: float = 0.0
    notes: tuple[tuple[int, str], ...] = ()   # a straggler's figures, per device (stragglers.py)

    @property
    def reason(self) -> str:
        return self.trigger.value


@dataclass
class RestartBudget:
    """torchrun's ``--max-restarts``: spent by crashes on healthy devices, never by a lost
    device. A crash is charged when it is seen; when the round it starts shows that a peer node
    died (our workers failed because of it), the restart is given back, since that is a lost
    node (torchrun would have spent one)."""

    max_restarts: int
    left: int
    charged: bool = False   # a restart was charged for the crash being recovered

    @property
    def used(self) -> int:
        return self.max_restarts - self.left

    def charge(self) -> None:
        self.left -= 1
        self.charged = True

    def settle(self, peer_node_lost: bool) -> None:
        if self.charged and peer_node_lost:
            self.left += 1
        self.charged = False
