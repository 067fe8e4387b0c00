"""The simulated agents of ``coordination_scale.py``: what each one holds on etcd and runs.

Each :class:`Agent` holds a production agent's etcd state: its own lease and node key (granted
by ``NodeLiveness``), its own etcd watch on the run's nodes and the round's store (``EtcdStore``
under torch's ``PrefixStore``), and on another node's loss it runs the real quick round and
agreement. What the agents of one host process share, and why (etcd's requests, watchers and
bytes stay those of production; only this machine's bookkeeping is done once per host):

- :class:`HostView`, the host's one copy of the live nodes. Every agent's watch still delivers
  every event (etcd's fan-out is production's), but the bookkeeping (``NodeLiveness``'s) is
  applied once per event per host: a copy per agent is nodes^2 entries, 268 million at 16384
  nodes (and the listing's ``joined`` events as many), more than this machine's 24 GiB.
- each agent's recovery thread is started with the agent, idle until its watch sees a node
  leave: a production agent's monitor loop is running when the loss comes, and starting a
  thread inside the watch's callback held every later event of that stream behind it (4096
  thread starts on two cores).
- one process replays each planning step once for its agents (``share_local_work``).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

DEVICES_PER_NODE = 8
RUN_ID = "scale"


def spec_for(nodes: int) -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from planner_latency import spec_for as scaled

    return scaled(nodes * DEVICES_PER_NODE)


def params_for(endpoints: str, nodes: int, ttl: int) -> Any:
    """The agents' rendezvous parameters. ``rpc_timeout`` 60 s (5 s in production): a request
    queued behind a thousand agents' on two cores outlives 5 s, and etcd 3.5.1 (the one
    bundled here) panics when a read-only transaction's deadline passes while it runs
    ("unexpected error during txn"), which takes a member down."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(backend="etcd-v3", endpoint=endpoints, run_id=RUN_ID,
                                min_nodes=1, max_nodes=nodes, lease_ttl=str(ttl),
                                rpc_timeout="60")


def stores_of(client: Any) -> tuple[Any, Any]:
    """(the round's store as torch hands it to agents: a PrefixStore on EtcdStore, and the
    EtcdStore, which the caller keeps referenced: torch's bridge forwards its extended calls
    such as compare_set only while the Python object lives, as the handler's does)."""
    import torch.distributed as dist

    from chameleon_elastic.rendezvous.store import EtcdStore

    etcd_store = EtcdStore(client, client.settings.run_prefix(RUN_ID))
    return dist.PrefixStore(f"torch.rendezvous.{RUN_ID}.0", etcd_store), etcd_store


class Clock:
    """Timestamps (monotonic: one clock for every process of the host) of named moments, and
    the calling thread's CPU time in each (wall less CPU: the run queue and etcd's answers)."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.lock = threading.Lock()

    def wrap(self, module: Any, name: str) -> None:
        inner = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.monotonic(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                with self.lock:
                    self.marks[f"{name}_start"] = start
                    self.marks[f"{name}_end"] = time.monotonic()
                    self.marks[f"{name}_cpu"] = time.thread_time() - cpu

        setattr(module, name, timed)


def share_local_work(local: dict[str, float]) -> None:
    """Within one host process, take each planning step once and adopt each plan once.

    On real nodes every agent replays the decider's step (``JobSession.step``: the planner,
    or a lookup in its plan cache, and the plan file) on its own cores, in parallel; here a
    thousand of them would queue on two cores (the benchmark's sessions have no plan cache:
    a cold planner run each, 0.1-0.4 s of CPU at 8192 devices), which measures this machine,
    not the protocol. So the first agent of a process to take a step from a digest does the
    real work, its thread's CPU time is kept in ``local`` (the per-agent cost reported beside
    the adoption), and the others of the process get the same state. Every agent still reads
    the agreement from etcd and checks its own digest, which is what etcd's load and the
    adoption's wire time are made of."""
    from chameleon_elastic.launcher.session import JobSession

    stepped: dict[Any, Any] = {}
    adopted: dict[Any, Any] = {}
    real_step, real_adopt = JobSession.step, JobSession.adopt
    lock = threading.Lock()

    def keep(self: Any) -> tuple[Any, ...]:
        return (self.plan, set(self.excluded), dict(self.speeds), self._plan_hash,
                self.plan_file)

    def restore(self: Any, state: tuple[Any, ...]) -> None:
        plan, excluded, speeds, plan_hash, plan_file = state
        self.plan, self.excluded, self.speeds = plan, set(excluded), dict(speeds)
        self._plan_hash, self.plan_file = plan_hash, plan_file

    def step(self: Any, lost: Any, joined: Any, speeds: Any, renew: bool,
             quiet: bool = False) -> Any:
        key = (self.digest, tuple(sorted(lost)), tuple(sorted(joined)),
               tuple(sorted(speeds.items())), renew, quiet)
        with lock:
            if key not in stepped:
                start = time.thread_time()
                change = real_step(self, lost, joined, speeds, renew, quiet)
                local["step_cpu_s"] = max(local.get("step_cpu_s", 0.0),
                                          time.thread_time() - start)
                stepped[key] = (change, keep(self))
                return change
            change, state = stepped[key]
        restore(self, state)
        return change

    def adopt(self: Any, plan: Any, excluded: Any, speeds: Any = None) -> Any:
        key = (plan.generation, tuple(sorted(excluded)))
        with lock:
            if key not in adopted:
                start = time.thread_time()
                adopted[key] = (real_adopt(self, plan, excluded, speeds), keep(self))
                local["adopt_cpu_s"] = time.thread_time() - start
                return adopted[key][0]
        restore(self, adopted[key][1])
        return adopted[key][0]

    JobSession.step = step   # type: ignore[method-assign]
    JobSession.adopt = adopt   # type: ignore[method-assign]


def round_limit_s(nodes: int) -> float:
    """The quick round's limit here (15 s in production): 120 s, or a second per 30 nodes
    above 3600, since two cores take the reports of thousands of agents one after the other."""
    return max(120.0, nodes / 30)


class Waker:
    """At most ``n`` agents of a host awake at once (0: no bound; ``--active``). An agent is
    woken through :meth:`wake` (by its watch's news of the loss, then by the decision's
    event), marks itself :meth:`awake` when it runs, and :meth:`asleep` once it blocks again
    (its wait for the decision holds its watch) or is done; the next queued wake-up goes then.
    Production's agents each have their own node: none waits here.

    Why the wake-ups themselves are metered: a host's thousands of agent threads woken at
    once (each watch callback setting its agent's event) all wait for one interpreter lock,
    and each waiter wakes every 5 ms to ask for it. At 16384 nodes (4096 agents a process) the
    decision's publication took the load average from 30 to 2400 and no agent adopted within
    minutes; a gate the woken threads queue at comes too late, since each must run to reach
    it. Before the decision, gRPC adds its own: a thread blocked in a call wakes every 0.1 s
    (``grpc._common.MAXIMUM_WAIT_TIMEOUT``), so the agents between the loss and their watch
    are kept to ``n`` as well."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._room = threading.Condition()
        self._awake = 0
        self._mine = threading.local()
        if n > 0:
            threading.Thread(target=self._run, daemon=True, name="waker").start()

    def wake(self, wake_up: Any) -> None:
        """Call ``wake_up`` (it wakes one agent) when fewer than ``n`` are awake."""
        if self.n > 0:
            self._queue.put(wake_up)
        else:
            wake_up()

    def awake(self) -> None:
        self._mine.on = True

    def asleep(self) -> None:
        if getattr(self._mine, "on", False):
            self._mine.on = False
            with self._room:
                self._awake = max(0, self._awake - 1)
                self._room.notify()

    def _run(self) -> None:
        while True:
            wake_up = self._queue.get()
            with self._room:
                while self._awake >= self.n:
                    self._room.wait()
                self._awake += 1
            wake_up()


def note_reports() -> dict[int, float]:
    """When each agent's report was written (``protocol.report``), by node."""
    from chameleon_elastic.launcher.coordination import agreement as protocol

    at: dict[int, float] = {}
    inner = protocol.report

    def report(store: Any, scope: str, key: int, mine: Any, opens: bool = False) -> None:
        inner(store, scope, key, mine, opens)
        at[key] = time.monotonic()

    protocol.report = report
    return at


def meter_agents(waker: Waker) -> None:
    """The agents' store waits woken through ``waker`` (see :class:`Waker`): an agent falls
    asleep once its wait for the decision holds its watch (from then on it makes no request
    until the decision wakes it), and the event that wakes it waits its turn."""
    from chameleon_elastic.launcher.coordination import agreement as protocol
    from chameleon_elastic.rendezvous import store as store_module

    inner_watch, inner_read = store_module.EtcdStore._watch, protocol.read_agreement
    inner_add = store_module.add_watch

    def add_watch(client: Any, key: str, callback: Any, **kwargs: Any) -> Any:
        return inner_add(client, key, lambda response: waker.wake(lambda: callback(response)),
                         **kwargs)

    def watch(self: Any, key: str, start_revision: int) -> Any:
        # awake: an agent watches again after a wake-up that was not the decision (its stream
        # broke: a member restarted), and that wake-up's slot is given back as it sleeps again;
        # unmarked, each break kept a slot, and after --active of them no event of the host
        # ran (a restart at 1024 nodes: three hosts' agents never adopted)
        waker.awake()
        try:
            return inner_watch(self, key, start_revision)
        finally:
            waker.asleep()

    def read_agreement(store: Any, scope: str, timeout_s: float | None = None) -> Any:
        waker.awake()   # woken by the decision (or it was there at the first read)
        return inner_read(store, scope, timeout_s)

    store_module.add_watch = add_watch
    store_module.EtcdStore._watch = watch   # type: ignore[method-assign]
    protocol.read_agreement = read_agreement


class HostView:
    """The live nodes as this host's agents' watches report them, kept once per host (see
    the module docstring): an event is applied by the first agent whose watch delivers it,
    with the real bookkeeping (``NodeLiveness._apply_event``); the others find it applied."""

    def __init__(self, client: Any) -> None:
        from chameleon_elastic.rendezvous.liveness import NodeLiveness

        self.live = NodeLiveness(client, client.settings.run_prefix(RUN_ID), "host-view",
                                 register_self=False)
        self._applied: set[tuple[int, bytes]] = set()
        self._keys: tuple[int, ...] = ()
        self._lock = threading.Lock()

    def listing(self, nodes: dict[str, dict[str, Any]], revision: int) -> None:
        self.live._apply_listing(nodes, revision)
        self.live.events = queue.Queue()   # the listing's joins: nobody reads

    def apply(self, event: Any, revision: int) -> None:
        key = (revision, bytes(event.key))
        with self._lock:
            if key in self._applied:
                return
            self._applied.add(key)
        self.live._apply_event(event, revision)
        while not self.live.events.empty():   # nobody reads the view's events
            self.live.events.get_nowait()

    def numbers(self) -> frozenset[int]:
        return self.live.numbers()

    def keys(self, nodes: int) -> tuple[int, ...]:
        """Every node's number, one tuple for the host's agents."""
        if len(self._keys) != nodes:
            self._keys = tuple(range(nodes))
        return self._keys


class Agent:
    """One simulated node: its lease and node key (``NodeLiveness``, registered, not started:
    its three threads are replaced by the host's shared keep-alive and the view), its own
    watch on the run's nodes, its store, and on another node's loss the quick round, on its
    own thread, started idle with the agent."""

    def __init__(self, node: int, nodes: int, client: Any, view: HostView, session: Any,
                 desk: Any = None) -> None:
        from chameleon_elastic.launcher.coordination.rounds import Rounds
        from chameleon_elastic.rendezvous.liveness import NodeLiveness

        self.node, self.nodes, self.client, self.session = node, nodes, client, session
        self.view, self.desk = view, desk
        self.out: dict[str, Any] = {}
        self.closing = False
        self.live = NodeLiveness(client, client.settings.run_prefix(RUN_ID), f"node-{node}",
                                 info={"node": node}, ttl=client.settings.lease_ttl)
        self.store, self.etcd_store = stores_of(client)
        self.rounds = Rounds(SimpleNamespace(backend="etcd-v3", max_nodes=nodes), None, None, None)
        # the last agreement's nodes: one tuple per host (16384 of them per agent: 0.5 GB a host)
        self.rounds._last_info, self.rounds.nodes = SimpleNamespace(store=self.store), \
            view.keys(nodes)
        self.decider_nice: int | None = None   # see --decider-nice
        self.waker = Waker(0)   # the host's (--active)
        self._go = threading.Event()
        self.thread = threading.Thread(target=self._recover_when_told, daemon=True,
                                       name=f"agent-{node}")

    def alive(self) -> frozenset[int]:
        """``NodeWatch.alive``: the nodes the host's view last saw holding their lease."""
        return self.view.numbers()

    def watch(self, revision: int) -> None:
        """This agent's own etcd watch on the nodes prefix, from ``revision`` (the host's
        listing's); its recovery thread started, idle."""
        self.thread.start()
        self._watch_from(revision)

    def _watch_from(self, revision: int) -> None:
        """The watch, from ``revision`` on; a stream that breaks (its member restarted:
        ``--leader-change restart``) is watched again from the last revision seen, on a
        thread of its own (the callback runs on the stream's), as ``NodeLiveness`` does."""
        seen = [revision]
        from chameleon_elastic.rendezvous.pyetcd_compat import add_watch

        own = self.live.key.encode()

        def on_response(response: Any) -> None:
            if getattr(response, "events", None) is None:   # the stream broke
                if not self.closing:   # not the host's own close at the end
                    self.out["watch_breaks"] = self.out.get("watch_breaks", 0) + 1
                    threading.Thread(target=self._rewatch, args=(seen[0], response),
                                     daemon=True).start()
                return
            revision = int(response.header.revision)
            seen[0] = max(seen[0], revision)
            for event in response.events:
                self.view.apply(event, revision)
                if type(event).__name__ == "DeleteEvent" and bytes(event.key) != own:
                    self._lost(bytes(event.key).decode()[len(self.live._prefix):])

        prefix = self.live._prefix
        self.client.call("watch nodes", lambda c: add_watch(
            c, prefix, on_response, prefix=True, start_revision=seen[0] + 1))

    def _rewatch(self, revision: int, why: Any) -> None:
        try:
            self._watch_from(revision)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
            self.out.setdefault("error", f"node watch broke ({why}) and could not be "
                                         f"watched again: {exc}")

    def _lost(self, node_id: str) -> None:
        """A node left: note when, and wake the agent's recovery thread (the production
        agent's monitor loop does the same on its own; here the host's waker lets it run)."""
        if "detected" in self.out:
            return
        self.out["detected"], self.out["trigger"] = time.monotonic(), node_id
        self.waker.wake(self._go.set)

    def _recover_when_told(self) -> None:
        self._go.wait()
        self.waker.awake()
        try:
            if not self.closing:
                self.recover()
        finally:
            self.waker.asleep()

    def stop(self) -> None:
        """Let an idle recovery thread end (the host is done)."""
        self.closing = True
        self._go.set()

    def recover(self) -> None:
        from chameleon_elastic.launcher.coordination import agreement as protocol
        from chameleon_elastic.launcher.coordination import messages

        self.out["tid"] = threading.get_native_id()   # for --cpu-profile's accounting
        try:
            _, members = self.rounds.quick(self.node, self.alive)
            if members.decides and self.decider_nice is not None:
                # this thread only (Linux nice is per thread): a real node's agent has its
                # node's CPU, not a 2-core machine shared with a thousand agents
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.decider_nice)
            devices = tuple(range(self.node * DEVICES_PER_NODE,
                                  (self.node + 1) * DEVICES_PER_NODE))
            mine = messages.NodeReport(self.node, (), devices, True)
            decision, change, _ = protocol.agree(self.store, self.rounds.scope(), members,
                                                  mine, self.session, True, DEVICES_PER_NODE,
                                                  round_limit_s(self.nodes), quick=True,
                                                  desk=self.desk)
            self.out["adopted"] = time.monotonic()
            self.out["generation"] = decision.plan.generation if decision.plan else None
            self.out["excluded"] = len(decision.excluded)
            self.out["digest"] = self.session.digest
            self.out["agreed"] = None if change is None else change.agreed
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
            self.out["error"] = f"{type(exc).__name__}: {exc}"


def host_desk() -> Any:
    """The host's desk (launcher/coordination/rounds.py's): the worker store the deciding agent hosts,
    opened when it first offers its decision, from which an agent whose replay differs
    fetches it (none should: every agent starts from the same digest)."""
    from datetime import timedelta

    import torch.distributed as dist

    from chameleon_elastic.launcher.coordination.rounds import WorkerStoreDesk

    opened: list[Any] = []

    def serve() -> tuple[str, Any]:
        if not opened:
            opened.append(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
        return "127.0.0.1", opened[0]

    return WorkerStoreDesk(serve, timedelta(seconds=60))


