"""ChameleonAgent: torch's LocalElasticAgent, made failure-aware, plan-aware and able to recover
in place. This file is the loop and the wiring; each concern has a room of its own:

    detectors.py     what is watched: hangs, a peer lost on another node, health, leases
    reactions.py     the one decision per tick (a pure function; its docstring has the states)
    rounds.py        rendezvous rounds: reuse on one node, failover, survivors, worker stores
    coordination.py  the agents' agreement on the next plan, in protocol order
    worker_env.py    the environment a worker starts with
    workers.py       the worker processes, polled one by one
    reporter.py      one event and one line per recovery, once the workers resumed

One recovery, each phase timed into the event log:

1. detect   - every worker process is polled on its own (a death stops nobody else), with the
              detectors.
2. classify - once, into a :class:`~.failures.FailureEvent`: a signal death, a hang or a failed
              health check is a lost device (excluded, no restart budget spent); any other exit
              is a crash on a healthy device (same plan, budget spent, as torchrun); without
              ``--job`` every failure is a crash.
3. agree    - a rendezvous round (reused on one node): every agent reports its node, its lost
              devices, its live workers and whether they run on the runtime; the group-rank-0
              agent asks the planner (cached plan first) and publishes one decision.
4. apply    - IN PLACE (every live worker registered with the runtime, ``--recovery inplace``):
              nobody is stopped; the new generation is published on the node's channel with a
              fresh worker store, and workers start only for devices without a live one. The
              survivors regroup, take state from their peers and go on at the first step not
              committed everywhere (runtime/recovery.py).
              RELAUNCH (unmodified scripts, a crash, ``--recovery relaunch``): every local worker
              is stopped (SIGTERM, then SIGKILL after the shutdown timeout) and all start again.
5. report   - when the workers have committed their first step in the new generation.

Workers are started through ``orphan_guard`` so that they die with the agent, even on SIGKILL.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from string import Template
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs, start_processes
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.elastic.utils import macros

from chameleon_elastic import channel
from chameleon_elastic.channel import Generation, Registration
from chameleon_elastic.spec import unit_of, units_of
from chameleon_elastic.timeouts import Timeouts

from . import coordination, detectors
from .coordination import Decision, NodeReport
from .failures import FailureEvent, FailureKind, Trigger, classify_exit
from .health import AlwaysHealthy, HealthCheck
from .node_watch import NodeWatch
from .observe import Event, EventLog, StatusLine
from .orphan_guard import guarded_command
from .plan_env import LocalAssignment, device_id, local_assignments
from .profiler import Profiler
from .reactions import Reaction, Tick, react
from .reporter import Pending, RecoveryReporter
from .rounds import STORE_LOST, Rounds
from .session import JobSession, LauncherPlanningError
from .worker_env import chameleon_vars, torchrun_vars
from .worker_logs import WorkerLogs
from .workers import WorkerProcesses

__all__ = ["ChameleonAgent", "RecoveryMode"]

log = logging.getLogger("chameleon_elastic.launcher.agent")

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
        recovery: RecoveryMode = "inplace",
        timeouts: Timeouts | None = None,
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
        self._health = health if health is not None else AlwaysHealthy()
        self._profiler = profiler
        self._recovery = recovery
        self._rounds = Rounds(rdzv_parameters, self._timeouts, self._status, self._emit)
        self._node: int | None = None           # node id in the initial world (device ids)
        self._procs = WorkerProcesses()
        self._book = detectors.DeviceBook()
        self._hangs = detectors.HangWatch(self._timeouts.hang_s, spec.local_world_size,
                                          "device" if self._tp == 1 else "card")
        self._trouble = detectors.PeerTrouble()
        self._reporter = RecoveryReporter(
            self._emit, self._status, profiler,
            logs_specs.root_log_dir if isinstance(logs_specs, WorkerLogs) else None, self._tp)
        self._charged_crash = False             # a restart was just charged for a crash
        self._exits: dict[int, Any] = {}        # global rank -> Exit, of the last poll
        self._watch: NodeWatch | None = None    # our lease and the others' (etcd-v3)
        self._channel: Any = None               # this node's agent <-> worker store
        self._channel_address = ""
        if session is not None:
            self._channel = dist.TCPStore("127.0.0.1", 0, is_master=True,
                                          wait_for_workers=False,
                                          timeout=self._timeouts.delta("store_s"))
            self._channel_address = f"127.0.0.1:{self._channel.port}"

    # ------------------------------------------------------------------ helpers

    def _emit(self, event: Event, **fields: Any) -> None:
        gen = self._session.plan.generation if self._session is not None else 0
        self._events.emit(event, attempt=max(self._rounds.attempt, 0), generation=gen, **fields)

    def _restarts_used(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def _update_status(self, state: str) -> None:
        spec = self._worker_group.spec
        fields: dict[str, Any] = {
            "restarts": self._restarts_used(), "max_restarts": spec.max_restarts, "state": state,
        }
        if self._session is not None:
            plan = self._session.plan
            fields.update(generation=plan.generation, policy=plan.policy,
                          live=len(plan.live_devices), devices=self._session.devices)
        else:
            fields.update(generation=max(self._rounds.attempt, 0))
        self._status.update(**fields)

    @property
    def _tp(self) -> int:
        """Cards per plan device (``training.tp``; 1 without a job)."""
        return self._session.tp if self._session is not None else 1

    def _nproc(self) -> int:
        return self._worker_group.spec.local_world_size

    def _local_device_ids(self) -> list[int]:
        """This node's cards (its process slots)."""
        return [device_id(self._node or 0, lr, self._nproc()) for lr in range(self._nproc())]

    def _units(self, cards: set[int] | list[int]) -> set[int]:
        return set(units_of(cards, self._tp))

    def _cards(self, units: set[int] | frozenset[int]) -> set[int]:
        """The cards of ``units`` that run here."""
        return {c for c in self._local_device_ids() if unit_of(c, self._tp) in units}

    @property
    def _planned(self) -> bool:
        return self._session is not None and self._session.policy != "restart"

    @property
    def _inplace_wanted(self) -> bool:
        return self._planned and self._recovery == "inplace"

    @property
    def _runtime(self) -> bool:
        """Every live worker has told the channel it runs on the runtime."""
        devices = self._procs.devices
        if self._channel is None or not devices:
            return False
        for device in devices:
            record = channel.read(self._channel, channel.worker_key(device))
            if record is None or Registration.from_dict(record).pid != self._procs.pid(device):
                return False
        return True

    def _event(self, trigger: Trigger, **fields: Any) -> FailureEvent:
        gen = self._session.plan.generation if self._session is not None else 0
        return FailureEvent(trigger, gen, detected_at=time.monotonic(), wall=time.time(),
                            **fields)

    # ------------------------------------------------------------------ one transition

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        """The first launch: agree, then start every local worker."""
        self._transition(None, inplace_wanted=False, expect_reports=False)

    def _transition(self, event: FailureEvent | None, inplace_wanted: bool,
                    expect_reports: bool) -> None:
        """One rendezvous round and what follows it. ``expect_reports``: the workers run on
        the runtime, so the recovery is reported once they have committed a step."""
        wg = self._worker_group
        spec = wg.spec
        began = time.perf_counter()
        info = self._rounds.next(spec, first=self._node is None)
        self._rdzv_handler = spec.rdzv_handler   # torch's, after a failover too
        self._store = info.store
        if self._node is None:
            self._node = info.rank
            if self._planned:
                self._rounds.admit_survivors(spec)
        rdzv_s = time.perf_counter() - began
        plan_s, decision, change = 0.0, None, None
        if self._session is not None:
            t = time.perf_counter()
            decision, change = self._agree(info, inplace_wanted)
            plan_s = time.perf_counter() - t
        if self._channel is not None:   # a lost peer reported before this round is handled
            channel.write(self._channel, channel.TROUBLE, -1)
        self._hangs.reset()
        stop_s = 0.0
        if decision is None or not decision.inplace:
            t = time.perf_counter()
            self._procs.close(timeout=self._timeouts.shutdown_s)
            stop_s = time.perf_counter() - t
        addr, port = self._rounds.open_worker_store(spec, info)
        wg.store, wg.group_rank, wg.group_world_size = info.store, info.rank, info.world_size
        wg.master_addr, wg.master_port = addr, port
        self._emit(Event.RENDEZVOUS, group_rank=info.rank, group_world_size=info.world_size,
                   node=self._node, master_addr=addr, master_port=port, duration_s=rdzv_s)
        t = time.perf_counter()
        started = self._start(decision, info)
        wg.state = WorkerState.HEALTHY
        phases = {"rendezvous_s": rdzv_s, "plan_s": plan_s, "stop_s": stop_s,
                  "launch_s": time.perf_counter() - t}
        if event is not None and decision is not None:
            kept = tuple(sorted(self._procs.devices - set(started)))
            waiting = frozenset(self._procs.devices if expect_reports else ())
            self._reporter.pending = Pending(event, decision, change, kept, started, waiting,
                                             phases)
            if not waiting:
                self._report(self._reporter.finish({}, self._session.plan,
                                                   self._restarts_used()))

    def _agree(self, info: Any, inplace_wanted: bool) -> tuple[Decision, Any]:
        """Report, decide (group rank 0) or adopt (coordination.agree), and log it."""
        session = self._session
        assert session is not None and self._node is not None
        live = self._procs.devices
        before = set(session.excluded)
        mine = NodeReport(
            node=self._node, lost=tuple(sorted(self._book.lost - self._book.rejoining)),
            live=tuple(sorted(self._units(live))), ready=not live or self._runtime,
            reported=channel.read_int(self._channel, channel.REPORTED),
            checkpoint=channel.read_int(self._channel, channel.CHECKPOINT),
            checkpoints=channel.read(self._channel, channel.CHECKPOINTS) is not None,
            why=tuple(sorted(self._book.why.items())))
        try:
            decision, change = coordination.agree(
                info.store, self._rounds.scope(self._worker_group.spec), info.rank,
                info.world_size, mine, session, inplace_wanted, self._nproc() // self._tp,
                self._timeouts.store_s)
        except LauncherPlanningError as exc:
            self._emit(Event.PLANNING_FAILED, error=str(exc))
            raise
        if session.excluded - before - self._units(self._local_device_ids()) and (
                self._charged_crash):
            # the "crash" was our workers failing because a peer node died: that is a lost
            # node, which costs no restart (torchrun would have spent one)
            self._remaining_restarts += 1
            self._charged_crash = False
        self._book.settle()
        if change is not None:
            self._emit(Event.PLAN_CHOSEN, policy=change.plan.policy,
                       plan_file=session.plan_file, lost=list(change.lost),
                       joined=list(change.joined), via_cache=change.cached,
                       decide_s=change.decide_s, candidates=change.candidates,
                       rejected=change.rejected, decided_here=info.rank == 0,
                       inplace=decision.inplace, live_devices=list(change.plan.live_devices),
                       spare_devices=list(change.plan.spare_devices))
        return decision, change

    # ------------------------------------------------------------------ workers

    def _start(self, decision: Decision | None, info: Any) -> tuple[int, ...]:
        """Publish the generation on the channel; start workers for the local devices of its
        world that have none (all of them after a relaunch). Returns the devices started."""
        wg = self._worker_group
        session = self._session
        if decision is None:  # plain torchrun: torch's rank assignment, every local worker
            todo = [(w, None) for w in self._assign_worker_ranks(
                info.store, info.rank, info.world_size, wg.spec)]
        else:
            assert session is not None
            plan = session.plan
            channel.write(self._channel, channel.generation_key(plan.generation), Generation(
                plan.generation, session.plan_file, str(wg.master_addr), int(wg.master_port),
                decision.world, decision.reported, tp=self._tp))
            channel.write(self._channel, channel.NEWEST, plan.generation)
            assigned = local_assignments(plan, self._node or 0, self._nproc(), decision.world,
                                         self._tp)
            for device in self._procs.devices:   # kept workers: their ranks in the new world
                self._procs.set_worker(device, self._worker_of(device, decision))
            todo = [(Worker(local_rank=a.local_rank, global_rank=a.global_rank,
                            role_rank=a.global_rank, world_size=a.world_size,
                            role_world_size=a.world_size), a)
                    for a in assigned if a.device not in self._procs.devices]
        started = self._launch(todo)
        wg.workers = self._procs.workers()
        self._update_status("running")
        return started

    def _worker_of(self, card: int, decision: Decision) -> Worker:
        unit, tp_rank = divmod(card, self._tp)
        rank = decision.world.index(unit) * self._tp + tp_rank
        size = len(decision.world) * self._tp
        worker = Worker(local_rank=card - (self._node or 0) * self._nproc(), global_rank=rank,
                        role_rank=rank, world_size=size, role_world_size=size)
        worker.id = self._procs.pid(card)
        return worker

    def _launch(self, todo: list[tuple[Worker, LocalAssignment | None]]) -> tuple[int, ...]:
        if not todo:
            return ()
        wg = self._worker_group
        spec = wg.spec
        start = time.perf_counter()
        args: dict[int, tuple] = {}
        envs: dict[int, dict[str, str]] = {}
        prefixes: dict[int, str] | None = {} if self._log_line_prefix_template else None
        devices = [device_id(self._node or 0, w.local_rank, self._nproc()) for w, _ in todo]
        for index, (worker, assignment) in enumerate(todo):
            env = torchrun_vars(spec, wg, worker, self._restarts_used())
            self._set_local_rank_env(env, worker.local_rank, spec)
            if self._session is not None and assignment is not None:
                env.update(chameleon_vars(self._session, assignment, self._channel_address))
            if self._profiler is not None:
                env.update(self._profiler.worker_env())
            if prefixes is not None:
                prefixes[index] = Template(self._log_line_prefix_template).safe_substitute(
                    role_name=spec.role, rank=worker.global_rank, local_rank=worker.local_rank)
            envs[index] = env
            args[index] = tuple(macros.substitute(list(spec.args), str(worker.local_rank)))
        self._setup_local_watchdog(envs=envs)
        self._setup_healthcheck()
        if self._channel is not None:
            # a new process is hang-checked from its own first beat: its dead predecessor's
            # count, standing still, made a slow start (imports on a busy machine) look hung
            for device in devices:
                self._channel.delete_key(channel.beat_key(device))
        entrypoint = spec.entrypoint
        if isinstance(entrypoint, str):
            wrapped = {i: guarded_command(entrypoint, a) for i, a in args.items()}
            entrypoint = next(iter(wrapped.values()))[0] if wrapped else entrypoint
            args = {i: w[1] for i, w in wrapped.items()}
        context = start_processes(
            name=spec.role, entrypoint=entrypoint, args=args, envs=envs,
            logs_specs=self._logs_specs, log_line_prefixes=prefixes,
            start_method=self._start_method, numa_options=spec.numa_options,
            duplicate_stdout_filters=spec.duplicate_stdout_filters,
            duplicate_stderr_filters=spec.duplicate_stderr_filters,
        )
        pids = context.pids()
        for index, (worker, _) in enumerate(todo):
            worker.id = pids[index]
        self._procs.add(context, {i: (devices[i], w) for i, (w, _) in enumerate(todo)})
        if self._profiler is not None:
            self._profiler.track(self._procs.pids())
        self._emit(Event.WORKERS_STARTED, local_ranks=[w.local_rank for w, _ in todo],
                   devices=devices, ranks=[w.global_rank for w, _ in todo],
                   world_size=todo[0][0].world_size, master_port=wg.master_port,
                   duration_s=time.perf_counter() - start)
        return tuple(devices)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        super()._shutdown(death_sig, timeout)
        self._procs.close(death_sig, timeout)
        self._rounds.close()
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._procs.close(timeout=self._timeouts.shutdown_s)

    def _start_node_watch(self) -> None:
        """Hold a lease and watch the others' (etcd-v3 only; see node_watch.py)."""
        if self._rounds.params.backend != "etcd-v3" or self._node is None:
            return
        try:
            self._watch = NodeWatch(self._rounds.params, self._node,
                                    on_fenced=self._fence).start()
        except Exception as exc:  # noqa: BLE001 - liveness is an accelerator, not a necessity
            log.warning("node leases unavailable (%s); lost nodes are seen through the "
                        "rendezvous and the workers only", exc)

    def _fence(self) -> None:
        """Our lease is lost (lease thread): stop every worker now, whatever the loop does."""
        self._procs.signal_all(signal.SIGKILL)
        self._emit(Event.FAILURE_SEEN, kind="fenced", node=self._node,
                   reason="this node's lease was lost (cut off from etcd, or frozen): its "
                          "workers were stopped, as their plan may be stale")

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """Every worker polled on its own: a failure stops nobody (torch's context would)."""
        exits = [e for e in self._procs.poll() if e.failure is not None]
        self._exits = {e.worker.global_rank: e for e in exits}
        if exits:
            return RunResult(state=WorkerState.FAILED,
                             failures={e.worker.global_rank: e.failure for e in exits})
        if not self._procs.devices:   # torch's result keys: the workers' global ranks
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={w.global_rank: None for w in worker_group.workers})
        return RunResult(state=WorkerState.HEALTHY)

    def stderr_log(self, global_rank: int) -> str | None:
        """The file that a worker which just failed wrote its stderr to (None: the console)."""
        ended = self._exits.get(global_rank)
        return ended.stderr or None if ended is not None else None

    # ------------------------------------------------------------------ the loop

    def _invoke_run(self, role: str = "default") -> RunResult:
        spec = self._worker_group.spec
        wg = self._worker_group
        self._emit(Event.AGENT_STARTED, entrypoint=spec.get_entrypoint_name(),
                   nproc_per_node=spec.local_world_size, max_restarts=spec.max_restarts,
                   policy=None if self._session is None else self._session.policy,
                   recovery=self._recovery if self._session is not None else None,
                   plan_file=None if self._session is None else self._session.plan_file)
        try:
            self._initialize_workers(wg)
        except LauncherPlanningError as exc:
            self._status.say(f"chameleon-run: {exc}")
            return RunResult(state=WorkerState.FAILED)
        self._start_node_watch()
        while True:
            time.sleep(spec.monitor_interval)
            result = self._monitor_workers(wg)
            if result.state == WorkerState.SUCCEEDED:
                wg.state = result.state
                self._update_status("succeeded")
                if self._watch is not None:   # leave as finished: no loss for the others
                    self._watch.finish()
                    self._watch = None
                self._exit_barrier()
                self._emit(Event.JOB_FINISHED, state="SUCCEEDED",
                           restarts_used=self._restarts_used())
                return result
            try:
                if self._session is not None:
                    self._report(self._reporter.poll(self._channel, self._session.plan,
                                                     self._procs.pids(), self._restarts_used()))
                tick = self._observe(result)
                wg.state = tick.state
                reaction = react(tick)
                if reaction.action == "ask_leases":
                    asked = detectors.lease_verdict(self._watch, self._excluded(),
                                                    self._nproc() // self._tp, self._emit)
                    reaction = react(dataclasses.replace(
                        tick, leases_asked=True, lease=Trigger.NODE_LOST if asked else None))
                outcome = self._apply(reaction, tick, result)
            except (LauncherPlanningError, RendezvousClosedError) as exc:
                if isinstance(exc, RendezvousClosedError):
                    exc = LauncherPlanningError(
                        "the job's rendezvous is closed: the other nodes finished or gave up "
                        "while this node was cut off, so there is nothing to rejoin."
                    )
                return self._end(str(exc))
            if outcome is not None:
                return outcome

    def _excluded(self) -> set[int]:
        return set(self._session.excluded) if self._session is not None else set()

    def _report(self, state: str | None) -> None:
        if state is not None:
            self._trouble.reset()
            self._update_status(state)

    def _observe(self, result: RunResult) -> Tick:
        """One tick's facts, from the detectors; what to do is react()'s."""
        healthy = result.state == WorkerState.HEALTHY
        hung, stall = (self._hangs.check(self._channel, self._procs.pids()) if healthy
                       else ([], None))
        if stall is not None:
            self._update_status(stall)
        bad = set()
        if healthy and self._session is not None:
            bad = detectors.unhealthy_units(self._health, self._book, self._procs.devices,
                                            set(self._local_device_ids()), self._units)
        if self._profiler is not None:
            self._profiler.sample()
        lease = detectors.lease_news(self._watch, self._excluded(), self._nproc() // self._tp,
                                     self._emit)
        state = WorkerState.UNHEALTHY if healthy and (bad or hung) else result.state
        failures = tuple(classify_exit(e.exitcode, e.device, e.local_rank)
                         for _, e in sorted(self._exits.items())) + tuple(hung)
        if state != WorkerState.HEALTHY:
            self._log_failures(failures, bad)
        waiting, trouble, store_lost = 0, False, False
        if state == WorkerState.HEALTHY and lease is None and not self._book.rejoining:
            try:
                waiting = self._worker_group.spec.rdzv_handler.num_nodes_waiting()
            except STORE_LOST as exc:
                self._emit(Event.FAILURE_SEEN, kind="rendezvous_lost",
                           reason=str(exc).splitlines()[0][:300])
                self._rounds.failover(self._worker_group.spec, exc)
                store_lost = True
            if self._session is not None and not waiting and not store_lost:
                grace = max(1.0, 4 * self._worker_group.spec.monitor_interval)
                trouble = self._trouble.check(self._channel, self._session.plan.generation,
                                              grace)
        ended = None
        if state != WorkerState.HEALTHY and self._channel is not None:
            ended = channel.read(self._channel, channel.ENDED)
        return Tick(state=state, failures=failures, hung=frozenset(f.device for f in hung),
                    bad=frozenset(bad), lease=lease, ended=ended, planned=self._planned,
                    inplace_wanted=self._inplace_wanted, runtime=self._runtime,
                    some_succeeded=bool(self._procs.succeeded),
                    restarts_left=self._remaining_restarts,
                    rejoining=frozenset(self._book.rejoining), waiting=waiting,
                    trouble=trouble, store_lost=store_lost, tp=self._tp)

    def _log_failures(self, failures: tuple, bad: set[int]) -> None:
        for f in failures:
            self._emit(Event.FAILURE_SEEN, device=f.device, local_rank=f.local_rank,
                       exitcode=f.exitcode, signal=f.signal, kind=f.kind.value, reason=f.reason)
        for d in sorted(bad):
            self._emit(Event.FAILURE_SEEN, device=d, kind=FailureKind.DEVICE_LOST.value,
                       reason="device failed its health check", exitcode=None, signal=None,
                       local_rank=None)

    def _apply(self, r: Reaction, tick: Tick, result: RunResult) -> RunResult | None:
        """Carry out one reaction; a RunResult ends the run."""
        if r.kill and r.action != "fence":
            self._procs.kill(set(r.kill))
        if r.action == "monitor":
            return None
        if r.action == "end":
            self._emit(Event.PLANNING_FAILED, error=r.reason)
            raise LauncherPlanningError(r.reason)
        if r.action == "fail":
            self._procs.close(timeout=self._timeouts.shutdown_s)
            self._worker_group.state = WorkerState.FAILED
            self._update_status("failed")
            self._emit(Event.JOB_FINISHED, state="FAILED", reason=r.reason,
                       restarts_used=self._restarts_used())
            return result
        if r.action == "fence":
            # the lease thread has killed the workers already; their deaths are ours, not lost
            # devices; rejoin and adopt
            self._procs.close(signal.SIGKILL, timeout=self._timeouts.shutdown_s)
        if r.trigger is Trigger.MEMBERSHIP:
            self._emit(Event.MEMBERSHIP_CHANGE, nodes_waiting=tick.waiting)
        if r.trigger is Trigger.PEER_LOST:
            self._emit(Event.FAILURE_SEEN, kind="peer_lost",
                       reason="a local worker lost a peer that this node does not run")
        failed = tick.state != WorkerState.HEALTHY
        why = {unit_of(f.device, self._tp): f.signal or f.reason.split(",")[0]
               for f in tick.failures if f.kind is FailureKind.DEVICE_LOST}
        if r.lost:
            self._book.note_lost(set(r.lost), set(tick.bad), why)
        event = self._event(r.trigger, lost=r.lost, joined=r.joined,
                            failures=tick.failures if failed else ())
        if r.charge:
            self._remaining_restarts -= 1
            self._charged_crash = True
        try:
            self._recover(event, r.inplace)
        finally:
            self._charged_crash = False
        return None

    def _end(self, sentence: str) -> RunResult:
        """The job cannot go on: one sentence, every worker stopped."""
        self._status.say(f"chameleon-run: {sentence}")
        self._procs.close(timeout=self._timeouts.shutdown_s)
        self._worker_group.state = WorkerState.FAILED
        self._update_status("failed")
        self._emit(Event.JOB_FINISHED, state="FAILED", reason=sentence)
        return RunResult(state=WorkerState.FAILED)

    def _recover(self, event: FailureEvent, inplace: bool) -> None:
        mode = "in place" if inplace else "relaunch"
        self._update_status(f"recovering {mode} ({event.reason})")
        self._transition(event, inplace_wanted=inplace, expect_reports=self._runtime)
