"""The end of a transition: the generation made known on the node, and the workers it lacks.

With a plan, the generation is published on the node's channel first (its record names the
world and the worker store, so the kept workers regroup from it), the kept workers are
renumbered into the new world, and a process starts only for a local device of that world that
has none (every device after a relaunch, where none was kept), and for a local spare device
without one: a standby, which waits warm outside the world for a place (runtime/recovery/standby.py). Without a plan, torch's own rank
assignment gives every local worker, as torchrun does. The processes themselves are
``workers.WorkerProcesses``'; their environment is ``worker_env``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import Worker

from chameleon_elastic import channel
from chameleon_elastic.channel import Generation

from ..observe import Event
from ..plan_env import LocalAssignment, NodeCards, device_id, local_assignments
from .processes import WorkerProcesses
from .worker_env import launch_inputs, standby_args

__all__ = ["TorchHooks", "WorkerStarter"]

Todo = list[tuple[Worker, LocalAssignment | None]]


@dataclass(frozen=True)
class TorchHooks:
    """What starting a worker borrows from torch's agent, unchanged: its per-rank environment
    (``_set_local_rank_env``), its watchdog and health-check servers, its log line prefixes."""

    set_local_rank_env: Callable[[dict, int, Any], None]
    before_start: Callable[[dict], None]   # envs by index -> None (watchdog, health check)
    prefix_template: str | None
    logs_specs: Any
    start_method: str


class WorkerStarter:
    def __init__(self, procs: WorkerProcesses, store: Any, hooks: TorchHooks,
                 emit: Callable[..., None], extra_env: Callable[[], dict[str, str]]) -> None:
        self._procs = procs
        self._channel = store           # this node's agent <-> worker store (None: no job)
        self._address = f"127.0.0.1:{store.port}" if store is not None else ""
        self._hooks = hooks
        self._emit = emit
        self._extra_env = extra_env     # the profiler's variables

    def planned(self, session: Any, decision: Any, wg: Any, here: NodeCards) -> Todo:
        """Publish the generation; renumber the kept workers; the local devices of its world
        that have no live worker."""
        plan = session.plan
        assigned = [a for a in local_assignments(plan, here.node, here.nproc, decision.world,
                                                 here.tp) if a.device not in self._procs.devices]
        # processes that start for this generation: the decision's (restarts anywhere), and
        # here those without a live worker
        starting = tuple(sorted(set(decision.starting) | {a.device for a in assigned}))
        channel.write(self._channel, channel.generation_key(plan.generation), Generation(
            plan.generation, session.plan_file, str(wg.master_addr), int(wg.master_port),
            decision.world, decision.reported, tp=here.tp, starting=starting))
        channel.write(self._channel, channel.NEWEST, plan.generation)
        for card in self._procs.devices:   # wake the kept workers' watchdogs (runtime/world/abort.py)
            channel.write(self._channel, channel.wake_key(card), True)
        self._procs.renumber(lambda card: here.ranks(card, decision.world)
                             if card // here.tp in decision.world else None)
        return [(Worker(local_rank=a.local_rank, global_rank=a.global_rank,
                        role_rank=a.global_rank, world_size=a.world_size,
                        role_world_size=a.world_size), a)
                for a in assigned + self._standbys(session, wg.spec, len(decision.world), here)]

    def _standbys(self, session: Any, spec: Any, world: int,
                  here: NodeCards) -> list[LocalAssignment]:
        """A standby (runtime/recovery/standby.py) for each local card of a spare device without a live
        worker, when the job recovers in place and runs a Python script: warm and idle
        outside the world until a generation gives its device a place. Its rank is a label
        past the world's (``world`` devices), unique on the node."""
        if (session.policy == "restart" or session.spec.cluster.recovery != "inplace"
                or standby_args(spec) is None):
            return []
        spare = set(session.plan.spare_devices)
        cards = [c for c in here.cards if c // here.tp in spare and c not in self._procs.devices]
        size = world * here.tp
        return [LocalAssignment(c - here.node * here.nproc, c, size + i, size, None, c % here.tp)
                for i, c in enumerate(cards)]

    def launch(self, todo: Todo, wg: Any, restart_count: int, session: Any,
               here: NodeCards) -> tuple[int, ...]:
        """Start ``todo``'s processes (``restart_count``: their TORCHELASTIC_RESTART_COUNT); the
        devices started."""
        if not todo:
            return ()
        start = time.perf_counter()
        hooks = self._hooks
        envs, args, prefixes = launch_inputs(
            todo, wg.spec, wg, restart_count, session, self._address, self._extra_env(),
            hooks.set_local_rank_env, hooks.prefix_template)
        devices = [device_id(here.node, w.local_rank, here.nproc) for w, _ in todo]
        hooks.before_start(envs)
        if self._channel is not None:
            # a new process is hang-checked from its own first beat: its dead predecessor's
            # count, standing still, made a slow start (imports on a busy machine) look hung
            for device in devices:
                for key in (channel.beat_key(device), channel.gap_key(device),
                            channel.slow_key(device)):
                    self._channel.delete_key(key)
        self._procs.start(wg.spec, list(zip(devices, (w for w, _ in todo), strict=True)), envs,
                          args, prefixes, hooks.logs_specs, hooks.start_method)
        self._emit(Event.WORKERS_STARTED, local_ranks=[w.local_rank for w, _ in todo],
                   devices=devices, ranks=[w.global_rank for w, _ in todo],
                   world_size=todo[0][0].world_size, master_port=wg.master_port,
                   duration_s=time.perf_counter() - start)
        return tuple(devices)
