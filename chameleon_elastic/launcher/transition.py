"""One transition of the agent, in its order: the launch, and every recovery after it.

    round      quick when no node can join (rounds.py), else torch's rendezvous round
    agree      report, decide (the lowest member) or adopt (coordination/agreement.py)
    stop       every local worker, unless the decision is in place
    store      a fresh worker store for the generation, hosted by the deciding agent
    start      the generation published on the node; workers for devices without one
               (starter.py)
    report     once the workers have resumed (reporter.py), or at once when nothing waits

A quick round that cannot finish falls back to a full round, from the top. A quiet decision
(only standbys lost: session.JobSession.drop_standbys) stops nothing, opens no store and
publishes nothing: the workers go on in their generation, on its store, and the recovery is
reported at once. The agent's part
of a recovery is timed here: from the failure seen to the decision in hand (``decide``, with the
round and the planner as ``rendezvous_s`` and ``plan_s``), then to the generation published on
the node (``publish``, with a relaunch's ``stop_s``); the workers time theirs, and
``reporter.py`` puts them together (docs/launcher.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerState

from chameleon_elastic import channel
from chameleon_elastic.timeouts import Timeouts

from .coordination.agreement import agree
from .coordination.messages import Decision, Members, NodeReport, QuickRoundFailed
from .coordination.rounds import Rounds
from .detection.detectors import Watchers
from .detection.generations import AbandonedGenerations
from .failures import FailureEvent, RestartBudget
from .observation.reporter import Pending, RecoveryReporter
from .observe import Event, running_state
from .plan_env import NodeCards
from .session import JobSession, LauncherPlanningError
from .workers.processes import WorkerProcesses
from .workers.starter import WorkerStarter

__all__ = ["Crew", "Transition"]


@dataclass(frozen=True)
class Crew:
    """The agent's collaborators that a transition uses."""

    rounds: Rounds
    procs: WorkerProcesses
    watchers: Watchers
    budget: RestartBudget
    reporter: RecoveryReporter
    starter: WorkerStarter
    timeouts: Timeouts
    emit: Callable[..., None]
    status: Callable[[str], None]
    report: Callable[[str | None], None]            # a recovery reported: the status's state
    session: JobSession | None
    channel: Any                                    # this node's agent <-> worker store
    assign_ranks: Callable[..., list[Any]]          # torch's rank assignment (plain scripts)
    track: Callable[[dict[int, int]], None]         # the profiler's, given the workers' pids
    abandoned: AbandonedGenerations                 # the streak of failed generations


class Transition:
    def __init__(self, crew: Crew, planned: bool) -> None:
        self._c = crew
        self._planned = planned          # a job, with a policy other than restart
        self.node: int | None = None     # node id in the initial world (device ids)
        self.world: tuple[int, ...] = ()  # the last decision's world (units in rank order)
        self._running = "running"         # the status line's state once the workers run
        self._outside: frozenset[int] = frozenset()   # spares outside the world (standbys)

    def here(self, spec: Any) -> NodeCards:
        tp = self._c.session.tp if self._c.session is not None else 1
        return NodeCards(self.node or 0, spec.local_world_size, tp)

    def runtime(self) -> bool:
        """Every live worker runs on the runtime (it registered on the channel). With none
        left here (every device of this node lost) nothing here stands in the way of an
        in-place recovery: the other nodes' reports decide (coordination/decide.py). It used
        to veto it, and the node that had lost its last device was often the decider: every
        worker was relaunched, from a checkpoint or from step 0 (chaos parts 8 and 9)."""
        return not self._c.procs.devices or self._c.procs.registered(self._c.channel)

    def run(self, wg: Any, event: FailureEvent | None, inplace_wanted: bool,
            expect_reports: bool, quick: bool = False) -> Any:
        """One transition of worker group ``wg``; returns the round's info (torch's
        ``RendezvousInfo``). ``expect_reports``: the workers run on the runtime, so the recovery
        is reported once they have committed a step."""
        c, spec, session = self._c, wg.spec, self._c.session
        began = time.perf_counter()
        alive = c.watchers.alive()
        quick = c.rounds.can_quick and (  # plain scripts: torchrun's rounds, but alone
            (quick and session is not None) or c.rounds.params.max_nodes == 1) and (
            alive is None or self.node in alive())   # our lease lost: the others count us gone
        info, members = c.rounds.open(spec, self.node, quick, alive)
        if self.node is None:
            self.node = info.rank
            if self._planned:
                c.rounds.admit_survivors(spec)
        rdzv_s = time.perf_counter() - began
        plan_s, decision, change, host = 0.0, None, None, members.decides
        if session is not None:
            t = time.perf_counter()
            try:
                decision, change, host = self._agree(info, members, spec, inplace_wanted, quick)
            except QuickRoundFailed as exc:
                c.emit(Event.FAILURE_SEEN, kind="quick_round_failed", reason=str(exc))
                return self.run(wg, event, inplace_wanted, expect_reports)
            plan_s = time.perf_counter() - t
        decided_at = time.time()
        if not quick:
            c.watchers.rejoined()
        if c.channel is not None:   # a lost peer reported before this round is handled
            channel.write(c.channel, channel.TROUBLE, -1)
        quiet = decision is not None and decision.quiet
        stop_s = 0.0 if quiet else self._stop(decision)
        if not quiet:   # a quiet decision keeps the workers' store: their groups meet there
            wg.master_addr, wg.master_port = c.rounds.open_worker_store(spec, info, host)
        wg.store = info.store
        wg.group_rank, wg.group_world_size = info.rank, info.world_size
        if quick and decision is not None:   # the nodes that took part (the exit barrier's)
            wg.group_rank, wg.group_world_size = (decision.nodes.index(self.node),
                                                  len(decision.nodes))
        c.emit(Event.RENDEZVOUS, group_rank=wg.group_rank, quick=quick,
               group_world_size=wg.group_world_size, node=self.node,
               master_addr=wg.master_addr, master_port=wg.master_port, duration_s=rdzv_s)
        started, published_at, launch_s = self._start(wg, decision, info)
        wg.state = WorkerState.HEALTHY
        if event is not None and decision is not None:
            kept = tuple(sorted(c.procs.devices - set(started)))
            # a standby outside the world (runtime/recovery/standby.py) has nothing to resume,
            # and after a quiet decision nobody does: the workers were not told
            world = self.here(spec).cards_of(decision.world)
            waiting = frozenset(c.procs.devices & world if expect_reports and not quiet else ())
            pending = Pending(
                event, decision, change, kept, started, waiting, decided_at, published_at,
                {"rendezvous_s": rdzv_s, "plan_s": plan_s, "stop_s": stop_s,
                 "launch_s": launch_s}, before=None if quiet else c.reporter.pending,
                running=self._running, standbys=self._outside)
            if quiet:   # nobody left the generation: said at once, the failure taken back
                c.abandoned.kept(session.plan.generation)
                c.report(c.reporter.finish({}, session.plan, c.budget.used, pending))
                c.reporter.restate(self._running)   # one still awaited says this node now
            else:
                c.reporter.pending = pending
                if not waiting:
                    c.report(c.reporter.finish({}, session.plan, c.budget.used))
        return info

    def _stop(self, decision: Decision | None) -> float:
        """A new generation: the hang watch times progress afresh, and a relaunch (no
        decision in place) stops every local worker first; the seconds that took."""
        c = self._c
        c.watchers.hangs.reset(c.channel, c.procs.pids())
        if decision is not None and decision.inplace:
            return 0.0
        t = time.perf_counter()
        c.procs.close(timeout=c.timeouts.shutdown_s)
        return time.perf_counter() - t

    def _agree(self, info: Any, members: Members, spec: Any, inplace_wanted: bool,
               quick: bool) -> tuple[Decision, Any, bool]:
        """Report, decide (the lowest member) or adopt (coordination/agreement.py), and log it;
        returns the decision, the plan change and whether this agent decided."""
        c, session, here = self._c, self._c.session, self.here(spec)
        assert session is not None and self.node is not None
        # live in the world: a standby started outside it (runtime/recovery/standby.py) waits there
        # until a plan gives its device a role, so it is no spare of the world meanwhile
        book, live = c.watchers.book, c.procs.devices & here.cards_of(self.world)
        before = set(session.excluded)
        watch = c.watchers.stragglers
        mine = NodeReport.gather(self.node, book.lost - book.rejoining, here.units(live),
                                 not live or self.runtime(), book.why, c.channel, here.cards,
                                 watch.report(here.units(here.cards)) if watch else None)
        # spares outside the world (standbys), while this agent serves the workers' store:
        # their loss is quiet (the workers go on in their world, on that store)
        self._outside = frozenset(set(session.plan.spare_devices) - set(self.world)
                                  if self.world else ())
        standbys = self._outside if c.rounds.hosts_workers() else frozenset()
        try:
            decision, change, decided = agree(
                info.store, c.rounds.scope(), members, mine, session, inplace_wanted,
                here.units_per_node, c.timeouts.store_s, quick=quick,
                desk=c.rounds.desk(spec, info), standbys=standbys)
        except LauncherPlanningError as exc:
            c.emit(Event.PLANNING_FAILED, error=str(exc))
            raise
        c.rounds.nodes, self.world = decision.nodes, decision.world
        if watch is not None:
            watch.adopt(dict(decision.speeds))
        c.budget.settle(peer_node_lost=bool(session.excluded - before - here.units(here.cards)))
        book.settle()
        if change is not None:
            c.emit(Event.PLAN_CHOSEN, plan_file=session.plan_file, decided_here=decided,
                   inplace=decision.inplace, **change.event_fields())
        return decision, change, decided

    def _start(self, wg: Any, decision: Decision | None,
               info: Any) -> tuple[tuple[int, ...], float, float]:
        """Publish the generation and start workers for the local devices of the new world
        that have none (starter.py); returns the devices started, when the generation was
        published (Unix seconds) and the seconds the starts took."""
        c, here = self._c, self.here(wg.spec)
        if decision is not None and decision.quiet:   # the workers go on as they are
            wg.workers = c.procs.workers()   # less the lost standby's
            self._running = running_state(c.procs.devices, here.cards_of(decision.world),
                                          here.tp)
            c.status(self._running)
            return (), time.time(), 0.0
        if decision is None:  # plain torchrun: torch's rank assignment, every local worker
            todo = [(w, None) for w in c.assign_ranks(info.store, info.rank, info.world_size,
                                                       wg.spec)]
        else:
            todo = c.starter.planned(c.session, decision, wg, here)
        published_at, t = time.time(), time.perf_counter()
        # TORCHELASTIC_RESTART_COUNT: torchrun's restarts used; with a job the decision's
        # relaunches so far, which every agent agrees on (so every rank of a world scopes
        # torch's env:// store keys alike, a late joiner's included)
        count = c.budget.used if decision is None else decision.launches
        started = c.starter.launch(todo, wg, count, c.session, here)
        if started:
            c.track(c.procs.pids())
        wg.workers = c.procs.workers()
        launch_s = time.perf_counter() - t
        self._running = (running_state(c.procs.devices, here.cards_of(decision.world), here.tp)
                         if decision is not None else "running")
        c.status(self._running)
        return started, published_at, launch_s
