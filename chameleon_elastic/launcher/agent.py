"""ChameleonAgent: torch's LocalElasticAgent, made failure-aware and plan-aware.

Protocol of one recovery (each phase timed into the event log):

1. detect   - the monitor loop sees a worker exit (exit code / signal), a device failing its
              health check, or the rendezvous store becoming unreachable.
2. classify - signal death or failed health check = the device is lost (excluded; no restart
              budget spent); any other exit = crash on a healthy device (same plan, restart
              budget spent, exactly like torchrun); without ``--job`` every failure is a crash.
3. stop     - the local workers are stopped (SIGTERM, then SIGKILL after the shutdown timeout).
4. agree    - next rendezvous round. If the store is gone (its hosting agent died) the agent
              rebuilds its rendezvous handler from the same parameters: torch's c10d backend then
              lets the first survivor on the endpoint's host bind the port again and the others
              connect to it. In the new round every agent publishes its node id and its lost
              devices; the group-rank-0 agent takes the union (plus every device of a node that
              is absent; devices of a node that is back rejoin), asks the planner (cached plan
              first) and publishes the plan in the round's store; the others adopt it, so agents
              with different histories cannot diverge.
5. launch   - workers start with the new plan's roles. Every launch gets a FRESH worker store:
              the group-rank-0 agent opens a new TCPStore on an OS-chosen port and publishes it in
              the round's store. torch keeps one shared store and one MASTER_PORT for the whole
              job, so a restarted worker can read the previous attempt's gloo addresses and hang
              or fail with "connectFullMesh ... Connection refused"; a new store cannot hold them.

The worker store lives in the agent, never in a worker, so a crashing rank 0 takes no store with
it. Workers are started through ``orphan_guard`` so that they die with the agent, even on SIGKILL.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from string import Template
from typing import Any

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
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.utils import macros

from chameleon_elastic.plan import ExecutionPlan

from .failures import FailureKind, WorkerFailure, classify_exit
from .health import AlwaysHealthy, HealthCheck
from .observe import EventLog, StatusLine
from .orphan_guard import guarded_command
from .plan_env import LocalAssignment, chameleon_env, device_id, local_assignments
from .profiler import Profiler
from .session import JobSession, LauncherPlanningError

__all__ = ["ChameleonAgent"]

log = logging.getLogger("chameleon_elastic.launcher.agent")

_STORE_FAILOVER_ATTEMPTS = 3
# What an unreachable rendezvous store raises: torch's wrapped error, or the raw TCPStore one
# when the store dies between two of the handler's own calls.
_STORE_LOST = (RendezvousConnectionError, dist.DistNetworkError)


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
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
    ) -> None:
        super().__init__(spec, logs_specs, start_method=start_method,
                         exit_barrier_timeout=exit_barrier_timeout,
                         log_line_prefix_template=log_line_prefix_template,
                         shutdown_timeout=shutdown_timeout)
        self._rdzv_parameters = rdzv_parameters
        self._session = session
        self._events = events if events is not None else EventLog(None)
        self._status = status if status is not None else StatusLine(enabled=False)
        self._health = health if health is not None else AlwaysHealthy()
        self._profiler = profiler
        self._attempt = -1                      # worker-group launches so far, minus one
        self._node: int | None = None           # node id in the initial world (device ids)
        self._worker_store: Any = None          # this launch's TCPStore server (rank 0 only)
        self._lost_local: set[int] = set()      # local devices lost (cumulative)
        self._health_excluded: set[int] = set() # local devices out because the check failed
        self._rejoining: set[int] = set()       # health-excluded devices that pass again
        self._assignments: tuple[LocalAssignment, ...] = ()
        self._pending: dict[str, Any] = {}      # timings of the recovery in progress
        self._last_info: Any = None             # last RendezvousInfo (reused on one node)
        self._reused_round = False
        self._charged_crash = False             # a restart was just charged for a crash

    # ------------------------------------------------------------------ helpers

    def _emit(self, event: str, **fields: Any) -> None:
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

    # ------------------------------------------------------------------ rendezvous

    def _next_rendezvous(self, spec: WorkerSpec):
        # One node at most: no other agent can join or leave, so the previous round's result is
        # still the truth; skipping the store round-trips makes a restart several times faster.
        if self._rdzv_parameters.max_nodes == 1 and self._last_info is not None:
            self._reused_round = True
            return self._last_info
        self._reused_round = False
        self._last_info = self._rendezvous_with_failover(spec)
        return self._last_info

    def _rendezvous_with_failover(self, spec: WorkerSpec):
        for attempt in range(_STORE_FAILOVER_ATTEMPTS + 1):
            try:
                return spec.rdzv_handler.next_rendezvous()
            except _STORE_LOST as exc:
                if attempt == _STORE_FAILOVER_ATTEMPTS or spec.rdzv_handler.get_backend() == "static":
                    raise
                self._failover_rendezvous(spec, exc)
        raise AssertionError("unreachable")

    def _failover_rendezvous(self, spec: WorkerSpec, exc: BaseException) -> None:
        """The rendezvous store is unreachable: rebuild the handler from the same parameters."""
        start = time.perf_counter()
        old = spec.rdzv_handler
        stop = getattr(old, "_stop_heartbeats", None)  # the old store is gone; stop pinging it
        if callable(stop):
            try:
                stop()
            except (RuntimeError, OSError) as stop_exc:
                log.debug("stopping heartbeats to the lost store failed: %s", stop_exc)
        spec.rdzv_handler = rdzv_registry.get_rendezvous_handler(self._rdzv_parameters)
        self._rdzv_handler = spec.rdzv_handler
        self._last_info = None
        self._emit("rendezvous_failover", error=str(exc).splitlines()[0][:300],
                   duration_s=time.perf_counter() - start)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        spec = worker_group.spec
        self._attempt += 1
        start = time.perf_counter()
        info = self._next_rendezvous(spec)
        store, group_rank, group_world = info.store, info.rank, info.world_size
        self._store = store
        if self._node is None:
            self._node = group_rank
        rdzv_s = time.perf_counter() - start

        plan_s = 0.0
        if self._session is not None:
            t = time.perf_counter()
            self._agree_on_plan(store, group_rank, group_world, spec.local_world_size)
            plan_s = time.perf_counter() - t
            self._assignments = local_assignments(self._session.plan, self._node,
                                                  spec.local_world_size)
            workers = [Worker(local_rank=a.local_rank, global_rank=a.global_rank,
                              role_rank=a.global_rank, world_size=a.world_size,
                              role_world_size=a.world_size) for a in self._assignments]
        else:
            workers = self._assign_worker_ranks(store, group_rank, group_world, spec)
            self._assignments = ()

        addr, port = self._open_worker_store(store, group_rank, spec, info)
        worker_group.workers = workers
        worker_group.store = store
        worker_group.group_rank = group_rank
        worker_group.group_world_size = group_world
        worker_group.master_addr = addr
        worker_group.master_port = port
        self._pending.update(rendezvous_s=rdzv_s, plan_s=plan_s)
        self._emit("rendezvous", group_rank=group_rank, group_world_size=group_world,
                   node=self._node, master_addr=addr, master_port=port, duration_s=rdzv_s)

    def _open_worker_store(self, store, group_rank: int, spec: WorkerSpec, info) -> tuple[str, int]:
        """A fresh TCPStore per launch, hosted by the group-rank-0 agent; (addr, port)."""
        key = self._key_scope() + "worker_store"
        self._worker_store = None  # drop the previous launch's server first
        if group_rank == 0:
            addr = spec.master_addr or info.bootstrap_store_info.master_addr
            server = dist.TCPStore(host_name=addr, port=0, is_master=True,
                                   wait_for_workers=False, multi_tenant=False,
                                   timeout=timedelta(seconds=60))
            self._worker_store = server
            store.set(key, json.dumps([addr, server.port]))
        addr, port = json.loads(store.get(key))
        return str(addr), int(port)

    def _agree_on_plan(self, store, group_rank: int, group_world: int, nproc: int) -> None:
        """Every agent reports its node and lost devices; group rank 0 decides and publishes
        the plan; the others adopt it (so agents with different histories cannot diverge)."""
        session = self._session
        assert session is not None and self._node is not None
        scope = self._key_scope()
        self._lost_local -= self._rejoining
        before = set(session.excluded)
        mine = {"node": self._node, "lost": sorted(self._lost_local)}
        store.set(f"{scope}node/{group_rank}", json.dumps(mine))
        try:
            if group_rank == 0:
                reports = [json.loads(v) for v in
                           store.multi_get([f"{scope}node/{r}" for r in range(group_world)])]
                present = {int(r["node"]) for r in reports}
                reported = {int(d) for r in reports for d in r["lost"]}
                on_present = {device_id(node, lr, nproc) for node in present
                              for lr in range(nproc)}
                everything = set(range(session.devices))
                lost = (reported | (everything - on_present)) & everything
                joined = (session.excluded & on_present) - reported
                change = session.apply(lost=lost, joined=joined)
                store.set(f"{scope}plan", json.dumps({"plan": session.plan.to_dict(),
                                                      "excluded": sorted(session.excluded)}))
            else:
                published = json.loads(store.get(f"{scope}plan"))
                if "error" in published:  # rank 0 found no plan
                    raise LauncherPlanningError(published["error"])
                change = session.adopt(ExecutionPlan.from_dict(published["plan"]),
                                       published["excluded"])
        except LauncherPlanningError as exc:
            self._emit("planning_failed", error=str(exc))
            if group_rank == 0:
                store.set(f"{scope}plan", json.dumps({"error": str(exc)}))
            raise
        newly_remote = session.excluded - before - set(self._local_device_ids())
        if newly_remote and self._charged_crash:
            # the "crash" was our workers failing because a peer node died: that is a lost
            # node, which costs no restart (torchrun would have spent one)
            self._remaining_restarts += 1
            self._charged_crash = False
        self._health_excluded -= self._rejoining
        self._rejoining.clear()
        if change is not None:
            self._pending["plan_s"] = change.decide_s
            self._emit("plan_chosen", policy=change.plan.policy, plan_file=session.plan_file,
                       lost=list(change.lost), joined=list(change.joined),
                       via_cache=change.cached, decide_s=change.decide_s,
                       candidates=change.candidates, rejected=change.rejected,
                       decided_here=group_rank == 0,
                       live_devices=list(change.plan.live_devices),
                       spare_devices=list(change.plan.spare_devices))

    # ------------------------------------------------------------------ workers

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        spec = worker_group.spec
        start = time.perf_counter()
        restart_count = self._restarts_used()
        use_agent_store = True  # workers are clients of the agent-hosted, per-launch store
        args: dict[int, tuple] = {}
        envs: dict[int, dict[str, str]] = {}
        prefixes: dict[int, str] | None = {} if self._log_line_prefix_template else None
        session = self._session
        for index, worker in enumerate(worker_group.workers):
            env: dict[str, str] = {
                "RANK": str(worker.global_rank),
                "GROUP_RANK": str(worker_group.group_rank),
                "ROLE_RANK": str(worker.role_rank),
                "ROLE_NAME": spec.role,
                "LOCAL_WORLD_SIZE": str(spec.local_world_size),
                "WORLD_SIZE": str(worker.world_size),
                "GROUP_WORLD_SIZE": str(worker_group.group_world_size),
                "ROLE_WORLD_SIZE": str(worker.role_world_size),
                "MASTER_ADDR": str(worker_group.master_addr),
                "MASTER_PORT": str(worker_group.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
                "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
                "TORCHELASTIC_USE_AGENT_STORE": str(use_agent_store),
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv(
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            }
            self._set_local_rank_env(env, worker.local_rank, spec)
            if "OMP_NUM_THREADS" in os.environ:
                env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
            if session is not None:
                env.update(chameleon_env(session.plan, self._assignments[index].role,
                                         session.plan_file))
            if self._profiler is not None:
                env.update(self._profiler.worker_env())
            if prefixes is not None:
                prefixes[index] = Template(self._log_line_prefix_template).safe_substitute(
                    role_name=spec.role, rank=worker.global_rank, local_rank=worker.local_rank)
            envs[index] = env
            args[index] = tuple(macros.substitute(list(spec.args), str(worker.local_rank)))

        self._setup_local_watchdog(envs=envs)
        self._setup_healthcheck()
        entrypoint = spec.entrypoint
        if isinstance(entrypoint, str):
            wrapped = {i: guarded_command(entrypoint, a) for i, a in args.items()}
            entrypoint = next(iter(wrapped.values()))[0] if wrapped else entrypoint
            args = {i: w[1] for i, w in wrapped.items()}
        self._pcontext = start_processes(
            name=spec.role, entrypoint=entrypoint, args=args, envs=envs,
            logs_specs=self._logs_specs, log_line_prefixes=prefixes,
            start_method=self._start_method, numa_options=spec.numa_options,
            duplicate_stdout_filters=spec.duplicate_stdout_filters,
            duplicate_stderr_filters=spec.duplicate_stderr_filters,
        )
        pids = self._pcontext.pids()
        if self._profiler is not None:
            self._profiler.track({w.local_rank: pids[i] for i, w in
                                  enumerate(worker_group.workers)}, self._local_devices())
        launch_s = time.perf_counter() - start
        self._emit("workers_started", local_ranks=[w.local_rank for w in worker_group.workers],
                   devices=self._local_devices(), ranks=[w.global_rank for w in
                                                         worker_group.workers],
                   world_size=worker_group.workers[0].world_size if worker_group.workers else 0,
                   master_port=worker_group.master_port, duration_s=launch_s)
        self._pending["launch_s"] = launch_s
        self._update_status("running")
        return pids

    def _local_device_ids(self) -> list[int]:
        nproc = self._worker_group.spec.local_world_size
        node = self._node or 0
        return [device_id(node, lr, nproc) for lr in range(nproc)]

    def _local_devices(self) -> list[int]:
        nproc = self._worker_group.spec.local_world_size
        node = self._node or 0
        return [device_id(node, w.local_rank, nproc) for w in self._worker_group.workers]

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        super()._shutdown(death_sig, timeout)
        self._worker_store = None

    # ------------------------------------------------------------------ monitoring

    def _classify(self, result: RunResult) -> list[WorkerFailure]:
        nproc = self._worker_group.spec.local_world_size
        node = self._node or 0
        by_rank = {w.global_rank: w for w in self._worker_group.workers}
        found = []
        for rank, failure in sorted(result.failures.items()):
            worker = by_rank.get(rank)
            local_rank = worker.local_rank if worker is not None else failure.local_rank
            found.append(classify_exit(failure.exitcode, device_id(node, local_rank, nproc),
                                       local_rank))
        return found

    def _health_tick(self) -> set[int]:
        """Local working devices failing the health check now (only with --job)."""
        if self._session is None:
            return set()
        devices = set(self._local_devices())
        bad = set(self._health.unhealthy(devices))
        nproc = self._worker_group.spec.local_world_size
        node = self._node or 0
        excluded = self._health_excluded
        if excluded:
            all_local = {device_id(node, lr, nproc) for lr in range(nproc)}
            still_bad = set(self._health.unhealthy(all_local))
            back = excluded - still_bad
            if back - self._rejoining:
                self._rejoining |= back
        return bad

    def _recover(self, worker_group: WorkerGroup, reason: str, detected_at: float) -> None:
        self._update_status(f"recovering ({reason})")
        start = time.perf_counter()
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.STOPPED
        stop_s = time.perf_counter() - start
        self._pending = {"stop_s": stop_s}
        self._initialize_workers(worker_group)
        p = self._pending
        self._emit("recovered", reason=reason, stop_s=stop_s,
                   rendezvous_s=p.get("rendezvous_s"), plan_s=p.get("plan_s"),
                   launch_s=p.get("launch_s"),
                   total_s=time.monotonic() - detected_at, restarts_used=self._restarts_used())

    def _invoke_run(self, role: str = "default") -> RunResult:
        spec = self._worker_group.spec
        wg = self._worker_group
        self._emit("agent_started", entrypoint=spec.get_entrypoint_name(),
                   nproc_per_node=spec.local_world_size, max_restarts=spec.max_restarts,
                   policy=None if self._session is None else self._session.policy,
                   plan_file=None if self._session is None else self._session.plan_file)
        try:
            self._initialize_workers(wg)
        except LauncherPlanningError as exc:
            sys.stderr.write(f"chameleon-run: {exc}\n")
            return RunResult(state=WorkerState.FAILED)
        while True:
            time.sleep(spec.monitor_interval)
            result = self._monitor_workers(wg)
            bad = self._health_tick() if result.state == WorkerState.HEALTHY else set()
            if self._profiler is not None:
                self._profiler.sample()
            state = result.state
            if bad:
                state = WorkerState.UNHEALTHY
            wg.state = state
            if state == WorkerState.SUCCEEDED:
                self._update_status("succeeded")
                self._exit_barrier()
                self._emit("job_finished", state="SUCCEEDED", restarts_used=self._restarts_used())
                return result
            try:
                outcome = self._react(wg, state, result, bad)
            except LauncherPlanningError as exc:
                sys.stderr.write(f"chameleon-run: {exc}\n")
                self._stop_workers(wg)
                wg.state = WorkerState.FAILED
                self._update_status("failed")
                self._emit("job_finished", state="FAILED", reason="no plan fits the devices left")
                return RunResult(state=WorkerState.FAILED, failures=result.failures)
            if outcome is not None:
                return outcome

    def _react(self, wg: WorkerGroup, state: WorkerState, result: RunResult,
               bad: set[int]) -> RunResult | None:
        """One monitor tick's reaction; a RunResult ends the run, None keeps monitoring."""
        spec = wg.spec
        if state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            detected = time.monotonic()
            failures = self._classify(result)
            # torch reports the workers it stopped after the first failure too; keep roots
            failures = [f for f in failures if not f.stopped_on_request] or failures
            for f in failures:
                self._emit("failure_seen", device=f.device, local_rank=f.local_rank,
                           exitcode=f.exitcode, signal=f.signal, kind=f.kind.value,
                           reason=f.reason)
            for d in sorted(bad):
                self._emit("failure_seen", device=d, kind=FailureKind.DEVICE_LOST.value,
                           reason="device failed its health check", exitcode=None,
                           signal=None, local_rank=None)
            planned = self._session is not None and self._session.policy != "restart"
            lost = {f.device for f in failures if f.kind is FailureKind.DEVICE_LOST}
            lost = (lost | bad) if planned else set()
            if lost:
                self._lost_local |= lost
                self._health_excluded |= bad
                self._recover(wg, "device_lost", detected)
                return None
            if self._remaining_restarts > 0:
                self._remaining_restarts -= 1
                self._charged_crash = True
                try:
                    self._recover(wg, "crash", detected)
                finally:
                    self._charged_crash = False
                return None
            self._stop_workers(wg)
            wg.state = WorkerState.FAILED
            self._update_status("failed")
            self._emit("job_finished", state="FAILED", reason="max restarts used up",
                       restarts_used=self._restarts_used())
            return result
        if state == WorkerState.HEALTHY:
            if self._rejoining:
                self._recover(wg, "device_rejoined", time.monotonic())
                return None
            try:
                waiting = spec.rdzv_handler.num_nodes_waiting()
            except _STORE_LOST as exc:
                self._emit("failure_seen", kind="rendezvous_lost",
                           reason=str(exc).splitlines()[0][:300])
                detected = time.monotonic()
                self._failover_rendezvous(spec, exc)
                self._recover(wg, "rendezvous_lost", detected)
                return None
            if waiting > 0:
                self._emit("membership_change", nodes_waiting=waiting)
                self._recover(wg, "membership", time.monotonic())
            return None
        raise RuntimeError(f"worker group in unexpected state {state.name}")
