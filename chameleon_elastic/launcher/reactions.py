"""The agent's one decision per monitor tick, as a pure function of what the tick saw.

The agent is a small state machine. Its states are torch's ``WorkerState`` of the local worker
group, and each tick moves it by one :class:`Reaction`:

    state (what the tick saw)        reaction                              next state
    -------------------------------  ------------------------------------  -----------------
    any, our lease lost, some local  stop the rest: the script had ended   SUCCEEDED (exit
      worker or another node's         (no restart, no round)                barrier)
      finished the script
    any, our lease lost              fence: kill every worker, new round   HEALTHY (adopted)
    FAILED/UNHEALTHY, a worker said  end with its sentence                 FAILED (exit 1)
      training cannot go on
    FAILED/UNHEALTHY, devices lost   recover: re-plan without them, in     HEALTHY
      (signal, health check, hang)     place when every worker can
    FAILED/UNHEALTHY, a crash        recover: same plan, one restart       HEALTHY
                                       spent (first: ask the leases
                                       whether a peer node died, which
                                       costs nothing)
    FAILED/UNHEALTHY, no restart     fail                                  FAILED (exit 1)
    HEALTHY, every local worker a    stop them (nothing is lost: no event) HEALTHY, then
      standby, and the job finished                                          SUCCEEDED
      on another node
    HEALTHY, a node lost, a device   recover (new round)                   HEALTHY
      back, a node waiting, a peer
      lost on another node, the
      rendezvous store lost, another
      agent opened a quick round
    HEALTHY, a local device's speed  recover in place: the planner keeps,  HEALTHY
      changed for a window of steps    reduces or spares it (nobody killed;
      (stragglers.py)                  without in place, nothing is done)
    HEALTHY, nothing new             monitor                               HEALTHY
    SUCCEEDED, every device here     (seen as HEALTHY: a member with no    HEALTHY
      lost, the job going on           device answers the quick rounds;
      elsewhere (leases watched)       rounds.Rounds.stays_member)
    SUCCEEDED                        (the loop ends: exit barrier)         SUCCEEDED

A recovery's round is quick (no rendezvous round, rounds.py) unless a node may join: a node
waiting, the rendezvous store lost (failover), our own lease lost (the others count us gone).

Detectors (detectors.py) produce the facts, the agent applies the reaction; this module only
decides, so every transition is tested without a process (tests/launcher/test_reactions.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.distributed.elastic.agent.server.api import WorkerState

from chameleon_elastic.spec import unit_of

from .failures import FailureKind, Trigger, WorkerFailure

__all__ = ["Reaction", "Tick", "react"]


@dataclass(frozen=True)
class Tick:
    """What one monitor tick saw (plan devices are units of ``tp`` cards)."""

    state: WorkerState
    failures: tuple[WorkerFailure, ...] = ()   # workers that exited, and hung ones
    hung: frozenset[int] = frozenset()         # cards convicted of a hang (among failures)
    bad: frozenset[int] = frozenset()          # units failing the health check
    lease: Trigger | None = None               # NODE_LOST (another node) or FENCED (ours)
    ended: str | None = None                   # a worker's sentence: training cannot go on
    ended_status: int = 1                      # and the exit status it calls for
    planned: bool = False                      # a job, with a policy other than restart
    inplace_wanted: bool = False               # and recovery in place asked for
    runtime: bool = False                      # every live worker runs on the runtime
    some_succeeded: bool = False               # some worker already finished the script
    restarts_left: int = 0
    leases_asked: bool = False                 # ask_leases was answered (no node lost)
    rejoining: frozenset[int] = frozenset()    # excluded units that pass the check again
    waiting: int = 0                           # nodes waiting to join (HEALTHY ticks)
    trouble: bool = False                      # a worker lost a peer on another node
    store_lost: bool = False                   # the rendezvous store is unreachable
    quick_called: bool = False                 # another agent opened a quick round
    tp: int = 1
    slow: tuple[tuple[int, float], ...] | None = None   # a straggler event: factors to plan for
    slow_why: tuple[tuple[int, str], ...] = ()   # and the figures behind it, per device
    retire: frozenset[int] = frozenset()       # standbys' cards: the job ended on other nodes
    live: frozenset[int] = frozenset()         # the cards of the live local workers
    finished_elsewhere: bool = False           # fenced: another node's workers all succeeded


@dataclass(frozen=True)
class Reaction:
    action: Literal["monitor", "recover", "fence", "end", "fail", "ask_leases"]
    trigger: Trigger | None = None
    inplace: bool = False
    lost: frozenset[int] = frozenset()      # units lost
    joined: frozenset[int] = frozenset()    # units back
    kill: frozenset[int] = frozenset()      # cards to SIGKILL first
    charge: bool = False                    # a crash: spend one restart
    reason: str | None = None               # "end": the sentence
    status: int = 1                         # "end": the exit status (exit_status.py)

    @property
    def quick(self) -> bool:
        """No node can join, so no rendezvous round is needed: a quick round (rounds.py)."""
        return self.trigger not in (None, Trigger.MEMBERSHIP, Trigger.RENDEZVOUS_LOST,
                                    Trigger.FENCED)


_MONITOR = Reaction("monitor")


def react(t: Tick) -> Reaction:
    if t.lease is Trigger.FENCED:   # our plan may be stale: nothing of ours may train on
        if t.some_succeeded or t.finished_elsewhere:   # the fence caught the script's last
            # exits, here or as another node's workers finished: nothing to rejoin for
            return Reaction("monitor", kill=t.live)
        return Reaction("fence", Trigger.FENCED, inplace=t.inplace_wanted)
    if t.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
        return _failed(t)
    if t.state is not WorkerState.HEALTHY:
        raise RuntimeError(f"worker group in unexpected state {t.state.name}")
    if t.retire:   # they wait for a place that will never come; then SUCCEEDED
        return Reaction("monitor", kill=t.retire)
    inplace = t.inplace_wanted and t.runtime
    if t.lease is Trigger.NODE_LOST:
        return Reaction("recover", Trigger.NODE_LOST, inplace)
    if t.rejoining:
        return Reaction("recover", Trigger.REJOINED, inplace, joined=t.rejoining)
    if t.quick_called:
        return Reaction("recover", Trigger.PEER_RECOVERY, inplace)
    if t.store_lost:
        return Reaction("recover", Trigger.RENDEZVOUS_LOST, inplace)
    if t.waiting > 0:
        return Reaction("recover", Trigger.MEMBERSHIP, inplace)
    if t.trouble:
        return Reaction("recover", Trigger.PEER_LOST, inplace)
    if t.slow is not None and inplace:   # never a process killed for being slow
        return Reaction("recover", Trigger.STRAGGLER, inplace)
    return _MONITOR


def _failed(t: Tick) -> Reaction:
    if t.ended is not None:
        return Reaction("end", reason=t.ended, status=t.ended_status)
    lost = frozenset(unit_of(f.device, t.tp) for f in t.failures
                     if f.kind is FailureKind.DEVICE_LOST) | t.bad
    crashed = any(f.kind is FailureKind.CRASH for f in t.failures)
    if t.planned and lost:
        cards = frozenset(c for u in lost for c in range(u * t.tp, (u + 1) * t.tp))
        # a unit is lost whole: its other cards cannot go on without the lost one
        return Reaction("recover", Trigger.DEVICE_LOST, lost=lost, kill=cards | t.hung,
                        inplace=(t.inplace_wanted and not crashed and not t.some_succeeded
                                 and t.runtime))
    kill = t.hung if not t.planned else frozenset()   # torchrun's way: a hang is a crash
    if t.lease is None and t.restarts_left == 0 and not t.leases_asked:
        return Reaction("ask_leases", kill=kill)
    if t.lease is Trigger.NODE_LOST:   # our workers failed because a peer node died
        return Reaction("recover", Trigger.NODE_LOST, kill=kill)
    if t.restarts_left > 0:
        # in place, only the crashed worker starts again; its peers keep their state
        return Reaction("recover", Trigger.CRASH, kill=kill, charge=True,
                        inplace=t.inplace_wanted and not t.some_succeeded and t.runtime)
    return Reaction("fail", kill=kill, reason="max restarts used up")
