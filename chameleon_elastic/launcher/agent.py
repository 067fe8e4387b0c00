"""ChameleonAgent: torch's LocalElasticAgent, made failure-aware, plan-aware and able to recover
in place.

One recovery, each phase timed into the event log:

1. detect   - the monitor loop polls every worker process on its own (a death stops nobody
              else), checks the device health hook, the rendezvous for waiting agents, and the
              agent channel for workers that lost a peer this node does not run.
2. classify - once, into a :class:`~.failures.FailureEvent`: a signal death or a failed health
              check is a lost device (excluded, no restart budget spent); any other exit is a
              crash on a healthy device (same plan, budget spent, as torchrun); without
              ``--job`` every failure is a crash.
3. agree    - a rendezvous round (reused on one node): every agent reports its node, its lost
              devices, its live workers and whether they run on the runtime; the group-rank-0
              agent asks the planner (cached plan first) and publishes one decision: the plan,
              the world in rank order, in place or relaunch (:mod:`.coordination`).
4. apply    - IN PLACE (every live worker registered with the runtime, ``--recovery inplace``):
              nobody is stopped; the new generation is published on the node's channel with a
              fresh worker store, and workers start only for devices without a live one (a
              device that came back). The survivors regroup, take state from their peers and go
              on at the first step not committed everywhere (runtime/recovery.py).
              RELAUNCH (unmodified scripts, a crash, ``--recovery relaunch``): every local worker
              is stopped (SIGTERM, then SIGKILL after the shutdown timeout) and all start again.
5. report   - when the workers have committed their first step in the new generation, one
              ``recovered`` event and one plain line for people.

Every generation gets a FRESH worker store: the group-rank-0 agent opens a new TCPStore on an
OS-chosen port. torch keeps one shared store and one MASTER_PORT for the whole job, so a
restarted worker can read the previous attempt's gloo addresses and hang or fail with
"connectFullMesh ... Connection refused"; a new store cannot hold them. The store lives in the
agent, never in a worker, so a crashing rank 0 takes no store with it. Workers are started
through ``orphan_guard`` so that they die with the agent, even on SIGKILL.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from string import Template
from typing import Any, Literal

import psutil
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
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
)
from torch.distributed.elastic.utils import macros

from chameleon_elastic import channel, torch_compat
from chameleon_elastic.channel import Generation, Registration, Resumed
from chameleon_elastic.rendezvous.handler import handler_for
from chameleon_elastic.spec import unit_of, units_of
from chameleon_elastic.timeouts import Timeouts

from . import coordination
from .coordination import Decision, NodeReport
from .failures import FailureEvent, FailureKind, Trigger, WorkerFailure, classify_exit
from .health import AlwaysHealthy, HealthCheck
from .node_watch import NodeWatch
from .observe import Event, EventLog, StatusLine, name_devices, recovery_line
from .orphan_guard import guarded_command
from .plan_env import LocalAssignment, device_id, local_assignments
from .profiler import Profiler
from .session import JobSession, LauncherPlanningError, PlanChange
from .waiting import RendezvousWait
from .worker_logs import WorkerLogs
from .workers import WorkerProcesses

__all__ = ["ChameleonAgent", "RecoveryMode"]

log = logging.getLogger("chameleon_elastic.launcher.agent")

RecoveryMode = Literal["inplace", "relaunch"]
_STORE_FAILOVER_ATTEMPTS = 3
# How long a worker past its hang timeout must look awake (running, in the kernel) before it
# counts as hung: long enough for a peer's reaction to its partner's death to pass.
_HANG_CONFIRM_S = 1.0


def _stall_shown_after(hang_s: float) -> float:
    """How long a worker may go without progress before the status line names it, and the
    step at which the figure is renewed: 10 s, or half a shorter hang timeout."""
    return min(10.0, hang_s / 2)


# What an unreachable rendezvous store raises: torch's wrapped error, or the raw TCPStore one
# when the store dies between two of the handler's own calls.
_STORE_LOST = (RendezvousConnectionError, dist.DistNetworkError)


@dataclass
class _DeviceBook:
    """This node's devices (plan devices: units under tensor parallelism) out of the plan, and
    why: one home for what used to be four flags."""

    lost: set[int]          # lost to a signal (for good) or to the health check
    unhealthy: set[int]     # the part of ``lost`` that the health check excluded
    rejoining: set[int]     # unhealthy devices that pass the check again
    why: dict[int, str]     # how each lost device was lost ("SIGKILL", "health check", ...)

    def settle(self) -> None:
        """The rejoining devices are back in: the next report no longer calls them lost."""
        self.lost -= self.rejoining
        self.unhealthy -= self.rejoining
        for device in self.rejoining:
            self.why.pop(device, None)
        self.rejoining.clear()


@dataclass
class _Pending:
    """A recovery whose workers have not yet committed their first step."""

    event: FailureEvent
    decision: Decision
    change: PlanChange | None
    kept: tuple[int, ...]
    started: tuple[int, ...]
    waiting: frozenset[int]      # local devices whose Resumed record is awaited
    phases: dict[str, float]


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
        self._rdzv_parameters = rdzv_parameters
        self._session = session
        self._events = events if events is not None else EventLog(None)
        self._status = status if status is not None else StatusLine(enabled=False)
        self._health = health if health is not None else AlwaysHealthy()
        self._profiler = profiler
        self._recovery = recovery
        self._attempt = -1                      # rendezvous rounds so far, minus one
        self._node: int | None = None           # node id in the initial world (device ids)
        self._worker_store: Any = None          # this generation's TCPStore (group rank 0 only)
        self._procs = WorkerProcesses()
        self._book = _DeviceBook(set(), set(), set(), {})
        self._last_info: Any = None             # last RendezvousInfo (reused on one node)
        self._reused_round = False
        self._charged_crash = False             # a restart was just charged for a crash
        self._pending: _Pending | None = None
        self._last_change: PlanChange | None = None
        self._exits: dict[int, Any] = {}        # global rank -> Exit, of the last poll
        self._trouble_since: float | None = None
        self._beats: dict[int, tuple[int, float]] = {}  # device -> (progress count, since)
        # device -> (first look awake without progress, its CPU seconds then)
        self._awake: dict[int, tuple[float, float]] = {}
        self._stall_shown: dict[int, int] = {}  # device -> last stall bucket on the status line
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
        self._events.emit(event, attempt=max(self._attempt, 0), generation=gen, **fields)

    def _restarts_used(self) -> int:
        spec = self._worker_group.spec
        return spec.max_restarts - self._remaining_restarts

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
            fields.update(generation=max(self._attempt, 0))
        self._status.update(**fields)

    def _key_scope(self) -> str:
        # Dynamic rendezvous stores are already scoped by round; the static one is not.
        backend = self._worker_group.spec.rdzv_handler.get_backend()
        reused = backend == "static" or self._reused_round
        return f"chameleon/{self._attempt}/" if reused else "chameleon/"

    def _nproc(self) -> int:
        return self._worker_group.spec.local_world_size

    @property
    def _tp(self) -> int:
        """Cards per plan device (``training.tp``; 1 without a job)."""
        return self._session.tp if self._session is not None else 1

    def _local_device_ids(self) -> list[int]:
        """This node's cards (its process slots)."""
        node = self._node or 0
        return [device_id(node, lr, self._nproc()) for lr in range(self._nproc())]

    def _units(self, cards: set[int] | list[int]) -> set[int]:
        """The plan devices (units of ``tp`` cards) of ``cards``."""
        return set(units_of(cards, self._tp))

    def _cards(self, units: set[int]) -> set[int]:
        """The cards of ``units`` that run here."""
        return {c for c in self._local_device_ids() if unit_of(c, self._tp) in units}

    @property
    def _inplace_wanted(self) -> bool:
        return (self._session is not None and self._session.policy != "restart"
                and self._recovery == "inplace")

    def _registered(self, devices: set[int]) -> bool:
        """Every worker of ``devices`` has told the channel it runs on the runtime."""
        if self._channel is None or not devices:
            return False
        for device in devices:
            record = channel.read(self._channel, channel.worker_key(device))
            if record is None or Registration.from_dict(record).pid != self._procs.pid(device):
                return False
        return True

    # ------------------------------------------------------------------ rendezvous

    def _next_rendezvous(self, spec: WorkerSpec):
        # One node at most: no other agent can join or leave, so the previous round's result is
        # still the truth; skipping the store round-trips makes a restart several times faster.
        if self._rdzv_parameters.max_nodes == 1 and self._last_info is not None:
            self._reused_round = True
            return self._last_info
        self._reused_round = False
        if self._node is None:   # the job's first round: say what it waits for
            with RendezvousWait(spec.rdzv_handler, self._rdzv_parameters, self._status):
                self._last_info = self._rendezvous_with_failover(spec)
        else:
            self._last_info = self._rendezvous_with_failover(spec)
        return self._last_info

    def _rendezvous_with_failover(self, spec: WorkerSpec):
        deadline = time.monotonic() + self._timeouts.failover_s
        for attempt in range(_STORE_FAILOVER_ATTEMPTS + 1):
            try:
                return spec.rdzv_handler.next_rendezvous()
            except _STORE_LOST as exc:
                if (attempt == _STORE_FAILOVER_ATTEMPTS or time.monotonic() > deadline
                        or spec.rdzv_handler.get_backend() == "static"):
                    raise
                self._failover_rendezvous(spec, exc)
        raise AssertionError("unreachable")

    def _failover_rendezvous(self, spec: WorkerSpec, exc: BaseException) -> None:
        """The rendezvous store is unreachable: rebuild the handler from the same parameters."""
        start = time.perf_counter()
        old = spec.rdzv_handler
        try:
            torch_compat.stop_heartbeats(old)   # the old store is gone; stop pinging it
        except (RuntimeError, OSError) as stop_exc:
            log.debug("stopping heartbeats to the lost store failed: %s", stop_exc)
        spec.rdzv_handler = handler_for(self._rdzv_parameters)
        self._rdzv_handler = spec.rdzv_handler
        self._last_info = None
        self._emit(Event.RENDEZVOUS_FAILOVER, error=str(exc).splitlines()[0][:300],
                   duration_s=time.perf_counter() - start)

    def _admit_survivors(self) -> None:
        """After the first round of a planned job, later rounds close with whoever is left.

        ``--nnodes N`` (or ``M:N``) is the size the job starts at. torch keeps the minimum for
        every round, so after losing a node of an ``--nnodes 2`` job the survivors would wait for
        a second node until the join timeout (10 minutes), then fail. Planning around lost
        devices is what a job file is for: the survivors go on with the devices they have, and a
        node that comes back joins at the next round as under ``1:N``. Without a job, or with
        ``--policy restart``, torchrun's meaning stays."""
        if self._session is None or self._session.policy == "restart":
            return
        self._rdzv_parameters.min_nodes = 1   # a failover's new handler keeps it too
        torch_compat.set_min_nodes(self._worker_group.spec.rdzv_handler, 1)

    def _open_worker_store(self, store, group_rank: int, info) -> tuple[str, int]:
        """A fresh TCPStore per generation, hosted by the group-rank-0 agent; (addr, port)."""
        spec = self._worker_group.spec
        key = self._key_scope() + "worker_store"
        self._worker_store = None  # drop the previous generation's server first
        if group_rank == 0:
            addr = spec.master_addr or info.bootstrap_store_info.master_addr
            server = dist.TCPStore(host_name=addr, port=0, is_master=True,
                                   wait_for_workers=False, multi_tenant=False,
                                   timeout=self._timeouts.delta("store_s"))
            self._worker_store = server
            store.set(key, json.dumps([addr, server.port]))
        addr, port = json.loads(store.get(key))
        return str(addr), int(port)

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
        self._attempt += 1
        began = time.perf_counter()
        info = self._next_rendezvous(spec)
        store, group_rank, group_world = info.store, info.rank, info.world_size
        self._store = store
        if self._node is None:
            self._node = group_rank
            self._admit_survivors()
        rdzv_s = time.perf_counter() - began
        plan_s = 0.0
        decision = None
        if self._session is not None:
            t = time.perf_counter()
            decision = self._agree(store, group_rank, group_world, inplace_wanted)
            plan_s = time.perf_counter() - t
        if self._channel is not None:   # a lost peer reported before this round is handled
            channel.write(self._channel, channel.TROUBLE, -1)
        self._beats.clear()             # a recovery is no hang: progress is timed afresh
        self._awake.clear()
        self._stall_shown.clear()
        stop_s = 0.0
        if decision is None or not decision.inplace:
            t = time.perf_counter()
            self._procs.close(timeout=self._timeouts.shutdown_s)
            stop_s = time.perf_counter() - t
        addr, port = self._open_worker_store(store, group_rank, info)
        wg.store, wg.group_rank, wg.group_world_size = store, group_rank, group_world
        wg.master_addr, wg.master_port = addr, port
        self._emit(Event.RENDEZVOUS, group_rank=group_rank, group_world_size=group_world,
                   node=self._node, master_addr=addr, master_port=port, duration_s=rdzv_s)
        t = time.perf_counter()
        started = self._start(decision, store, group_rank, group_world)
        wg.state = WorkerState.HEALTHY
        phases = {"rendezvous_s": rdzv_s, "plan_s": plan_s, "stop_s": stop_s,
                  "launch_s": time.perf_counter() - t}
        if event is not None and decision is not None:
            kept = tuple(sorted(self._procs.devices - set(started)))
            waiting = frozenset(self._procs.devices if expect_reports else ())
            self._pending = _Pending(event, decision, self._last_change, kept, started,
                                     waiting, phases)
            if not waiting:
                self._finish_recovery({})

    def _agree(self, store, group_rank: int, group_world: int, inplace_wanted: bool) -> Decision:
        """Report, decide (group rank 0) or adopt; see coordination.py."""
        session = self._session
        assert session is not None and self._node is not None
        scope = self._key_scope()
        fence = getattr(store, "underlying_store", store)   # outlives rounds
        seen, newest = coordination.read_record(fence)
        if newest is not None and newest.plan is not None and (
                newest.plan.generation > session.plan.generation):
            session.adopt(newest.plan, newest.excluded)   # catch up before deciding anything
        live = self._procs.devices
        before = set(session.excluded)
        coordination.report(store, scope, group_rank, NodeReport(
            node=self._node, lost=tuple(sorted(self._book.lost - self._book.rejoining)),
            live=tuple(sorted(self._units(live))), ready=not live or self._registered(live),
            reported=channel.read_int(self._channel, channel.REPORTED),
            checkpoint=channel.read_int(self._channel, channel.CHECKPOINT),
            checkpoints=channel.read(self._channel, channel.CHECKPOINTS) is not None,
            why=tuple(sorted(self._book.why.items()))))
        change: PlanChange | None
        try:
            if group_rank == 0:
                reports = coordination.collect(store, scope, group_world)
                units = self._nproc() // self._tp
                lost, joined = coordination.losses(reports, session.excluded, session.devices,
                                                   units)
                change = session.apply(lost=lost, joined=joined)
                if change is None and coordination.inplace_possible(reports, inplace_wanted):
                    change = session.renew()   # the workers regroup: a new generation
                decision = coordination.decide(session.plan, session.excluded, reports,
                                               inplace_wanted,
                                               coordination.reasons(reports, lost, units))
                if decision.error is None:
                    coordination.commit_record(fence, seen, decision)
                coordination.publish(store, scope, decision)
            else:
                decision = coordination.adopt(store, scope, self._timeouts.store_s)
                if decision.error or decision.plan is None:
                    raise LauncherPlanningError(decision.error or "no plan was published")
                change = session.adopt(decision.plan, decision.excluded)
            if decision.error:
                raise LauncherPlanningError(decision.error)
        except coordination.Fenced as exc:
            self._emit(Event.PLANNING_FAILED, error=str(exc))
            raise LauncherPlanningError(str(exc)) from exc
        except LauncherPlanningError as exc:
            self._emit(Event.PLANNING_FAILED, error=str(exc))
            if group_rank == 0:
                coordination.publish(store, scope, Decision(None, (), (), False, None, str(exc)))
            raise
        newly_remote = session.excluded - before - self._units(self._local_device_ids())
        if newly_remote and self._charged_crash:
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
                       rejected=change.rejected, decided_here=group_rank == 0,
                       inplace=decision.inplace, live_devices=list(change.plan.live_devices),
                       spare_devices=list(change.plan.spare_devices))
        self._last_change = change
        return decision

    # ------------------------------------------------------------------ workers

    def _start(self, decision: Decision | None, store, group_rank: int,
               group_world: int) -> tuple[int, ...]:
        """Publish the generation on the channel; start workers for the local devices of its
        world that have none (all of them after a relaunch). Returns the devices started."""
        wg = self._worker_group
        spec = wg.spec
        session = self._session
        if decision is None:  # plain torchrun: torch's rank assignment, every local worker
            todo = [(w, None) for w in self._assign_worker_ranks(store, group_rank, group_world,
                                                                 spec)]
        else:
            assert session is not None
            plan = session.plan
            channel.write(self._channel, channel.generation_key(plan.generation), Generation(
                plan.generation, session.plan_file, str(wg.master_addr), int(wg.master_port),
                decision.world, decision.reported, tp=self._tp))
            channel.write(self._channel, channel.NEWEST, plan.generation)
            assigned = local_assignments(plan, self._node or 0, spec.local_world_size,
                                         decision.world, self._tp)
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
        session = self._session
        node = self._node or 0
        for index, (worker, assignment) in enumerate(todo):
            env: dict[str, str] = {
                "RANK": str(worker.global_rank),
                "GROUP_RANK": str(wg.group_rank),
                "ROLE_RANK": str(worker.role_rank),
                "ROLE_NAME": spec.role,
                "LOCAL_WORLD_SIZE": str(spec.local_world_size),
                "WORLD_SIZE": str(worker.world_size),
                "GROUP_WORLD_SIZE": str(wg.group_world_size),
                "ROLE_WORLD_SIZE": str(worker.role_world_size),
                "MASTER_ADDR": str(wg.master_addr),
                "MASTER_PORT": str(wg.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(self._restarts_used()),
                "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
                "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
                "TORCHELASTIC_USE_AGENT_STORE": str(True),
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv(
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            }
            self._set_local_rank_env(env, worker.local_rank, spec)
            if "OMP_NUM_THREADS" in os.environ:
                env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
            if session is not None and assignment is not None:
                env.update(channel.chameleon_env(session.plan, assignment.role,
                                                 session.plan_file, assignment.unit_ranks,
                                                 assignment.tp_rank))
                env.update(channel.job_env(session.spec))
                env[channel.AGENT_STORE_ENV] = self._channel_address
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
            for worker, _ in todo:
                device = device_id(node, worker.local_rank, spec.local_world_size)
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
        devices = []
        for index, (worker, _) in enumerate(todo):
            worker.id = pids[index]
            devices.append(device_id(node, worker.local_rank, spec.local_world_size))
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
        self._worker_store = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def _start_node_watch(self) -> None:
        """Hold a lease and watch the others' (etcd-v3 only; see node_watch.py)."""
        if self._rdzv_parameters.backend != "etcd-v3" or self._node is None:
            return
        try:
            self._watch = NodeWatch(self._rdzv_parameters, self._node,
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

    def _lease_news(self) -> FailureEvent | None:
        """A lost node or our own lost lease, classified; None when the leases say nothing."""
        if self._watch is None:
            return None
        lost, fenced = self._watch.changes()
        if fenced:   # _fence has stopped the workers and logged it
            return self._event(Trigger.FENCED)
        units = self._nproc() // self._tp
        excluded = self._session.excluded if self._session is not None else set()
        news = [info for info in lost if info.get("node") is None or not {
            device_id(int(info["node"]), u, units) for u in range(units)} <= excluded]
        for info in news:   # a node whose devices are out already is no news
            self._emit(Event.FAILURE_SEEN, kind="node_lost", node=info.get("node"),
                       reason=f"lease of {info['node_id']} expired")
        return self._event(Trigger.NODE_LOST) if news else None

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._procs.close(timeout=self._timeouts.shutdown_s)

    # ------------------------------------------------------------------ monitoring

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

    def _classify(self, result: RunResult) -> list[WorkerFailure]:
        return [classify_exit(e.exitcode, e.device, e.local_rank)
                for _, e in sorted(self._exits.items())]

    def _health_tick(self) -> set[int]:
        """Local working devices (units) with a card failing the health check now (only with
        --job; the check names cards)."""
        if self._session is None:
            return set()
        bad = self._units(set(self._health.unhealthy(self._procs.devices)))
        if self._book.unhealthy:
            still_bad = self._units(set(self._health.unhealthy(set(self._local_device_ids()))))
            self._book.rejoining |= self._book.unhealthy - still_bad
        return bad

    def _trouble(self) -> bool:
        """A local worker lost a peer in the current generation and no agent has acted for a
        grace period: a peer this node does not run is gone (another node)."""
        if self._channel is None or self._session is None:
            return False
        seen = channel.read_int(self._channel, channel.TROUBLE)
        if seen is None or seen < self._session.plan.generation:
            self._trouble_since = None
            return False
        now = time.monotonic()
        if self._trouble_since is None:
            self._trouble_since = now
        grace = max(1.0, 4 * self._worker_group.spec.monitor_interval)
        return now - self._trouble_since >= grace

    def _poll_pending(self) -> None:
        p = self._pending
        if p is None or self._session is None:
            return
        gen = self._session.plan.generation
        records = {}
        for device in p.waiting:
            if device not in self._procs.devices:
                continue  # died meanwhile: the next recovery reports
            value = channel.read(self._channel, channel.resumed_key(gen, device))
            if value is None or Resumed.from_dict(value).pid != self._procs.pid(device):
                return
            records[device] = Resumed.from_dict(value)
        self._finish_recovery(records)

    def _finish_recovery(self, records: dict[int, Resumed]) -> None:
        p = self._pending
        assert p is not None and self._session is not None
        self._pending = None
        self._trouble_since = None
        # from the earliest sign: a survivor noticing, or a hung worker's last progress
        failed_at = min([p.event.wall, *(r.noticed_at for r in records.values() if r.noticed_at),
                         *(f.since for f in p.event.failures if f.since)])
        resumed_at = max((r.committed_at - r.first_step_s for r in records.values()
                          if r.committed_at), default=None)
        worst = max(records.values(), key=lambda r: r.regroup_s + r.transfer_s, default=None)
        resumed_step = worst.resumed_step if worst else None
        fields = dict(
            reason=p.event.reason, mode="inplace" if p.decision.inplace else "relaunch",
            kept_devices=list(p.kept), started_devices=list(p.started),
            resumed_step=resumed_step,
            transfer_bytes=sum(r.moved_bytes for r in records.values()),
            moved_layers=worst.moved_layers if worst else 0,
            source=worst.source if worst else None,
            rolled_forward=sorted(d for d, r in records.items() if r.rolled_forward),
            redone_steps=worst.redone_steps if worst else 0,
            detect_s=max(0.0, p.event.wall - failed_at),
            regroup_s=worst.regroup_s if worst else None,
            transfer_s=worst.transfer_s if worst else None,
            first_step_s=max((r.first_step_s for r in records.values()), default=None),
            total_s=None if resumed_at is None else resumed_at - failed_at,
            restarts_used=self._restarts_used(), **p.phases)
        self._emit(Event.RECOVERED, **fields)
        if self._profiler is not None and p.decision.inplace and worst is not None:
            self._profiler.note_regroup(worst.regroup_s)
        what = self._describe(p)
        line = recovery_line(what, self._session.plan, inplace=p.decision.inplace,
                             started=len(p.started), moved_layers=fields["moved_layers"],
                             moved_bytes=fields["transfer_bytes"],
                             source=fields["source"] or "", resumed_step=resumed_step,
                             redone=fields["redone_steps"], seconds=fields["total_s"],
                             logs=self._logs_specs.root_log_dir
                             if isinstance(self._logs_specs, WorkerLogs) else None, tp=self._tp)
        self._status.say(f"chameleon-run: {line}")
        total = fields["total_s"]
        self._update_status("running" if total is None else
                            f"running (recovered {fields['mode']} in {total:.2f} s)")

    def _describe(self, p: _Pending) -> str:
        """``device 3 lost (SIGKILL)``, ``devices 2, 3 lost (node gone)``, ``device 1 back``:
        how each device was lost is what its own node reported (the decision carries it)."""
        event = p.event
        lost = sorted(p.change.lost) if p.change else sorted(event.lost)
        joined = sorted(p.change.joined) if p.change else sorted(event.joined)
        tp = self._tp
        why = dict(p.decision.why)
        parts = []
        if lost:
            said = sorted({why.get(d, "node gone") for d in lost})
            parts.append(f"{name_devices(lost, tp)} lost ({', '.join(said)})")
        if joined:
            parts.append(f"{name_devices(joined, tp)} back")
        if not parts and event.failures:
            card = "device" if tp == 1 else "card"
            parts.append("; ".join(f"{card} {f.device}: {f.reason}" for f in event.failures))
        return " and ".join(parts) or f"{event.reason}: no device changed"

    def _hung(self) -> list[WorkerFailure]:
        """Runtime workers whose progress count has not moved for ``hang_s`` and that are not
        asleep. A worker blocked on a hung peer sleeps in its transfer; the hung one is stopped,
        stuck in the kernel, or spinning. Only "stopped" is conclusive at one look: a peer of a
        dead worker runs briefly while it reacts, so the other states must last
        ``_HANG_CONFIRM_S`` of consecutive looks, and "running" must have used at least half a
        core meanwhile (a process starved of a core by other load is runnable, not spinning).
        Scripts that never report progress are never hung. While one waits to be convicted,
        the status line says so (a minute of silence looked like a frozen launcher)."""
        limit = self._timeouts.hang_s
        if not limit or self._channel is None:
            return []
        now = time.monotonic()
        hung = []
        stalled: dict[int, float] = {}
        for device in sorted(self._procs.devices):
            count = channel.read_int(self._channel, channel.beat_key(device))
            if count is None:
                continue
            seen = self._beats.get(device)
            if seen is None or seen[0] != count:
                self._beats[device] = (count, now)
                self._awake.pop(device, None)
                continue
            idle = now - seen[1]
            if idle < _stall_shown_after(limit):
                continue
            try:
                proc = psutil.Process(self._procs.pid(device))
                state = proc.status()
                cpu = sum(proc.cpu_times()[:2])
            except psutil.Error:
                continue   # gone: the next poll reports its exit
            if state in (psutil.STATUS_SLEEPING, psutil.STATUS_IDLE):
                self._awake.pop(device, None)
                continue
            stalled[device] = idle
            if idle < limit:
                continue
            since, cpu_then = self._awake.setdefault(device, (now, cpu))
            if state != psutil.STATUS_STOPPED and now - since < _HANG_CONFIRM_S:
                continue
            if state == psutil.STATUS_RUNNING and cpu - cpu_then < (now - since) / 2:
                # runnable but hardly run: starved of a core by other load, not spinning
                self._awake[device] = (now, cpu)
                continue
            nproc = self._nproc()
            hung.append(WorkerFailure(device, device % nproc, -signal.SIGKILL, None,
                                      FailureKind.DEVICE_LOST,
                                      f"hung: no progress for {idle:.1f} s, process {state}",
                                      since=time.time() - idle))
        self._show_stalls(stalled, limit)
        return hung

    def _show_stalls(self, stalled: dict[int, float], limit: float) -> None:
        """``device 2: no progress for 20 s (hung at 60 s)`` on the status line, renewed each
        time a stall crosses another step of ``_stall_shown_after``, and gone with the stall."""
        step = _stall_shown_after(limit)
        buckets = {d: int(idle // step) for d, idle in stalled.items()}
        if buckets == self._stall_shown:
            return
        self._stall_shown = buckets
        if not stalled:
            self._update_status("running")
            return
        card = "device" if self._tp == 1 else "card"
        said = "; ".join(f"{card} {d}: no progress for {idle:.0f} s"
                         for d, idle in sorted(stalled.items()))
        self._update_status(f"{said} (hung at {limit:g} s)")

    def _lease_verdict(self) -> FailureEvent | None:
        """Before ending a job for a crash with no restart left: did a peer node die? Its lease
        says so within its ttl (+ 1 s for etcd's expiry sweep)."""
        if self._watch is None:
            return None
        deadline = time.monotonic() + self._watch.ttl + 1.0
        while True:
            news = self._lease_news()
            if news is not None and news.trigger is Trigger.NODE_LOST:
                return news
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    @property
    def _runtime(self) -> bool:
        """The live workers run on the runtime (they report how they resume)."""
        return self._registered(self._procs.devices)

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
            hung = self._hung() if result.state == WorkerState.HEALTHY else []
            bad = self._health_tick() if result.state == WorkerState.HEALTHY else set()
            if self._profiler is not None:
                self._profiler.sample()
            state = result.state
            if bad or hung:
                state = WorkerState.UNHEALTHY
            wg.state = state
            if state == WorkerState.SUCCEEDED:
                self._update_status("succeeded")
                if self._watch is not None:   # leave as finished: no loss for the others
                    self._watch.finish()
                    self._watch = None
                self._exit_barrier()
                self._emit(Event.JOB_FINISHED, state="SUCCEEDED",
                           restarts_used=self._restarts_used())
                return result
            try:
                self._poll_pending()
                outcome = self._react(wg, state, result, bad, hung)
            except (LauncherPlanningError, RendezvousClosedError) as exc:
                if isinstance(exc, RendezvousClosedError):
                    exc = LauncherPlanningError(
                        "the job's rendezvous is closed: the other nodes finished or gave up "
                        "while this node was cut off, so there is nothing to rejoin."
                    )
                self._status.say(f"chameleon-run: {exc}")
                self._procs.close(timeout=self._timeouts.shutdown_s)
                wg.state = WorkerState.FAILED
                self._update_status("failed")
                self._emit(Event.JOB_FINISHED, state="FAILED", reason=str(exc))
                return RunResult(state=WorkerState.FAILED)
            if outcome is not None:
                return outcome

    def _event(self, trigger: Trigger, **fields: Any) -> FailureEvent:
        gen = self._session.plan.generation if self._session is not None else 0
        return FailureEvent(trigger, gen, detected_at=time.monotonic(), wall=time.time(),
                            **fields)

    def _react(self, wg: WorkerGroup, state: WorkerState, result: RunResult,
               bad: set[int], hung: list[WorkerFailure]) -> RunResult | None:
        """One monitor tick's reaction; a RunResult ends the run, None keeps monitoring."""
        spec = wg.spec
        news = self._lease_news()
        if news is not None and news.trigger is Trigger.FENCED:
            # our plan may be stale: nothing of ours may train on (the lease thread has killed
            # the workers already; their deaths are ours, not lost devices); rejoin and adopt
            self._procs.close(signal.SIGKILL, timeout=self._timeouts.shutdown_s)
            self._recover(news, self._inplace_wanted)
            return None
        if state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            ended = channel.read(self._channel, channel.ENDED) if self._channel else None
            if ended is not None:   # a worker found that training cannot go on, and said why
                self._emit(Event.PLANNING_FAILED, error=ended)
                raise LauncherPlanningError(ended)
            failures = self._classify(result) + hung
            for f in failures:
                self._emit(Event.FAILURE_SEEN, device=f.device, local_rank=f.local_rank,
                           exitcode=f.exitcode, signal=f.signal, kind=f.kind.value,
                           reason=f.reason)
            for d in sorted(bad):
                self._emit(Event.FAILURE_SEEN, device=d, kind=FailureKind.DEVICE_LOST.value,
                           reason="device failed its health check", exitcode=None,
                           signal=None, local_rank=None)
            planned = self._session is not None and self._session.policy != "restart"
            lost = self._units({f.device for f in failures
                                if f.kind is FailureKind.DEVICE_LOST}) | bad
            crashed = any(f.kind is FailureKind.CRASH for f in failures)
            if hung and not planned:   # torchrun's way: a hung worker is a crash
                self._procs.kill({f.device for f in hung})
            if planned and lost:
                event = self._event(Trigger.DEVICE_LOST, lost=frozenset(lost),
                                    failures=tuple(failures))
                self._book.lost |= lost
                self._book.unhealthy |= bad
                self._book.why.update({d: "health check" for d in bad})
                self._book.why.update({unit_of(f.device, self._tp): f.signal or f.reason.split(",")[0]
                                       for f in failures if f.kind is FailureKind.DEVICE_LOST})
                # a unit is lost whole: its other cards cannot go on without the lost one
                self._procs.kill(self._cards(lost) | {f.device for f in hung})
                inplace = (self._inplace_wanted and not crashed and not self._procs.succeeded
                           and self._runtime)
                self._recover(event, inplace)
                return None
            if news is None and self._remaining_restarts == 0:
                news = self._lease_verdict()
            if news is not None:   # our workers failed because a peer node died: no crash
                self._recover(news, False)
                return None
            if self._remaining_restarts > 0:
                self._remaining_restarts -= 1
                self._charged_crash = True
                # in place, only the crashed worker starts again; its peers keep their state
                inplace = self._inplace_wanted and not self._procs.succeeded and self._runtime
                try:
                    self._recover(self._event(Trigger.CRASH, failures=tuple(failures)), inplace)
                finally:
                    self._charged_crash = False
                return None
            self._procs.close(timeout=self._timeouts.shutdown_s)
            wg.state = WorkerState.FAILED
            self._update_status("failed")
            self._emit(Event.JOB_FINISHED, state="FAILED", reason="max restarts used up",
                       restarts_used=self._restarts_used())
            return result
        if state == WorkerState.HEALTHY:
            inplace = self._inplace_wanted and self._runtime
            if news is not None:
                self._recover(news, inplace)
                return None
            if self._book.rejoining:
                self._recover(self._event(Trigger.REJOINED,
                                          joined=frozenset(self._book.rejoining)), inplace)
                return None
            try:
                waiting = spec.rdzv_handler.num_nodes_waiting()
            except _STORE_LOST as exc:
                self._emit(Event.FAILURE_SEEN, kind="rendezvous_lost",
                           reason=str(exc).splitlines()[0][:300])
                event = self._event(Trigger.RENDEZVOUS_LOST)
                self._failover_rendezvous(spec, exc)
                self._recover(event, inplace)
                return None
            if waiting > 0:
                self._emit(Event.MEMBERSHIP_CHANGE, nodes_waiting=waiting)
                self._recover(self._event(Trigger.MEMBERSHIP), inplace)
                return None
            if self._trouble():
                self._emit(Event.FAILURE_SEEN, kind="peer_lost",
                           reason="a local worker lost a peer that this node does not run")
                self._recover(self._event(Trigger.PEER_LOST), inplace)
            return None
        raise RuntimeError(f"worker group in unexpected state {state.name}")

    def _recover(self, event: FailureEvent, inplace: bool) -> None:
        mode = "in place" if inplace else "relaunch"
        self._update_status(f"recovering {mode} ({event.reason})")
        self._transition(event, inplace_wanted=inplace, expect_reports=self._runtime)
