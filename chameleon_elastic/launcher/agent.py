"""ChameleonAgent: torch's LocalElasticAgent, made failure-aware, plan-aware and able to recover
in place. This file is the loop and the wiring; each concern has a room of its own
(docs/architecture.md has the map):

    reactions.py    the one decision per tick: a pure function (its docstring has the states)
    transition.py   one transition in its order: round, agree, stop, store, start, report
    detection/      what is watched: hangs, peers lost elsewhere, health, leases, speeds
    coordination/   rounds (quick ones, failover, worker stores) and the agents' agreement
    workers/        the worker processes: started by device, their environment, preemption
    observation/    one event and one line per recovery, once the workers resumed; metrics

A tick: poll the workers, read the detectors into a Tick, react, apply. A recovery is one
transition: a round, the agreement, then IN PLACE (every live worker on the runtime: nobody is
stopped, the new generation is published on the node's channel, workers start only for devices
without one, the survivors regroup: runtime/recovery/in_place.py) or RELAUNCH (unmodified
scripts, a crash, ``--recovery relaunch``: every local worker starts again).
docs/launcher.md follows one failure through these files.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from typing import TYPE_CHECKING, Any, Literal

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousError

from chameleon_elastic import channel, retries
from chameleon_elastic.exit_status import ExitStatus
from chameleon_elastic.timeouts import Timeouts

from .coordination.exit_barrier import wait_for_the_others
from .coordination.rounds import CLOSED, FINISHED_AWAY, Rounds
from .detection.detectors import Watchers
from .detection.generations import AbandonedGenerations
from .detection.health import AlwaysHealthy, HealthCheck
from .detection.stragglers import StragglerWatch
from .failures import FailureEvent, RestartBudget, Trigger
from .observation.profiler import Profiler
from .observation.reporter import RecoveryReporter, relaunch_line
from .observe import Event, EventLog, StatusLine, agent_started, ended_state
from .plan_env import NodeCards
from .reactions import Reaction, Tick, react
from .session import JobSession, LauncherPlanningError
from .transition import Crew, Transition
from .workers.preemption import PEER_PREEMPTED, PREEMPTION_SIGNALS, Preempted, preempt
from .workers.processes import ExitBell, WorkerProcesses, stop_signal
from .workers.starter import TorchHooks, WorkerStarter
from .workers.worker_logs import WorkerLogs

if TYPE_CHECKING:
    from .observation.metrics import AgentMetrics

__all__ = ["ChameleonAgent", "RecoveryMode"]

RecoveryMode = Literal["inplace", "relaunch"]


class ChameleonAgent(LocalElasticAgent):
    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        rdzv_parameters: RendezvousParameters,
        session: JobSession | None = None,
        events: EventLog | None = None,
        status: StatusLine | None = None,
        health: HealthCheck | None = None,
        profiler: Profiler | None = None,
        metrics: AgentMetrics | None = None,
        recovery: RecoveryMode = "inplace",
        stragglers: bool = True,
        timeouts: Timeouts | None = None,
        max_failed_generations: int = retries.DEFAULT_CAP,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
    ) -> None:
        self._timeouts = timeouts or Timeouts.resolve()
        super().__init__(spec, logs_specs, start_method=start_method,
                         exit_barrier_timeout=exit_barrier_timeout,
                         log_line_prefix_template=log_line_prefix_template,
                         shutdown_timeout=int(self._timeouts.shutdown_s))
        self._session = session
        self._events = events if events is not None else EventLog(None)
        self._status = status if status is not None else StatusLine(enabled=False)
        self._profiler = profiler
        self._metrics = metrics
        self._busy = True                       # in a transition (not ready, /readyz)
        self.exit_status = ExitStatus.FAILED    # of a run the agent ended itself
        self._recovery = recovery
        self._rounds = Rounds(rdzv_parameters, self._timeouts, self._status, self._emit)
        self._procs = WorkerProcesses()
        tp = session.tp if session is not None else 1   # cards per plan device
        self._watchers = Watchers(self._timeouts, NodeCards(0, spec.local_world_size, tp),
                                  health or AlwaysHealthy(), self._emit, self._update_status,
                                  StragglerWatch(session.spec.stragglers)
                                  if stragglers and session is not None else None,
                                  note=self._status.update)
        self._channel = channel.host(self._timeouts) if session is not None else None
        self._reporter = RecoveryReporter(
            self._emit, self._status, profiler,
            logs_specs.root_log_dir if isinstance(logs_specs, WorkerLogs) else None, tp,
            self._channel, session)
        self._budget = RestartBudget(spec.max_restarts, spec.max_restarts)
        self._exits: dict[int, Any] = {}        # global rank -> Exit, of the last poll
        self._abandoned = AbandonedGenerations(max_failed_generations, self._channel)
        starter = WorkerStarter(
            self._procs, self._channel, TorchHooks(self._set_local_rank_env, self._before_start,
                       self._log_line_prefix_template, logs_specs, start_method),
            self._emit, lambda: self._profiler.worker_env() if self._profiler is not None else {})
        self._transition = Transition(Crew(
            self._rounds, self._procs, self._watchers, self._budget, self._reporter, starter,
            self._timeouts, self._emit, self._update_status, self._report, session,
            self._channel, self._assign_worker_ranks,
            self._profiler.track if self._profiler is not None else lambda pids: None,
            self._abandoned), planned=self._planned)

    def _emit(self, event: Event, **fields: Any) -> None:
        gen = self._session.plan.generation if self._session is not None else 0
        self._events.emit(event, attempt=max(self._rounds.attempt, 0), generation=gen, **fields)

    def _update_status(self, state: str) -> None:
        self._status.show(state, self._session, max(self._rounds.attempt, 0), self._budget.used,
                          self._budget.max_restarts)

    @property
    def _here(self) -> NodeCards:
        return self._transition.here(self._worker_group.spec)

    @property
    def _planned(self) -> bool:
        return self._session is not None and self._session.policy != "restart"

    # ------------------------------------------------------------------ one transition

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        """The first launch: agree, then start every local worker."""
        self._transition_to(None, inplace_wanted=False, expect_reports=False)

    def _transition_to(self, event: FailureEvent | None, inplace_wanted: bool,
                       expect_reports: bool, quick: bool = False) -> None:
        self._busy = True
        try:
            info = self._transition.run(self._worker_group, event, inplace_wanted,
                                        expect_reports, quick)
        finally:
            self._busy = False
        self._rdzv_handler = self._worker_group.spec.rdzv_handler   # after a failover too
        self._store = info.store

    def _before_start(self, envs: dict) -> None:
        """torch's watchdog and health-check servers, as its ``_start_workers`` sets them up."""
        self._setup_local_watchdog(envs=envs)
        self._setup_healthcheck()

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        death_sig = stop_signal(death_sig, planned=self._session is not None)   # not a Ctrl-C
        super()._shutdown(death_sig, timeout)
        self._procs.close(death_sig, timeout)
        self._rounds.close()
        self._watchers.leave(finished=False)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._procs.close(timeout=self._timeouts.shutdown_s)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result, self._exits = self._procs.run_result(worker_group.workers)
        return result

    def ready(self) -> bool:
        """This node's workers train under the current generation (``/readyz``)."""
        return (not self._busy and self._worker_group.state == WorkerState.HEALTHY
                and self._reporter.pending is None and bool(self._procs.devices))

    def stderr_log(self, global_rank: int) -> str | None:
        """The file that a worker which just failed wrote its stderr to (None: the console)."""
        ended = self._exits.get(global_rank)
        return ended.stderr or None if ended is not None else None

    # ------------------------------------------------------------------ the loop

    def _invoke_run(self, role: str = "default") -> RunResult:
        try:
            return self._run_loop()
        except SignalException as exc:
            if isinstance(exc, Preempted) or exc.sigval not in PREEMPTION_SIGNALS:
                raise
            preempt(self._channel, self._procs, exc.sigval.name, exc.sigval,
                    self._timeouts.shutdown_s, self._emit)

    def _run_loop(self) -> RunResult:
        wg = self._worker_group
        self._emit(Event.AGENT_STARTED, **agent_started(wg.spec, self._session, self._recovery))
        try:
            self._initialize_workers(wg)
        except LauncherPlanningError as exc:
            return self._end(str(exc), exc.status)
        except RendezvousError as exc:   # chameleon-run's last line says why; the log, that it ended
            self._end(f"the rendezvous failed ({type(exc).__name__})", say=False)
            raise
        if self._transition.node is not None:
            self._watchers.watch_leases(self._rounds.params, self._transition.node,
                                        self._procs.signal_all)
        with ExitBell() as bell:
            return self._loop(wg, bell)

    def _loop(self, wg: WorkerGroup, bell: ExitBell) -> RunResult:
        spec = wg.spec
        while True:
            bell.wait(spec.monitor_interval)
            result = self._monitor_workers(wg)
            if any(e.exitcode == ExitStatus.PREEMPTED for e in self._exits.values()):
                preempt(self._channel, self._procs, PEER_PREEMPTED, signal.SIGTERM,
                        self._timeouts.shutdown_s, self._emit, runtime=True)
            if result.state == WorkerState.SUCCEEDED:
                if not self._rounds.stays_member(bool(self._procs.succeeded),
                                                 self._planned and self._watchers.lease is not None):
                    return self._finished(result)
                self._update_status("no device left here")   # a member with none, till the end
                result = RunResult(state=WorkerState.HEALTHY)
            try:
                if self._session is not None:
                    self._report(self._reporter.poll(self._channel, self._session.plan,
                                                     self._procs.pids(), self._budget.used))
                if self._metrics is not None:
                    self._metrics.tick_agent(self._channel, self._procs.devices, self._session,
                                             self._rounds.attempt, wg.workers)
                tick = self._observe(result)
                wg.state = tick.state
                reaction = react(tick)
                if reaction.action == "ask_leases":
                    asked = self._watchers.verdict(self._session, self._here, self._rounds.nodes)
                    reaction = react(dataclasses.replace(
                        tick, leases_asked=True, lease=Trigger.NODE_LOST if asked else None))
                outcome = self._apply(reaction, tick, result)
            except LauncherPlanningError as exc:
                return self._end(str(exc), exc.status)
            except RendezvousClosedError:   # cut off, or fenced as another node finished
                return self._closed()
            if outcome is not None:
                return outcome

    def _report(self, state: str | None) -> None:
        """A recovery was reported (``state``: the status line's): the plan cache of the new
        plan may be filled now that the workers train again."""
        if state is not None:
            self._watchers.trouble.reset()
            self._update_status(state)
            if self._session is not None:
                self._session.warm()

    def _observe(self, result: RunResult) -> Tick:
        """One tick's facts, from the detectors; what to do is react()'s."""
        if self._profiler is not None:
            self._profiler.sample()
        spec = self._worker_group.spec
        return self._watchers.tick(
            result.state, [e for _, e in sorted(self._exits.items())], self._procs.pids(),
            self._here, self._session, self._channel, lambda: self._rounds.nodes_waiting(spec),
            self._rounds.quick_called, max(1.0, 4 * spec.monitor_interval),
            finished=self._rounds.finished_elsewhere, members=self._rounds.nodes,
            planned=self._planned, inplace_wanted=self._planned and self._recovery == "inplace",
            runtime=self._transition.runtime(),
            some_succeeded=bool(self._procs.succeeded), restarts_left=self._budget.left)

    def _apply(self, r: Reaction, tick: Tick, result: RunResult) -> RunResult | None:
        """Carry out one reaction; a RunResult ends the run."""
        if r.kill and r.action != "fence":
            self._procs.kill(set(r.kill))
        if r.action == "monitor":
            return None
        if r.action == "end":   # the workers found that training cannot go on
            self._emit(Event.PLANNING_FAILED, error=r.reason)
            return self._end(r.reason or "training cannot go on", ExitStatus(r.status))
        if r.action == "fail":   # torchrun's end: its error report names the failures
            return self._end(r.reason or "max restarts used up", say=False, result=result)
        if r.action == "fence":
            # the lease thread has killed the workers already; their deaths are ours, not lost
            # devices; rejoin and adopt
            self._procs.close(signal.SIGKILL, timeout=self._timeouts.shutdown_s)
        gen = self._session.plan.generation if self._session is not None else 0
        if r.trigger is Trigger.MEMBERSHIP:
            self._emit(Event.MEMBERSHIP_CHANGE, nodes_waiting=tick.waiting)
        elif r.trigger is Trigger.PEER_LOST:   # the workers' own words (a missed deadline)
            self._emit(Event.FAILURE_SEEN, kind="peer_lost", reason=self._abandoned.cause(
                gen, (), peer_lost=True) or "a local worker lost a peer")
        if r.lost:
            self._watchers.book.note_lost(set(r.lost), set(tick.bad), tick.failures, self._here.tp)
        event = FailureEvent(r.trigger, gen, wall=time.time(), lost=r.lost, joined=r.joined,
                             failures=tick.failures if tick.state != WorkerState.HEALTHY else (),
                             notes=tick.slow_why)
        if self._abandoned.past_cap(r, tick, gen, self._here.cards):
            return self._end(self._abandoned.sentence())
        if r.charge:
            self._budget.charge()
        if self._session is None and event.failures:   # torchrun names what died
            self._status.say(f"chameleon-run: {relaunch_line(event.failures, self._budget)}")
        self._update_status(f"recovering ({event.reason})")   # in place or not: the round says
        try:
            self._transition_to(event, r.inplace, self._transition.runtime(), r.quick)
        finally:
            self._budget.charged = False
        return None

    def _finished(self, result: RunResult) -> RunResult:
        """The job is over here: wait for the other agents, not for nodes gone (exit_barrier)."""
        self._worker_group.state = result.state
        self._update_status(ended_state(self._procs.succeeded, self._rounds.finished_elsewhere))
        self._rounds.finish(bool(self._procs.succeeded), self._worker_group.spec)
        members = self._worker_group.group_world_size
        wait_for_the_others(self._store, members, self._exit_barrier_timeout,
                            lambda: self._watchers.nodes_lost(members))
        self._watchers.leave(finished=True)   # no loss for the others
        self._emit(Event.JOB_FINISHED, state="SUCCEEDED", restarts_used=self._budget.used)
        return result

    def _closed(self) -> RunResult:
        """The rendezvous closed while this node was away: the job finished, or gave up."""
        if not self._rounds.finished_elsewhere():
            return self._end(CLOSED)
        self._status.say(f"chameleon-run: {FINISHED_AWAY}")
        self._procs.close(timeout=self._timeouts.shutdown_s)   # they waited for a round
        return self._finished(self._monitor_workers(self._worker_group))

    def _end(self, sentence: str, status: ExitStatus = ExitStatus.FAILED, *, say: bool = True,
             result: RunResult | None = None) -> RunResult:
        """The job cannot go on: one sentence (``say``), every worker stopped, the status."""
        self.exit_status = status
        if say:
            self._status.say(f"chameleon-run: {sentence}")
        self._procs.close(timeout=self._timeouts.shutdown_s)
        self._worker_group.state = WorkerState.FAILED
        self._update_status("failed")
        self._emit(Event.JOB_FINISHED, state="FAILED", reason=sentence,
                   restarts_used=self._budget.used)
        return result or RunResult(state=WorkerState.FAILED)
