"""The agent's rendezvous rounds and the worker store each round opens.

One round per transition (launch or recovery). Three things make them differ from torch's:

- **Quick rounds.** A recovery that adds no node (a worker lost, a crash, a node lost) needs no
  rendezvous round: membership can only shrink, and who is left is known (the last agreement's
  nodes, less those whose etcd lease is gone). torch's round would cost a second or more of
  polling, plus, for a lost node, its keep-alive expiry and ``last_call_timeout``. A quick round
  reuses the last round's store under a fresh scope (``q<epoch>/``); every report in it comes
  with ``q<epoch>/open`` (one write, agreement.report), which wakes the others at their next
  tick (:meth:`Rounds.quick_called`).
  A node that wants to join still makes a full round. With ``--nnodes 1`` every recovery is
  quick: no other agent can join or leave.
- **Failover.** When the rendezvous store is unreachable (its host agent died), the handler is
  rebuilt from the same parameters, at most ``_FAILOVER_ATTEMPTS`` times within
  ``failover_s``: torch's c10d backend lets the first survivor on that host bind the port again.
- **Survivors admitted.** After a planned job's first round, later rounds close with whoever is
  left (:meth:`Rounds.admit_survivors`).

Every generation gets a FRESH worker store: the deciding agent opens a new TCPStore on an
OS-chosen port. torch keeps one shared store and one MASTER_PORT for the whole job, so a
restarted worker can read the previous attempt's gloo addresses and hang or fail with
"connectFullMesh ... Connection refused"; a new store cannot hold them. The store lives in the
agent, never in a worker, so a crashing rank 0 takes no store with it. The decider opens it
before it publishes its decision and serves the whole decision there to any agent whose own
replay of it differs (:class:`WorkerStoreDesk`): the plan never goes through etcd to every
agent (agreement.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from datetime import timedelta
from itertools import filterfalse
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from chameleon_elastic import torch_compat
from chameleon_elastic.rendezvous.handler import handler_for
from chameleon_elastic.timeouts import Timeouts

from ..observe import Event, StatusLine
from .messages import OPENED, Members
from .waiting import RendezvousWait

__all__ = ["CLOSED", "FINISHED_AWAY", "STORE_LOST", "Rounds", "WorkerStoreDesk"]

log = logging.getLogger("chameleon_elastic.launcher.coordination.rounds")

_FAILOVER_ATTEMPTS = 3
#: set in the last round's store by a node whose workers all succeeded (``Rounds.finish``)
FINISHED = "chameleon/finished"
# What an unreachable rendezvous store raises: torch's wrapped error, or the raw TCPStore one
# when the store dies between two of the handler's own calls.
STORE_LOST = (RendezvousConnectionError, dist.DistNetworkError)
#: the sentence of a rendezvous closed while this node was cut off (torch's RendezvousClosedError)
CLOSED = ("the job's rendezvous is closed: the other nodes finished or gave up while this node "
          "was cut off, so there is nothing to rejoin.")
#: the line of a node that finds the job finished on the other nodes when it rejoins (exit 0)
FINISHED_AWAY = ("the job finished on the other nodes while this node was cut off (its "
                 "workers were stopped): nothing to rejoin.")


class Rounds:
    """``next`` runs one round on ``spec.rdzv_handler`` (replacing the handler on failover);
    ``open_worker_store`` gives the round's workers their store."""

    def __init__(self, params: Any, timeouts: Timeouts, status: StatusLine,
                 emit: Callable[..., None]) -> None:
        self.params = params
        self.attempt = -1               # rounds so far, minus one
        self.epoch = 0                  # quick rounds since the last full one (0: none)
        self.nodes: tuple[int, ...] = ()  # the last agreement's nodes (Decision.nodes)
        self._full_attempt = 0          # the attempt of the last full round
        self._timeouts = timeouts
        self._status = status
        self._emit = emit
        self._last_info: Any = None
        self._worker_store: Any = None  # this round's TCPStore (the decider's only)
        self._served = -1               # the round (attempt) that opened it
        #: the TCPStore of the generation the workers are in, when this agent hosts it: kept
        #: through rounds that publish none (a quiet decision, session.drop_standbys), since
        #: the workers' groups formed later (a checkpoint's) still meet on it
        self._in_use: Any = None

    @property
    def can_quick(self) -> bool:
        return self._last_info is not None

    def open(self, spec: Any, node: int | None, quick: bool,
             alive: Callable[[], AbstractSet[int]] | None) -> tuple[Any, Members]:
        """This transition's round: quick (the last round's store, the nodes left) or full."""
        if quick and node is not None:
            return self.quick(node, alive)
        info = self.next(spec, first=node is None)
        return info, Members(info.rank, tuple(range(info.world_size)))

    def quick(self, node: int,
              alive: Callable[[], AbstractSet[int]] | None) -> tuple[Any, Members]:
        """Open the next quick round: (the last round's info, this round's members)."""
        self.attempt += 1
        self.epoch += 1
        keys = self.nodes or (node,)
        if alive is None:
            return self._last_info, Members(node, keys, alive)
        # in C (filterfalse), and only the few gone held in a new set: a Python step per node
        # made nodes^2 of them per round where thousands of agents share cores
        # (benchmarks/coordination_scale.py), and a set of every key a fresh 0.5 MB at 16384
        live = alive()
        gone = set(filterfalse(live.__contains__, keys))
        gone.discard(node)
        kept = tuple(filterfalse(gone.__contains__, keys)) if gone else keys
        return self._last_info, Members(node, kept, alive)

    def quick_called(self) -> bool:
        """Another agent opened the next quick round (one store read)."""
        if not self.can_quick or self.params.max_nodes == 1:
            return False
        try:
            return self._last_info.store.check([self._scope(self.epoch + 1) + OPENED])
        except STORE_LOST:
            return False   # nodes_waiting() fails over

    def finish(self, succeeded: bool, spec: Any) -> None:
        """No local worker is left. When they finished the script (``succeeded``), the job is
        over, and the last round's store says so to the nodes whose workers wait for a place
        (standbys, runtime/recovery/standby.py), which never finish by themselves. The rendezvous is
        closed as well (torch closes it after the end-of-run barrier): a node that starts a
        round now (one fenced as its workers finished, chaos short) would wait there for this
        one, which waits for it in the barrier; it ends with the job instead (agent.py). A node
        whose every device was lost says nothing: the job goes on elsewhere."""
        if not succeeded:
            return
        if self._last_info is not None:
            with contextlib.suppress(*STORE_LOST, RuntimeError):
                self._last_info.store.set(FINISHED, "1")
        try:
            spec.rdzv_handler.set_closed()
        except Exception as exc:  # noqa: BLE001 - torch closes it again at its shutdown
            log.debug("closing the rendezvous at the end failed: %s", exc)

    def stays_member(self, succeeded: bool, leases: bool) -> bool:
        """No local worker is left: whether this node stays a member with no device (it answers
        the quick rounds, which wait for every member's report) rather than wait for the end.
        So it does while the job trains on elsewhere, when every device here was lost (none
        ``succeeded``) and the other nodes' ``leases`` are watched (they tell when the job can
        no longer go on). In the exit barrier it left a quick round one report short (chaos:
        hung)."""
        return (leases and not succeeded and len(self.nodes) > 1
                and not self.finished_elsewhere())

    def finished_elsewhere(self) -> bool:
        """Another node's workers all succeeded (one store read)."""
        if self._last_info is None:
            return False
        try:
            return bool(self._last_info.store.check([FINISHED]))
        except (*STORE_LOST, RuntimeError):
            return False

    def next(self, spec: Any, first: bool) -> Any:
        self.attempt += 1
        self._full_attempt, self.epoch = self.attempt, 0
        if first:   # the job's first round: say what it waits for
            with RendezvousWait(spec.rdzv_handler, self.params, self._status):
                self._last_info = self._with_failover(spec)
        else:
            self._last_info = self._with_failover(spec)
        return self._last_info

    def _with_failover(self, spec: Any) -> Any:
        deadline = time.monotonic() + self._timeouts.failover_s
        for attempt in range(_FAILOVER_ATTEMPTS + 1):
            try:
                return spec.rdzv_handler.next_rendezvous()
            except STORE_LOST as exc:
                if (attempt == _FAILOVER_ATTEMPTS or time.monotonic() > deadline
                        or spec.rdzv_handler.get_backend() == "static"):
                    raise
                self.failover(spec, exc)
        raise AssertionError("unreachable")

    def failover(self, spec: Any, exc: BaseException) -> None:
        """The rendezvous store is unreachable: rebuild the handler from the same parameters."""
        start = time.perf_counter()
        try:
            torch_compat.stop_heartbeats(spec.rdzv_handler)   # the old store is gone
        except (RuntimeError, OSError) as stop_exc:
            log.debug("stopping heartbeats to the lost store failed: %s", stop_exc)
        spec.rdzv_handler = handler_for(self.params)
        self._last_info = None
        self._emit(Event.RENDEZVOUS_FAILOVER, error=str(exc).splitlines()[0][:300],
                   duration_s=time.perf_counter() - start)

    def nodes_waiting(self, spec: Any) -> tuple[int, bool]:
        """(nodes waiting to join, whether the store was lost): a lost store is failed over
        at once, and the caller starts a round on the new handler."""
        try:
            return spec.rdzv_handler.num_nodes_waiting(), False
        except STORE_LOST as exc:
            self._emit(Event.FAILURE_SEEN, kind="rendezvous_lost",
                       reason=str(exc).splitlines()[0][:300])
            self.failover(spec, exc)
            return 0, True

    def admit_survivors(self, spec: Any) -> None:
        """After the first round of a planned job, later rounds close with whoever is left.

        ``--nnodes N`` (or ``M:N``) is the size the job starts at. torch keeps the minimum for
        every round, so after losing a node of an ``--nnodes 2`` job the survivors would wait
        for a second node until the join timeout (10 minutes), then fail. Planning around lost
        devices is what a job file is for: the survivors go on with the devices they have, and
        a node that comes back joins at the next round, as under ``1:N``."""
        self.params.min_nodes = 1   # a failover's new handler keeps it too
        torch_compat.set_min_nodes(spec.rdzv_handler, 1)

    def scope(self) -> str:
        """Key prefix of the round: dynamic rendezvous stores are scoped by round already; the
        static one is not; a quick round adds its epoch."""
        return self._scope(self.epoch)

    def _scope(self, epoch: int) -> str:
        full = (f"chameleon/{self._full_attempt}/" if self.params.backend == "static"
                else "chameleon/")
        return full + (f"q{epoch}/" if epoch else "")

    def open_worker_store(self, spec: Any, info: Any, host: bool) -> tuple[str, int]:
        """This round's worker store: the deciding agent (``host``) opens it (or found it
        opened by its desk) and says where in the round's store; the others read that."""
        key = self.scope() + "worker_store"
        if host:
            addr, server = self._serve(spec, info)
            self._in_use = server   # the previous generation's, if ours, is dropped
            info.store.set(key, json.dumps([addr, server.port]))
        else:
            self._in_use = None     # one this agent hosted for an earlier generation
            if self._served != self.attempt:
                self._worker_store = None
        addr, port = json.loads(info.store.get(key))
        return str(addr), int(port)

    def hosts_workers(self) -> bool:
        """Whether this agent serves the store of the generation the workers are in."""
        return self._in_use is not None

    def desk(self, spec: Any, info: Any) -> WorkerStoreDesk:
        """Where this round's decider serves its decision: the worker store it opens."""
        return WorkerStoreDesk(lambda: self._serve(spec, info), self._timeouts.delta("store_s"))

    def _serve(self, spec: Any, info: Any) -> tuple[str, Any]:
        """(address, server) of this round's worker store, opened on first use: a fresh
        TCPStore per generation, at this agent's own address: ``--local-addr`` when given,
        since in a quick round the decider need not be the node that hosted the last full
        round's store (whose address the round's info holds; a lost node's, when that node is
        the one that was lost)."""
        addr = spec.master_addr or spec.local_addr or info.bootstrap_store_info.master_addr
        if self._served != self.attempt or self._worker_store is None:
            self._worker_store = None  # drop an earlier round's server first (not _in_use)
            # libuv (torch's default since 2.4, named so it stays): the legacy server
            # took 73 s to accept 16k ranks, libuv 13 s (benchmarks/worker_store_scale.py)
            self._worker_store = dist.TCPStore(host_name=addr, port=0, is_master=True,
                                               wait_for_workers=False, multi_tenant=False,
                                               timeout=self._timeouts.delta("store_s"),
                                               use_libuv=True)
            self._served = self.attempt
        return addr, self._worker_store

    def close(self) -> None:
        self._worker_store = self._in_use = None


class WorkerStoreDesk:
    """The deciding agent's desk (coordination.PlanDesk): its whole decision, in the
    generation's worker store that it hosts, for the agents whose own replay of the decision
    reached another digest. ``serve`` opens (once) and returns (address, server)."""

    KEY = "chameleon/decision"

    def __init__(self, serve: Callable[[], tuple[str, Any]], timeout: timedelta) -> None:
        self._serve, self._timeout = serve, timeout

    def offer(self, blob: bytes) -> str:
        addr, server = self._serve()
        server.set(self.KEY, blob)
        return json.dumps([addr, server.port])

    def fetch(self, source: str) -> bytes:
        addr, port = json.loads(source)
        client = dist.TCPStore(str(addr), int(port), is_master=False, timeout=self._timeout)
        return bytes(client.get(self.KEY))
