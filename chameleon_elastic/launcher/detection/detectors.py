"""What the agent watches besides its workers' exits, each watcher one concern.

- :class:`HangWatch`: runtime workers whose progress count stands still while they are awake.
- :class:`PeerTrouble`: a local worker lost a peer that this node does not run.
- :func:`unhealthy_units`: the device health hook.
- :func:`lease_news` / :func:`lease_verdict`: other nodes' etcd leases and our own.
- :class:`DeviceBook`: this node's devices out of the plan, and how each was lost.
- :class:`~.stragglers.StragglerWatch`: local devices whose speed changed for long enough.

Each returns typed facts (``WorkerFailure``, ``Trigger``, unit ids); what to do about them is
decided in reactions.py.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import psutil
from torch.distributed.elastic.agent.server.api import WorkerState

from chameleon_elastic import channel
from chameleon_elastic.hang import (
    FLOOR_S,
    PhaseDeadline,
    asleep_past_deadline,
    derive_hang_s,
    describe,
)
from chameleon_elastic.timeouts import Timeouts

from ..failures import FailureKind, Trigger, WorkerFailure, classify_exit
from ..observe import Event
from ..plan_env import NodeCards, device_id
from ..reactions import Tick
from .node_watch import NodeWatch
from .stragglers import StragglerWatch

__all__ = ["DeviceBook", "HangWatch", "PeerTrouble", "Watchers", "lease_news",
           "lease_verdict", "log_failures", "unhealthy_units"]

log = logging.getLogger("chameleon_elastic.launcher.detection.detectors")

# How long a worker past its hang timeout must look awake (running, in the kernel) before it
# counts as hung: long enough for a peer's reaction to its partner's death to pass.
_HANG_CONFIRM_S = 1.0
#: a worker whose process is stopped (SIGSTOP, a frozen container) without progress and without
#: CPU this long is frozen, whatever its hang timeout: a slow step still runs or sleeps
STOPPED_S = 2.0
# How often the workers' typical gaps (for the auto hang timeout) are read from the channel.
_GAP_READ_S = 2.0


@dataclass
class DeviceBook:
    """This node's devices (plan devices: units under tensor parallelism) out of the plan, and
    why: one home for what used to be four flags."""

    lost: set[int] = field(default_factory=set)        # to a signal (for good) or the check
    unhealthy: set[int] = field(default_factory=set)   # the part of ``lost`` the check excluded
    rejoining: set[int] = field(default_factory=set)   # unhealthy ones that pass it again
    why: dict[int, str] = field(default_factory=dict)  # "SIGKILL", "health check", "hung: ..."

    def note_lost(self, lost: set[int], bad: set[int], failures: tuple[WorkerFailure, ...],
                  tp: int) -> None:
        """Units lost, the part the health check excluded, and how each was lost: its
        signal, or its hang (``hung: no progress for 61.2 s``)."""
        self.lost |= lost
        self.unhealthy |= bad
        self.why.update({d: "health check" for d in bad})
        self.why.update({f.device // tp: f.signal or _said(f.reason) for f in failures
                         if f.kind is FailureKind.DEVICE_LOST})

    def settle(self) -> None:
        """The rejoining devices are back in: the next report no longer calls them lost."""
        self.lost -= self.rejoining
        self.unhealthy -= self.rejoining
        for device in self.rejoining:
            self.why.pop(device, None)
        self.rejoining.clear()


def stall_shown_after(hang_s: float) -> float:
    """How long a worker may go without progress before the status line names it, and the
    step at which the figure is renewed: 10 s, or half a shorter hang timeout."""
    return min(10.0, hang_s / 2)


class HangWatch:
    """Runtime workers whose progress count has not moved for ``hang_s`` and that are not
    asleep. A worker blocked on a hung peer sleeps in its transfer; the hung one is stopped,
    stuck in the kernel, or spinning. Every state must last ``_HANG_CONFIRM_S`` of
    consecutive looks (a peer of a dead worker runs briefly while it reacts); "stopped" must
    have used no CPU meanwhile (a device throttled by stopping and continuing it from outside
    runs between its stops: slow, not frozen), and "running" at least half a core (a process
    starved of a core by other load is runnable, not spinning).
    Scripts that never report progress are never hung. While one waits to be convicted, the
    status line says so (a minute of silence looked like a frozen launcher).

    With the automatic timeout, a stopped process (SIGSTOP, a frozen container) is told apart
    from a slow one without waiting for its pace to be measured: stopped, without CPU and
    without progress for ``STOPPED_S``, it is frozen whatever its timeout (a slow step still
    runs or sleeps). Early in a job the timeout is the ceiling (60 s) until enough gaps are
    measured, and a worker frozen after its third step held the others for a minute. A
    ``--hang-timeout`` given by the user is the user's word, stopped or not.

    ``auto``: ``hang_s`` is a ceiling, and each worker's timeout is derived from its typical gap between phases
    (chameleon_elastic/hang.py), or is the ceiling while it says it is in a slow stretch."""

    def __init__(self, hang_s: float, nproc: int, card: str = "device",
                 auto: bool = False) -> None:
        self.hang_s = hang_s
        self.auto = auto and bool(hang_s)
        self._nproc = nproc
        self._card = card
        self._gap: dict[int, float] = {}   # device -> typical gap between its phases
        # device -> its slow stretch's deadline (True: none derived), as last read
        self._phase: dict[int, bool | PhaseDeadline] = {}
        self._gap_read = -math.inf
        self._beats: dict[int, tuple[int, float]] = {}   # device -> (progress count, since)
        # device -> (first look awake without progress, its CPU seconds then)
        self._awake: dict[int, tuple[float, float]] = {}
        self._shown: dict[int, int] = {}   # device -> last stall step on the status line
        # the workers that have made no progress since a generation was published: device ->
        # (its count then, the first such publication it missed)
        self._unstarted: dict[int, tuple[int, float]] = {}

    def reset(self, store: Any = None, pids: dict[int, int] | None = None) -> None:
        """A recovery is no hang: progress is timed afresh. With the channel (``store``) and
        the workers kept (``pids``), as a generation is about to be published: each worker's
        progress count now, so that one which never starts the new generation is seen. One
        that has not moved since an earlier publication keeps its clocks: it has held up every
        generation since (each given up at its regroup's deadline, seconds apart), and timed
        afresh at each one it would never be convicted."""
        now = time.monotonic()
        counts = {d: channel.read_int(store, channel.beat_key(d))
                  for d in (pids or {} if store is not None else {})}
        before = self._unstarted
        held = {d for d, c in counts.items() if d in before and before[d][0] == c}
        self._unstarted = {d: before[d] if d in held else (c, now)
                           for d, c in counts.items() if c is not None}
        self._beats = {d: v for d, v in self._beats.items() if d in held}
        self._awake = {d: v for d, v in self._awake.items() if d in held}
        self._shown.clear()

    def in_force(self) -> str:
        """The timeout in force, as the status line says it: ``5 s (auto)`` (the most lenient
        over this node's workers, slow stretches aside), ``3 s`` or ``off``; nothing before a
        worker beats (a script off the runtime is never hang-checked)."""
        if not self._beats:
            return ""
        if not self.auto:
            return describe(self.hang_s, False)
        gaps = [self._gap.get(d) for d in self._beats]
        figure = max((derive_hang_s(g, self.hang_s) for g in gaps), default=self.hang_s)
        # far from the step time, the figure says why: not measured yet, or the floor
        why = ("not measured yet" if None in gaps and figure == self.hang_s
               else "the floor" if figure <= FLOOR_S else "")
        return describe(figure, True, why)

    def recovering(self) -> str:
        """The longest deadline of a recovery phase a worker is in, with its phase and why
        (``regroup deadline 25 s (a process starts for it: ...)``), else ``""``."""
        phases = [v for v in self._phase.values() if isinstance(v, PhaseDeadline)]
        return max(phases, key=lambda v: v.deadline_s).said() if phases else ""

    def _limit(self, store: Any, device: int, looked: bool) -> float:
        """``device``'s timeout now; ``looked``: ask whether it is in a slow stretch and with
        what deadline (a read), else the least it can be."""
        if not self.auto:
            return self.hang_s
        slow = channel.read(store, channel.slow_key(device)) if looked else None
        return derive_hang_s(self._gap.get(device), self.hang_s,
                             False if slow is None else PhaseDeadline.from_json(slow))

    def _read_gaps(self, store: Any, pids: dict[int, int], now: float) -> None:
        if not self.auto or now - self._gap_read < _GAP_READ_S:
            return
        self._gap_read = now
        gaps = {d: channel.read(store, channel.gap_key(d)) for d in pids}
        self._gap = {d: float(g) for d, g in gaps.items() if g is not None}
        slow = {d: channel.read(store, channel.slow_key(d)) for d in pids}
        self._phase = {d: PhaseDeadline.from_json(v) for d, v in slow.items() if v is not None}

    def check(self, store: Any, pids: dict[int, int]) -> tuple[list[WorkerFailure], str | None]:
        """(hung workers, the status text when what it should say changed, else None)."""
        if not self.hang_s or store is None:
            return [], None
        now = time.monotonic()
        for gone in set(self._beats) - set(pids):   # exited: no longer part of the figure
            del self._beats[gone]
        self._read_gaps(store, pids, now)
        hung = []
        stalled: dict[int, tuple[float, float]] = {}   # device -> (idle, its timeout)
        for device, pid in sorted(pids.items()):
            count = channel.read_int(store, channel.beat_key(device))
            if count is None:
                continue
            if self._unstarted.get(device, (count,))[0] != count:
                del self._unstarted[device]   # it took up the new generation
            seen = self._beats.get(device)
            if seen is None or seen[0] != count:
                self._beats[device] = (count, now)
                self._awake.pop(device, None)
                continue
            idle = now - seen[1]
            first_look = stall_shown_after(self._limit(store, device, looked=False))
            if idle < (min(STOPPED_S, first_look) if self.auto else first_look) \
                    and device not in self._unstarted:
                continue
            try:
                proc = psutil.Process(pid)
                state = proc.status()
                cpu = sum(proc.cpu_times()[:2])
            except psutil.Error:
                continue   # gone: the next poll reports its exit
            if state == psutil.STATUS_ZOMBIE:
                # it has exited (its last steps done, then a slow teardown: torch 2.15's CUDA
                # build): the next poll reaps it and reports its exit, not a hang
                self._awake.pop(device, None)
                continue
            if state == psutil.STATUS_STOPPED and self.auto and idle >= STOPPED_S \
                    and self._convicted(device, state, cpu, now, 1):
                hung.append(self._hung(device, idle, "process stopped", STOPPED_S))
                continue
            if state in (psutil.STATUS_SLEEPING, psutil.STATUS_IDLE):
                self._awake.pop(device, None)
                asleep = self._asleep_hung(device, idle, now)
                if asleep is not None:
                    hung.append(self._hung(device, idle, *asleep))
                continue
            limit = self._limit(store, device, looked=True)
            if idle >= stall_shown_after(limit) and not self._leaving(store, device):
                stalled[device] = (idle, limit)
            if idle >= limit and self._convicted(device, state, cpu, now, idle / limit):
                hung.append(self._hung(device, idle, f"process {state}", limit))
        return hung, self._status(stalled)

    def _asleep_hung(self, device: int, idle: float, now: float) -> tuple[str, float] | None:
        """Asleep is waiting for a peer, unless the wait outlasts what waiting can: past the
        time its recovery phase gives itself up, or, after a generation was published (and
        the worker's watchdog unblocked every transfer of the old one), without having taken
        it up for its hang timeout, or for the deadline of the recovery phase its peers here
        wait for it in, if shorter (:meth:`_waited_for`): then it is stuck where no unblocking
        reaches (how and the timeout in force, else None)."""
        slow = self._phase.get(device, False)
        if asleep_past_deadline(idle, slow):
            assert isinstance(slow, PhaseDeadline)
            return "asleep past its recovery phase's deadline", slow.give_up_s
        if device in self._unstarted:
            gap = self._gap.get(device)
            limit = min(derive_hang_s(gap, self.hang_s),
                        derive_hang_s(gap, self.hang_s, self._waited_for(device)))
            if now - self._unstarted[device][1] >= limit:
                return "asleep in the previous plan generation", limit
        return None

    def _waited_for(self, device: int) -> bool | PhaseDeadline:
        """The longest deadline of a recovery phase that this node's other workers announce
        (False: none): after a publication, the regroup in which they wait for ``device``.
        They give it up at twice that, and every generation after it too while ``device``
        stays where it is, so it is convicted at once, as a frozen peer is; its own hang
        timeout is the ceiling until its pace is measured (the first steps of a job)."""
        deadlines = [v for d, v in self._phase.items()
                     if d != device and isinstance(v, PhaseDeadline)]
        return max(deadlines, key=lambda v: v.deadline_s, default=False)

    @staticmethod
    def _leaving(store: Any, device: int) -> bool:
        """Past its last step (runtime/world/link.py): still held to the ceiling, never named as
        stalled on the status line, whose last word is then the job's success."""
        return channel.read(store, channel.slow_key(device)) == channel.LEAVING

    def _hung(self, device: int, idle: float, how: str, limit: float) -> WorkerFailure:
        return WorkerFailure(device, device % self._nproc, -signal.SIGKILL, None,
                             FailureKind.DEVICE_LOST, f"hung: no progress for {idle:.1f} s, {how}",
                             since=time.time() - idle, hang_s=limit, hang_auto=self.auto)

    def _convicted(self, device: int, state: str, cpu: float, now: float,
                   over: float) -> bool:
        """``over``: its time without progress over its timeout (at least 1)."""
        since, cpu_then = self._awake.setdefault(device, (now, cpu))
        if now - since < _HANG_CONFIRM_S:
            return False
        if state == psutil.STATUS_STOPPED and cpu > cpu_then:
            # it ran since the first look: stopped part of the time (a throttled device,
            # stopped and continued from outside), not frozen
            self._awake[device] = (now, cpu)
            return False
        if state == psutil.STATUS_DISK_SLEEP and over < 2:
            # in the kernel, waiting for IO: a worker reading a file (a lazy import) can sit
            # there for seconds on a host busy with IO; a hang there lasts, so held to twice
            return False
        if state == psutil.STATUS_RUNNING and cpu - cpu_then < (now - since) / 2:
            # runnable but hardly run: starved of a core by other load, not spinning
            self._awake[device] = (now, cpu)
            return False
        return True

    def _status(self, stalled: dict[int, tuple[float, float]]) -> str | None:
        """``device 2: no progress for 20 s (hung at 60 s)``, renewed each time a stall crosses
        another step of ``stall_shown_after``; ``running`` once it is gone. An auto timeout
        says so: ``(hung at 5 s, auto)``."""
        shown = {d: int(idle // stall_shown_after(limit)) for d, (idle, limit) in stalled.items()}
        if shown == self._shown:
            return None
        self._shown = shown
        if not stalled:
            return "running"
        said = "; ".join(f"{self._card} {d}: no progress for {idle:.0f} s"
                         for d, (idle, _) in sorted(stalled.items()))
        limit = max(limit for _, limit in stalled.values())
        return f"{said} (hung at {limit:.3g} s{', auto' if self.auto else ''})"


class PeerTrouble:
    """A local worker lost a peer in the current generation and no agent has acted for a grace
    period: a peer this node does not run is gone (another node)."""

    def __init__(self) -> None:
        self._since: float | None = None

    def reset(self) -> None:
        self._since = None

    def check(self, store: Any, generation: int, grace_s: float) -> bool:
        seen = channel.read_int(store, channel.TROUBLE)
        if seen is None or seen < generation:
            self._since = None
            return False
        now = time.monotonic()
        if self._since is None:
            self._since = now
        return now - self._since >= grace_s


def unhealthy_units(health: Any, book: DeviceBook, live_cards: set[int], local_cards: set[int],
                    units: Callable[[set[int]], set[int]]) -> set[int]:
    """Live units with a card failing the health check now; marks excluded ones that pass it
    again as rejoining (the check names cards)."""
    bad = units(set(health.unhealthy(live_cards)))
    if book.unhealthy:
        still_bad = units(set(health.unhealthy(local_cards)))
        book.rejoining |= book.unhealthy - still_bad
    return bad


def lease_news(watch: Any, excluded: set[int], units_per_node: int,
               emit: Callable[..., None], members: Collection[int]) -> Trigger | None:
    """``FENCED`` when our own lease was lost, ``NODE_LOST`` when another node's expired and
    its devices are not out already, or it is one of the last round's ``members``: a member
    with no device left may host the round's worker store, which the workers still use (a
    group formed later, a checkpoint's; chaos: they waited on a frozen one for good), and the
    quick rounds wait for its report; else None."""
    if watch is None:
        return None
    lost, fenced = watch.changes()
    if fenced:   # the lease thread has stopped the workers and logged it
        return Trigger.FENCED

    def is_news(node: int | None) -> bool:
        return node is None or node in members or not {
            device_id(int(node), u, units_per_node) for u in range(units_per_node)} <= excluded

    news = [info for info in lost if is_news(info.get("node"))]
    for info in news:
        emit(Event.FAILURE_SEEN, kind="node_lost", node=info.get("node"),
             reason=f"lease of {info['node_id']} expired")
    return Trigger.NODE_LOST if news else None


def lease_verdict(watch: Any, excluded: set[int], units_per_node: int,
                  emit: Callable[..., None], members: Collection[int]) -> bool:
    """Before ending a job for a crash with no restart left: did a peer node die? Its lease
    says so within its ttl (+ 1 s for etcd's expiry sweep)."""
    if watch is None:
        return False
    deadline = time.monotonic() + watch.ttl + 1.0
    while True:
        if lease_news(watch, excluded, units_per_node, emit, members) is Trigger.NODE_LOST:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def log_failures(emit: Callable[..., None], failures: tuple[WorkerFailure, ...],
                 bad: set[int]) -> None:
    """One ``failure_seen`` event per failed worker and per unit failing the health check."""
    for f in failures:
        hang = {} if f.hang_s is None else {"hang_s": f.hang_s, "hang_auto": f.hang_auto}
        emit(Event.FAILURE_SEEN, device=f.device, local_rank=f.local_rank, exitcode=f.exitcode,
             signal=f.signal, kind=f.kind.value, reason=f.reason, **hang)
    for d in sorted(bad):
        emit(Event.FAILURE_SEEN, device=d, kind=FailureKind.DEVICE_LOST.value,
             reason="device failed its health check", exitcode=None, signal=None,
             local_rank=None)


class Watchers:
    """Every detector of one agent, read into one :class:`~.reactions.Tick` per monitor tick.
    ``lease`` is the etcd node watch (None elsewhere), set once the first round is done."""

    def __init__(self, timeouts: Timeouts, here: NodeCards, health: Any,
                 emit: Callable[..., None], status: Callable[[str], None],
                 stragglers: StragglerWatch | None = None,
                 note: Callable[..., None] = lambda **_: None) -> None:
        hang_s, hang_auto = timeouts.hang_s, timeouts.hang_auto
        self.book = DeviceBook()
        self.hangs = HangWatch(hang_s, here.nproc, "device" if here.tp == 1 else "card",
                               auto=hang_auto)
        self._note = note   # fields of the status line: the hang timeout, a recovery's deadline
        self._in_force = ("", "")
        self.trouble = PeerTrouble()
        self.stragglers = stragglers   # None: --stragglers off
        self.lease: Any = None
        self._health = health
        self._emit = emit
        self._status = status

    def tick(self, state: WorkerState, exits: list[Any], pids: dict[int, int], here: NodeCards,
             session: Any, store: Any, nodes_waiting: Callable[[], tuple[int, bool]],
             quick_called: Callable[[], bool], grace_s: float,
             finished: Callable[[], bool] = lambda: False, *, members: Collection[int],
             **facts: Any) -> Tick:
        """``exits``: the workers that failed since the last tick; ``members``: the nodes of
        the last round (lease_news); ``finished``: whether the job finished on another node
        (asked only when every local worker is a standby, or when our lease is lost);
        ``facts``: the agent's own (``planned``, ``inplace_wanted``, ``runtime``,
        ``some_succeeded``, ``restarts_left``). The detectors are read in the table's order,
        each only when it can still matter."""
        healthy = state == WorkerState.HEALTHY
        hung, stall = self.hangs.check(store, pids) if healthy else ([], None)
        in_force = (self.hangs.in_force(), self.hangs.recovering())
        if in_force[0] and in_force != self._in_force:
            self._in_force = in_force
            self._note(hang=in_force[0], deadline=in_force[1])
        if stall is not None:
            self._status(stall)
        bad = set()
        if healthy and session is not None:
            bad = unhealthy_units(self._health, self.book, set(pids), set(here.cards),
                                  here.units)
        excluded = set(session.excluded) if session is not None else set()
        lease = lease_news(self.lease, excluded, here.units_per_node, self._emit, members)
        state = WorkerState.UNHEALTHY if healthy and (bad or hung) else state
        failures = tuple(classify_exit(e.exitcode, e.device, e.local_rank,
                                       e.failure.pid if e.failure else None,
                                       e.worker.global_rank) for e in exits) + tuple(hung)
        waiting, trouble, store_lost, ended, called = 0, False, False, None, False
        ended_status = 1
        if state != WorkerState.HEALTHY:
            log_failures(self._emit, failures, bad)
            ended = channel.read(store, channel.ENDED) if store is not None else None
            if ended is not None:
                ended_status = channel.read_int(store, channel.ENDED_STATUS) or 1
        elif lease is None and not self.book.rejoining and session is not None and (
                quick_called()):
            called = True
        elif lease is None and not self.book.rejoining:
            waiting, store_lost = nodes_waiting()
            if session is not None and not waiting and not store_lost:
                trouble = self.trouble.check(store, session.plan.generation, grace_s)
        slow, slow_why = None, ()
        if (state == WorkerState.HEALTHY and self.stragglers is not None and session is not None
                and store is not None and self.stragglers.due()):
            self.stragglers.read(store, {c: c // here.tp for c in pids}, session.plan.generation)
            found = self.stragglers.check(session.planned, session.plan)
            slow = None if found is None else tuple(sorted(found.items()))
            slow_why = tuple(sorted(self.stragglers.why.items())) if found else ()
        retire = frozenset(pids) if (
            state == WorkerState.HEALTHY and session is not None and pids
            and here.units(pids) <= set(session.plan.spare_devices) and finished()) else None
        return Tick(state=state, failures=failures, hung=frozenset(f.device for f in hung),
                    bad=frozenset(bad), lease=lease, ended=ended, ended_status=ended_status,
                    rejoining=frozenset(self.book.rejoining), waiting=waiting, trouble=trouble,
                    store_lost=store_lost, quick_called=called, tp=here.tp, slow=slow,
                    slow_why=slow_why,
                    retire=retire or frozenset(), live=frozenset(pids),
                    finished_elsewhere=lease is Trigger.FENCED and finished(), **facts)

    def watch_leases(self, params: Any, node: int,
                     stop_workers: Callable[[signal.Signals], None]) -> None:
        """Hold a lease and watch the others' (etcd-v3 only; see node_watch.py)."""
        if params.backend != "etcd-v3":
            return
        try:
            self.lease = NodeWatch(params, node, on_fenced=lambda: self._fenced(
                stop_workers, node), on_kept=lambda: self._emit(
                Event.FAILURE_SEEN, kind="lease_kept", node=node,
                reason="this node's lease outlived etcd's trouble: etcd could not answer for "
                       "a while but let no lease expire, so no other node counted this one "
                       "lost; its workers, stopped when the loss was presumed, rejoin "
                       "through a full round")).start()
        except Exception as exc:  # noqa: BLE001 - liveness is an accelerator, not a necessity
            log.warning("node leases unavailable (%s); lost nodes are seen through the "
                        "rendezvous and the workers only", exc)

    def _fenced(self, stop_workers: Callable[[signal.Signals], None], node: int) -> None:
        """Our lease is lost (the lease thread): every worker stops now, whatever the loop
        does, since its plan may be stale."""
        stop_workers(signal.SIGKILL)
        self._emit(Event.FAILURE_SEEN, kind="fenced", node=node,
                   reason="this node's lease was lost (cut off from etcd, or frozen): its "
                          "workers were stopped, as their plan may be stale")

    def alive(self) -> Callable[[], set[int]] | None:
        """Nodes holding their lease, when leases are watched (etcd-v3)."""
        return self.lease.alive if self.lease is not None else None

    def rejoined(self) -> None:
        """A full round readmitted this node: its lease counts again (node_watch.py)."""
        if self.lease is not None:
            self.lease.rejoined()

    def nodes_lost(self, members: int) -> list[str]:
        """Other nodes whose lease expired (not ended on purpose) since the last look, or, when
        fewer than ``members`` nodes (the last round's) hold a lease, the missing ones as a
        count: a member lost earlier, whose loss cost no device (it had none left), never
        reaches the end either, and no look after its loss names it. None without leases.
        (A member that reached the end keeps its lease until every member did.)"""
        if self.lease is None:
            return []
        gone = [str(info["node_id"]) for info in self.lease.changes()[0]]
        missing = members - len(self.lease.alive())
        return gone or ([f"{missing} node(s) of the last round"] if missing > 0 else [])

    def leave(self, finished: bool) -> None:
        """Give our lease up: as finished (no loss for the others), or as gone."""
        if self.lease is not None:
            self.lease.finish() if finished else self.lease.close()
            self.lease = None

    def verdict(self, session: Any, here: NodeCards, members: Collection[int]) -> bool:
        excluded = set(session.excluded) if session is not None else set()
        return lease_verdict(self.lease, excluded, here.units_per_node, self._emit, members)


def _said(reason: str) -> str:
    """A hang as the recovery line says it: ``hung: no progress for 3.0 s``, or ``stopped: ...``
    for a stopped process (SIGSTOP, a frozen container), which is not a hang in the code."""
    said, _, how = reason.partition(",")
    return said.replace("hung:", "stopped:", 1) if how.strip() == "process stopped" else said
