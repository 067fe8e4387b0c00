"""Node liveness through etcd leases: a dead node's key vanishes, survivors are told by a watch.

Protocol (one run = one prefix ``<key_prefix>/<run_id>/nodes/``):

1. Each agent grants itself a lease of ``ttl`` seconds and puts ``nodes/<node_id>`` bound to
   it, with a small JSON value (``node_id`` plus whatever ``info`` the agent gives: node rank,
   devices, address). JSON only; nothing in this prefix is ever unpickled.
2. A keep-alive thread refreshes the lease every ``ttl / 3`` seconds. When the agent dies
   (SIGKILL, power loss, network partition) refreshes stop and etcd itself deletes the key once
   the lease expires: at most ``ttl`` (+ etcd's 0.5 s expiry sweep) after the last refresh.
   Nobody compares wall clocks; the only clock is the etcd leader's lease timer.
3. Every agent watches the prefix: it lists it at revision R, then watches from R + 1, so no
   change is lost between the two. A key put is a ``joined`` event, a key delete a ``left``
   event (carrying the node's last JSON). If the watch breaks (etcd restart, leader change) the
   watcher lists again and emits the difference, then watches on; etcd itself renews every
   lease's TTL when a new leader takes over, so an etcd restart does not make live nodes vanish.
4. If our own lease is found expired (e.g. we were partitioned for longer than ``ttl``) a
   ``lease_lost`` event is emitted for us and we register again under a new lease, which the
   others see as ``left`` followed by ``joined``: the launcher treats that node as a new one.
   A keep-alive that fails (a leader change, a member restarting) is retried at once, each
   attempt cut to what is left before the lease is at risk, so that a second member is tried
   while the lease still holds.
5. ``stop()`` revokes the lease, so a clean exit is seen at once rather than after ``ttl``;
   ``finish()`` first marks the key ``finished``, so the others' ``left`` event tells a node
   that ended on purpose from one that was lost.
6. A node that has not refreshed its lease for ``ttl`` (etcd unreachable: a partition) emits
   ``lease_lost`` for itself without waiting to reach etcd again: by then etcd has dropped its
   key and the others count it lost, so its plan is stale (the launcher fences itself).
7. That was a presumption: etcd may only have been unable to answer (no leader for a while, a
   majority restarting), and etcd expires no lease without a leader and gives every lease a
   full TTL when a new leader takes over. So once etcd answers again the lease is checked: a
   keep-alive that renews it (TTL > 0) proves that the key never went and the others never
   counted this node lost, and ``lease_kept`` is emitted (the launcher lifts its fence: its
   node is still a member); a lease that is gone is lost for real (4.).

Use from an agent (chameleon-run)::

    client = EtcdClient(EtcdSettings.from_config(endpoint, rdzv_conf))
    live = NodeLiveness(client, settings.run_prefix(run_id), node_id="node3",
                        info={"node_rank": 3, "devices": [12, 13, 14, 15]},
                        ttl=settings.lease_ttl, on_event=handle)   # handle(NodeEvent) -> None
    live.start()              # registers, keeps alive, watches
    live.members()            # {node_id: info} currently alive
    live.events.get(timeout)  # the same NodeEvents as the callback, as a queue
    live.stop()               # revoke: peers see "left" at once

Callbacks run on the watcher thread; keep them short (hand work to another thread).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pyetcd import etcdrpc
from pyetcd import events as etcd_events

from chameleon_elastic.rendezvous.client import ETCD_FAILURES, EtcdClient
from chameleon_elastic.rendezvous.errors import EtcdConfigError, EtcdRendezvousError
from chameleon_elastic.rendezvous.pyetcd_compat import add_watch

__all__ = ["NodeEvent", "NodeLiveness", "list_nodes"]

log = logging.getLogger("chameleon_elastic.rendezvous.liveness")

EventKind = Literal["joined", "left", "lease_lost", "lease_kept"]


@dataclass(frozen=True)
class NodeEvent:
    """A change of the set of live nodes, seen at etcd revision ``revision``."""

    kind: EventKind
    node_id: str
    info: Mapping[str, Any] = field(default_factory=dict)
    revision: int = 0


def _nodes_prefix(run_prefix: str) -> str:
    return f"{run_prefix}nodes/"


def _decode(value: bytes) -> dict[str, Any]:
    try:
        decoded = json.loads(bytes(value).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {"invalid": True}
    return decoded if isinstance(decoded, dict) else {"value": decoded}


def list_nodes(client: EtcdClient, run_prefix: str) -> tuple[dict[str, dict[str, Any]], int]:
    """The live nodes of a run (``{node_id: info}``) and the etcd revision of that view."""
    prefix = _nodes_prefix(run_prefix)
    response = client.call("list nodes", lambda c: c.get_prefix_response(prefix))
    nodes = {
        bytes(kv.key).decode()[len(prefix) :]: _decode(kv.value) for kv in response.kvs
    }
    return nodes, int(response.header.revision)


class NodeLiveness:
    """Lease-backed registration of one node plus a watch on all nodes of the run.

    Args:
        client: the shared connection.
        run_prefix: ``<key_prefix>/<run_id>/``.
        node_id: unique name of this node in the run (letters, digits, ``._-``).
        info: JSON-serialisable description published with the key.
        ttl: lease time-to-live in seconds (>= 2 in practice: etcd's minimum TTL).
        on_event: called with every :class:`NodeEvent` (from the watcher thread).
        register_self: False for a pure observer (watch only, no key of its own).
    """

    def __init__(
        self,
        client: EtcdClient,
        run_prefix: str,
        node_id: str,
        info: Mapping[str, Any] | None = None,
        ttl: int = 5,
        on_event: Callable[[NodeEvent], None] | None = None,
        register_self: bool = True,
    ) -> None:
        if not node_id or "/" in node_id:
            raise EtcdConfigError(
                f"node id {node_id!r} cannot be an etcd key segment; use a non-empty name "
                "without '/', e.g. node-3."
            )
        if ttl < 1:
            raise EtcdConfigError(f"lease ttl {ttl} must be >= 1 second (use lease_ttl=5).")
        self._client = client
        self._prefix = _nodes_prefix(run_prefix)
        self.run_prefix = run_prefix
        self.node_id = node_id
        self.key = self._prefix + node_id
        self._info = dict(info or {})
        self._value = json.dumps({"node_id": node_id, **self._info}, sort_keys=True)
        self.ttl = ttl
        self._on_event = on_event
        self._register_self = register_self
        self.events: queue.Queue[NodeEvent] = queue.Queue()
        self._members: dict[str, dict[str, Any]] = {}
        self._numbers: frozenset[int] | None = None   # of _members, built when asked
        self._members_lock = threading.Lock()
        self._stop = threading.Event()
        self._watch_inbox: queue.Queue[object] = queue.Queue()
        self._lease_id: int | None = None
        self._last_refresh = 0.0    # monotonic time of the last successful keep-alive
        self._presumed_lost = False
        self._threads: list[threading.Thread] = []
        self._synced = threading.Event()

    # -- public API -----------------------------------------------------------------------

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    def start(self) -> NodeLiveness:
        """Register (if ``register_self``), then start the keep-alive and watcher threads.

        Returns once the first view of the members is known, so ``members()`` is valid.
        """
        if self._threads:
            return self
        if self._register_self:
            self._register()
            self._last_refresh = time.monotonic()
            for target, name in ((self._keep_alive_loop, "lease"),
                                 (self._expiry_loop, "lease-expiry")):
                self._threads.append(threading.Thread(
                    target=target, name=f"etcd-{name}-{self.node_id}", daemon=True))
        watcher = threading.Thread(
            target=self._watch_loop, name=f"etcd-watch-{self.node_id}", daemon=True
        )
        self._threads.append(watcher)
        for thread in self._threads:
            thread.start()
        if not self._synced.wait(self._client.settings.retry_timeout):
            self.stop()
            raise EtcdRendezvousError(
                f"Could not read the node list under {self._prefix} within the retry timeout; "
                "check that etcd is reachable (see the connection errors logged above)."
            )
        return self

    def members(self) -> dict[str, dict[str, Any]]:
        """Live nodes as this watcher last saw them: ``{node_id: info}``."""
        with self._members_lock:
            return {k: dict(v) for k, v in self._members.items()}

    def numbers(self) -> frozenset[int]:
        """The ``node`` numbers of the live nodes' infos, as this watcher last saw them:
        ``members`` without copying every info, built once per change (a quick round's
        followers check it between their wait slices: 4096 of them every second at 4096
        nodes, each a set of 4096 built anew before)."""
        with self._members_lock:
            if self._numbers is None:
                self._numbers = frozenset(int(info["node"]) for info in self._members.values()
                                          if "node" in info)
            return self._numbers

    def stop(self, revoke: bool = True) -> None:
        """Stop the threads; revoke the lease (peers see ``left`` at once) unless told not to."""
        self._stop.set()
        self._watch_inbox.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self._client.settings.rpc_timeout + 1)
        self._threads = []
        lease_id, self._lease_id = self._lease_id, None
        if revoke and lease_id is not None:
            try:
                self._client.call(
                    "revoke lease",
                    lambda c: c.revoke_lease(lease_id),
                    timeout=self._client.settings.rpc_timeout,
                )
            except ETCD_FAILURES:  # best effort: the lease expires by itself anyway
                log.warning("revoking lease %x failed; it will expire by itself", lease_id)

    def finish(self) -> None:
        """Leave as a node that ended on purpose: mark the key ``finished`` (so the ``left``
        event the others receive carries it) and revoke the lease."""
        lease_id = self._lease_id
        if lease_id is not None:
            value = json.dumps({"node_id": self.node_id, **self._info, "finished": True},
                               sort_keys=True)
            try:
                self._client.call("mark node finished",
                                  lambda c: c.put(self.key, value, lease=lease_id),
                                  timeout=self._client.settings.rpc_timeout)
            except ETCD_FAILURES:
                log.warning("marking node %s finished failed; peers may count it as lost",
                            self.node_id)
        self.stop(revoke=True)

    def __enter__(self) -> NodeLiveness:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- registration and keep-alive ------------------------------------------------------

    def _register(self) -> None:
        lease = self._client.call("grant lease", lambda c: c.lease(self.ttl))
        self._client.call("register node", lambda c: c.put(self.key, self._value, lease=lease.id))
        self._lease_id = int(lease.id)
        log.info("node %s registered under %s (lease %x, ttl %d s)", self.node_id, self.key,
                 lease.id, self.ttl)

    def _keep_alive_loop(self) -> None:
        interval = max(self.ttl / 3.0, 0.2)
        while not self._stop.wait(interval):
            lease_id = self._lease_id
            if lease_id is None:
                return
            try:
                answers = self._refresh(lease_id, interval)
            except ETCD_FAILURES as exc:  # etcd unreachable: keep trying, it may come back
                (log.debug if self._presumed_lost else log.warning)(
                    "lease keep-alive for %s failed: %s", self.node_id, exc)
                continue
            if answers and all(answer.TTL > 0 for answer in answers):
                self._refreshed()
                continue
            if self._stop.is_set():
                return
            log.warning("lease of node %s expired; registering again", self.node_id)
            if not self._presumed_lost:
                self._emit(NodeEvent("lease_lost", self.node_id, dict(self._info), 0))
            try:
                self._register()
            except ETCD_FAILURES as exc:
                log.warning("re-registering node %s failed: %s", self.node_id, exc)
            else:
                with self._members_lock:
                    self._last_refresh, self._presumed_lost = time.monotonic(), False

    def _refresh(self, lease_id: int, interval: float) -> list[Any]:
        """One keep-alive, retried until the lease is at risk (``ttl`` after the last refresh;
        at least ``interval`` once it is past: a presumed-lost lease is asked after until etcd
        answers). Each attempt's RPC deadline is cut to what is left, so that a member that
        does not answer (restarting, or the leader it forwards to just changed) leaves time to
        try another before the lease is at risk."""
        with self._members_lock:
            at_risk = self._last_refresh + self.ttl
        deadline = max(at_risk, time.monotonic() + interval)
        rpc_timeout = self._client.settings.rpc_timeout
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)

        def keep_alive(c: Any) -> list[Any]:
            left = max(0.2, min(rpc_timeout, deadline - time.monotonic()))
            return list(c.leasestub.LeaseKeepAlive(iter([request]), left,
                                                   credentials=c.call_credentials,
                                                   metadata=c.metadata))

        return self._client.call("lease keep-alive", keep_alive,
                                 timeout=max(0.0, deadline - time.monotonic()))

    def _refreshed(self) -> None:
        """etcd renewed the lease. After a presumed loss (no answer for a whole ttl) that
        proves the lease outlived etcd's trouble: the key never went, the others never counted
        this node lost (module docstring, 7.)."""
        with self._members_lock:
            kept = self._presumed_lost
            self._last_refresh, self._presumed_lost = time.monotonic(), False
        if kept and not self._stop.is_set():
            log.warning("lease of node %s outlived etcd's trouble: the node was never lost",
                        self.node_id)
            self._emit(NodeEvent("lease_kept", self.node_id, dict(self._info), 0))

    def _expiry_loop(self) -> None:
        """No refresh for a whole ttl: etcd has dropped our key by now (by its own clock), so
        the others count us lost; say so at once, without waiting to reach etcd again (a
        refresh can hang for seconds while we are cut off)."""
        while not self._stop.wait(min(0.25, self.ttl / 8)):
            with self._members_lock:
                due = (not self._presumed_lost
                       and time.monotonic() - self._last_refresh > self.ttl)
                if due:
                    self._presumed_lost = True
            if due:
                self._emit(NodeEvent("lease_lost", self.node_id, dict(self._info), 0))

    # -- watching -------------------------------------------------------------------------

    def _emit(self, event: NodeEvent) -> None:
        self.events.put(event)
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:
                log.exception("liveness callback failed for %s", event)

    def _apply_listing(self, nodes: dict[str, dict[str, Any]], revision: int) -> None:
        with self._members_lock:
            before, self._members, self._numbers = self._members, dict(nodes), None
        for node_id in sorted(before.keys() - nodes.keys()):
            self._emit(NodeEvent("left", node_id, before[node_id], revision))
        for node_id in sorted(nodes.keys() - before.keys()):
            self._emit(NodeEvent("joined", node_id, nodes[node_id], revision))

    def _apply_event(self, event: Any, revision: int) -> None:
        node_id = bytes(event.key).decode()[len(self._prefix) :]
        if isinstance(event, etcd_events.DeleteEvent):
            with self._members_lock:
                info = self._members.pop(node_id, None)
                self._numbers = None
            if info is not None:
                self._emit(NodeEvent("left", node_id, info, revision))
        elif isinstance(event, etcd_events.PutEvent):
            info = _decode(event.value)
            with self._members_lock:
                known = node_id in self._members
                self._members[node_id] = info
                self._numbers = None
            if not known:
                self._emit(NodeEvent("joined", node_id, info, revision))

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                nodes, revision = list_nodes(self._client, self.run_prefix)
                self._apply_listing(nodes, revision)
                self._synced.set()
                inbox: queue.Queue[object] = queue.Queue()
                self._watch_inbox = inbox
                if self._stop.is_set():
                    return
                watch = self._client.call(
                    "watch nodes",
                    lambda c, put=inbox.put, start=revision + 1: add_watch(
                        c, self._prefix, put, prefix=True, start_revision=start),
                )
            except ETCD_FAILURES as exc:
                log.warning("node watch on %s failed (%s); retrying", self._prefix, exc)
                self._stop.wait(0.5)
                continue
            try:
                self._drain(inbox)
            finally:
                try:
                    watch.cancel()   # on its own stream (pyetcd_compat.add_watch)
                except Exception:  # the stream is already gone after an etcd restart
                    log.debug("cancelling the node watch failed", exc_info=True)

    def _drain(self, inbox: queue.Queue[object]) -> None:
        while not self._stop.is_set():
            item = inbox.get()
            if item is None:
                return
            header = getattr(item, "header", None)
            events = getattr(item, "events", None)
            if header is None or events is None:  # an error: re-list and re-watch
                log.info("node watch on %s broke (%s); re-listing", self._prefix, item)
                time.sleep(0.05)
                return
            for event in events:
                self._apply_event(event, int(header.revision))
