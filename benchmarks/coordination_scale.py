"""The agents' quick-round coordination at 256-1024 simulated nodes, on a real etcd cluster.

Each simulated node holds what a production agent holds on etcd: its own lease and node key
(granted by ``NodeLiveness``), its own watch on the run's nodes (events applied by
``NodeLiveness``'s bookkeeping), and the round's store (``EtcdStore`` under torch's
``PrefixStore``). Workers are faked: each node reports 8 live devices. One node is killed (its
keep-alive stops, so its lease expires after the TTL; ``--kill revoke`` revokes it instead) and
every other agent, on its own thread, runs the real recovery path: ``Rounds.quick`` then
``protocol.agree(quick=True)``, the lowest node deciding with the real planner (a
``JobSession`` on the Llama-2-7B spec of ``planner_latency.py`` scaled to 8 devices per node;
cold, no plan cache: the worst case).

What is lighter than production, so that 1024 agents fit on two cores (a thread set per agent
made 1300 threads at 256 agents and took etcd down), and why it does not change what is
measured (etcd's requests, watchers and bytes are those of production):

- the agents of one process share ``--channels`` etcd clients: each agent's watch is still its
  own etcd watcher, multiplexed on its client's stream (fewer watch streams than production);
- one keep-alive process per host refreshes every lease of its agents at ttl / 3, the requests
  production makes, instead of a thread per agent (behind hundreds of agent threads on one GIL
  a refresh outlived the TTL); the self-fencing expiry check is not on the measured path;
- one process replays each planning step once for its agents (every agent reads the agreement
  and checks its own digest); that per-agent CPU (parallel on real nodes) is measured and
  reported beside the adoption;
- ``rpc_timeout`` is 60 s and the quick round's limit 120 s: requests queue behind a thousand
  agents' on two cores;
- above 1000 nodes the followers' wait slices (a wake-up to check the decider's lease, 1 s in
  production) grow to nodes / 1000 s, so that all of them together wake about 1000 times a
  second, as at 1000 nodes; the keep-alive processes run at the members' priority (-10, as
  root), each standing in for keep-alive threads that have their nodes' CPUs.

Reported: kill -> every agent adopted, split into detection (the lease's deletion seen by the
agents' watches), reports (the last agent seeing the loss -> the decider holding every report),
decision (the planning step), publication (fenced record, the whole decision offered in the
decider's worker store, the agreement under ``decision`` and the ``decided`` key; both
also as the deciding thread's own CPU time, so that wall less CPU is the wait on the run queue
and on etcd) and adoption (published -> the last agent adopted); etcd's load over the steady state and the
round (requests per second, bytes sent, summed over the members' ``/metrics``, and the
watchers); and the CPU that etcd and the agents used during the round. ``--cpu-profile`` adds,
per phase, who used the CPU: each member, the deciding thread, the other agents' threads, the
hosts' other threads, the keep-alives and the rest of the machine (``cpu_window.py``, /proc).

``--leader-change move|restart`` changes etcd's leader inside the round (``etcd_trouble.py``:
``--leader-change-at`` seconds after the lost node's key went, while the agents report and
wait): the leader hands its role to another member, or is killed and restarted. Every agent
must still adopt (a leader change is waited out within the round's deadline); the row says
when the change came, which members led before and after, and the raft terms. With
``restart`` the members' counters restart too, so the round's etcd figures undercount.

    python benchmarks/coordination_scale.py [--nodes 256,1024] [--members 3] [--procs 4]
        [--channels 16] [--ttl 5] [--steady 10] [--kill expiry|revoke] [--decider-nice N]
        [--cpu-profile] [--leader-change move|restart] [--leader-change-at S] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

DEVICES_PER_NODE = 8
RUN_ID = "scale"


def spec_for(nodes: int) -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from planner_latency import spec_for as scaled

    return scaled(nodes * DEVICES_PER_NODE)


def _params(endpoints: str, nodes: int, ttl: int) -> Any:
    """The agents' rendezvous parameters. ``rpc_timeout`` 60 s (5 s in production): a request
    queued behind a thousand agents' on two cores outlives 5 s, and etcd 3.5.1 (the one
    bundled here) panics when a read-only transaction's deadline passes while it runs
    ("unexpected error during txn"), which takes a member down."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(backend="etcd-v3", endpoint=endpoints, run_id=RUN_ID,
                                min_nodes=1, max_nodes=nodes, lease_ttl=str(ttl),
                                rpc_timeout="60")


def _stores(client: Any) -> tuple[Any, Any]:
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


def _share_local_work(local: dict[str, float]) -> None:
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


def _note_reports() -> dict[int, float]:
    """When each agent's report was written (``protocol.report``), by node."""
    from chameleon_elastic.launcher.coordination import agreement as protocol

    at: dict[int, float] = {}
    inner = protocol.report

    def report(store: Any, scope: str, key: int, mine: Any) -> None:
        inner(store, scope, key, mine)
        at[key] = time.monotonic()

    protocol.report = report
    return at


class Agent:
    """One simulated node: its lease and node key (``NodeLiveness``, registered, not started:
    its three threads are replaced by the host's shared keep-alive and watch dispatch), its
    own watch on the run's nodes, its store, and on another node's loss the quick round."""

    def __init__(self, node: int, nodes: int, client: Any, params: Any, session: Any,
                 desk: Any = None) -> None:
        from chameleon_elastic.launcher.coordination.rounds import Rounds
        from chameleon_elastic.rendezvous.liveness import NodeLiveness

        self.node, self.nodes, self.client, self.session = node, nodes, client, session
        self.desk = desk
        self.out: dict[str, Any] = {}
        self.thread: threading.Thread | None = None
        self.closing = False
        self.live = NodeLiveness(client, client.settings.run_prefix(RUN_ID), f"node-{node}",
                                 info={"node": node}, ttl=client.settings.lease_ttl,
                                 on_event=self._on_event)
        self.store, self.etcd_store = _stores(client)
        self.rounds = Rounds(SimpleNamespace(backend="etcd-v3", max_nodes=nodes), None, None, None)
        self.rounds._last_info, self.rounds.nodes = SimpleNamespace(store=self.store), \
            tuple(range(nodes))
        self.params = params
        self.decider_nice: int | None = None   # see --decider-nice

    def alive(self) -> set[int]:
        """``NodeWatch.alive``: the nodes this agent's watch last saw holding their lease."""
        return self.live.numbers()

    def watch(self, listing: dict[str, dict[str, Any]], revision: int) -> None:
        """This agent's own etcd watch on the nodes prefix, from the revision of ``listing``:
        events go to ``NodeLiveness._apply_event`` (the real bookkeeping), on the shared
        client's watch-dispatch thread."""
        self.live._apply_listing(listing, revision)
        self._watch_from(revision)

    def _watch_from(self, revision: int) -> None:
        """The watch, from ``revision`` on; a stream that breaks (its member restarted:
        ``--leader-change restart``) is watched again from the last revision seen, on a
        thread of its own (the callback runs on the stream's), as ``NodeLiveness`` does."""
        seen = [revision]

        def on_response(response: Any) -> None:
            if getattr(response, "events", None) is None:   # the stream broke
                if not self.closing:   # not the host's own close at the end
                    self.out["watch_breaks"] = self.out.get("watch_breaks", 0) + 1
                    threading.Thread(target=self._rewatch, args=(seen[0], response),
                                     daemon=True).start()
                return
            seen[0] = max(seen[0], int(response.header.revision))
            for event in response.events:
                self.live._apply_event(event, int(response.header.revision))

        prefix = self.live._prefix
        self.client.call("watch nodes", lambda c: c.add_watch_prefix_callback(
            prefix, on_response, start_revision=seen[0] + 1))

    def _rewatch(self, revision: int, why: Any) -> None:
        try:
            self._watch_from(revision)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
            self.out.setdefault("error", f"node watch broke ({why}) and could not be "
                                         f"watched again: {exc}")

    def _on_event(self, event: Any) -> None:
        """A node left: note when, and run the recovery on the agent's own thread (the
        production agent's monitor loop does the same on its own)."""
        if event.kind != "left" or event.node_id == self.live.node_id or self.thread:
            return
        self.out["detected"], self.out["trigger"] = time.monotonic(), event.node_id
        self.thread = threading.Thread(target=self.recover, daemon=True,
                                       name=f"agent-{self.node}")
        self.thread.start()

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
                                                  120.0, quick=True, desk=self.desk)
            self.out["adopted"] = time.monotonic()
            self.out["generation"] = decision.plan.generation if decision.plan else None
            self.out["excluded"] = len(decision.excluded)
            self.out["digest"] = self.session.digest
            self.out["agreed"] = None if change is None else change.agreed
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
            self.out["error"] = f"{type(exc).__name__}: {exc}"


_KEEP_TICK_S = 0.5   # the keep-alive process refreshes the leases due in each tick at once


def _keeper(endpoints: str, ttl: int, connected: Any, inbox: Any, victim: int, killed: Any,
            stop: Any, spoiled: Any, ready: Any) -> None:
    """Refresh each lease every ttl / 3, spread evenly over that interval: the production
    keep-alive's requests (one ``LeaseKeepAliveRequest`` per lease per ttl / 3), from one
    process per host instead of a thread per agent. The leases due in one tick go as the
    messages of one ``LeaseKeepAlive`` stream (one stream per refresh, as pyetcd opens it,
    fell behind the TTL at 1024 leases a process on the loaded 2-core machine: etcd's
    messages are the same, its streams fewer). Its own process: in the host, behind a few
    hundred agent threads taking turns on the GIL during the round, a refresh could wait
    longer than the TTL. A lease found expired (the victim's after ``killed`` aside) spoils the
    run: say so to the parent and stop. It sets ``connected`` once it can reach etcd (the host
    grants no lease before), then receives the host's (node, lease) pairs on ``inbox`` as the
    host grants them (at 4096 nodes a host's registrations outlast a 30 s TTL)."""
    from chameleon_elastic.rendezvous.client import ETCD_FAILURES, EtcdClient
    from chameleon_elastic.rendezvous.config import EtcdSettings

    params = _params(endpoints, 2, ttl)
    client = EtcdClient(EtcdSettings.from_config(params.endpoint, dict(params.config)))
    connected.set()
    leases: list[tuple[int, int]] = []
    interval = ttl / 3.0
    ticks = max(1, int(interval / _KEEP_TICK_S))
    while not stop.is_set():
        start = time.monotonic()
        for tick in range(ticks):
            if stop.wait(max(0.0, start + tick * interval / ticks - time.monotonic())):
                return
            while not inbox.empty():   # a lease keeps its tick: the list only grows
                leases.append(inbox.get())
            due = [(n, lid) for n, lid in leases[tick::ticks]
                   if not (n == victim and killed.is_set())]
            why = _refresh(client, due, ttl, ETCD_FAILURES)
            if why and not stop.is_set() and not (why[0] == victim and killed.is_set()):
                spoiled.set()
                ready.put(("spoiled", f"node {why[0]}'s {why[1]} before every agent adopted"))
                return
        stop.wait(max(0.0, start + interval - time.monotonic()))


def _refresh(client: Any, due: list[tuple[int, int]], ttl: int,
             failures: Any) -> tuple[int, str] | None:
    """Refresh ``due``'s leases on one stream; (node, what went wrong) for the first that
    did not refresh, else None."""
    from pyetcd import etcdrpc

    if not due:
        return None

    def batch(c: Any) -> dict[int, int]:
        requests = [etcdrpc.LeaseKeepAliveRequest(ID=lid) for _, lid in due]
        return {int(r.ID): int(r.TTL) for r in c.leasestub.LeaseKeepAlive(
            iter(requests), ttl, credentials=c.call_credentials, metadata=c.metadata)}

    try:
        answers = client.call("lease keep-alive", batch, timeout=ttl)
    except failures as exc:
        return due[0][0], f"keep-alive failed ({exc})"
    for node, lid in due:
        if answers.get(lid, 0) <= 0:
            return node, "lease expired"
    return None


def _host(first: int, last: int, nodes: int, victim: int, endpoints: str, ttl: int,
          channels: int, plan_dir: str, ready: Any, orders: Any, results: Any,
          decider_nice: int | None = None) -> None:
    """One process hosting agents ``first..last-1`` on ``channels`` shared etcd clients,
    one keep-alive thread per client and each client's one watch-dispatch thread."""
    import copy
    import faulthandler

    from chameleon_elastic.launcher.coordination import agreement as protocol
    from chameleon_elastic.launcher.coordination import messages
    from chameleon_elastic.launcher.session import JobSession
    from chameleon_elastic.rendezvous.client import EtcdClient
    from chameleon_elastic.rendezvous.config import EtcdSettings
    from chameleon_elastic.rendezvous.liveness import list_nodes

    faulthandler.enable(all_threads=False)   # a host that crashes says where
    ctx = mp.get_context("fork")   # before this process opens any gRPC channel: no new start
    stop, killed, spoiled, connected = (ctx.Event() for _ in range(4))
    inbox = ctx.Queue()
    keeper = ctx.Process(target=_keeper, daemon=True,
                         args=(endpoints, ttl, connected, inbox, victim, killed, stop, spoiled,
                               ready))
    keeper.start()
    _favour_pid(keeper.pid)   # as the members: a node's keep-alive has its node's CPU
    clock, local = Clock(), {}
    for name in ("collect", "decide", "commit_record", "publish"):
        clock.wrap(protocol, name)
    clock.wrap(messages.Decision, "encode")   # the record's bytes: the decider's only
    reported = _note_reports()
    session = JobSession(spec_for(nodes), "auto", Path(plan_dir) / "decider", cache_depth=0)
    _share_local_work(local)
    desk = _desk()
    params = _params(endpoints, nodes, ttl)
    settings = EtcdSettings.from_config(params.endpoint, dict(params.config))
    clients = [EtcdClient(settings) for _ in range(channels)]
    agents = []
    if not connected.wait(300):
        raise RuntimeError("the keep-alive process did not reach etcd within 300 s")
    for n in range(first, last):
        own = session if n == 0 else copy.copy(session)   # followers: own plan dir
        if n != 0:
            own.plan_dir, own.excluded, own.speeds = Path(plan_dir) / f"node{n}", set(), {}
        agent = Agent(n, nodes, clients[n % channels], params, own, desk)
        agent.decider_nice = decider_nice
        agent.live._register()   # the real lease grant and node key
        inbox.put((n, agent.live.lease_id))
        agents.append(agent)
        ready.put(("registered", n))
    if first == 0:   # the decider's planning step, timed (the followers' are copies before)
        clock.wrap(session, "step")
    orders.get()   # every agent of every host has registered: list once, watch each
    listing, revision = list_nodes(clients[0], settings.run_prefix(RUN_ID))
    for agent in agents:
        agent.watch(listing, revision)
    ready.put(("watching", first))
    protocol.QUICK_S = 120.0   # see the module docstring: the agents share two cores
    # a follower wakes once per slice to check its decider's lease: one wake-up a second per
    # node in production (each on its own CPU), 4096 a second here on two cores at 4096 nodes;
    # at most about 1000 a second in all here (what a slice costs: see the docs)
    protocol._WAIT_S = max(protocol._WAIT_S, nodes / 1000)
    order = orders.get()
    cpu = time.process_time()
    if order is not None:   # this host holds the victim
        (victim_agent,) = [a for a in agents if a.node == victim]
        victim_agent.out["killed"] = time.monotonic()
        killed.set()
        if order:
            victim_agent.live.stop(revoke=True)
    _await(agents, victim, spoiled, reported)
    cpu = time.process_time() - cpu
    stop.set()
    keeper.join(timeout=ttl + 1)
    _close(agents, clients, victim, reported)
    results.put(copy.deepcopy({"outs": {a.node: a.out for a in agents}, "marks": clock.marks,
                               "local": local, "spoiled": spoiled.is_set(), "cpu_s": cpu}))
    results.close()
    results.join_thread()
    os._exit(0)   # gRPC's and the agents' daemon threads need no orderly exit


def _close(agents: list[Agent], clients: list[Any], victim: int,
           reported: dict[int, float]) -> None:
    """The host's clients closed (only once its agents are done: gRPC crashes an agent still
    running on a closed channel), and each agent's outcome completed."""
    for agent in agents:
        agent.closing = True
    if all(a.node == victim or "adopted" in a.out or "error" in a.out for a in agents):
        for c in clients:
            c.close()
    for agent in agents:
        if agent.node != victim and not agent.out:
            agent.out["error"] = "never saw the lost node"
        elif agent.node != victim and "adopted" not in agent.out:
            agent.out.setdefault("error", "no decision adopted within 240 s")
        if agent.node in reported:
            agent.out["reported"] = reported[agent.node]


def _await(agents: list[Agent], victim: int, spoiled: Any, reported: dict[int, float]) -> None:
    """Until every agent of the host adopted or failed (240 s at most), saying every 10 s how
    far a slow round got; a lease expired before the kill spoils the run: return at once."""
    start = time.monotonic()
    deadline, said = start + 240, start
    for agent in agents:
        while agent.node != victim and "adopted" not in agent.out and not spoiled.is_set() \
                and "error" not in agent.out and time.monotonic() < deadline:
            time.sleep(0.05)
            if time.monotonic() - said > 10:
                said = time.monotonic()
                print(f"  host of nodes {agents[0].node}-{agents[-1].node}, {said - start:.0f} s "
                      f"after the kill: {sum('detected' in a.out for a in agents)} saw the "
                      f"loss, {sum(a.node in reported for a in agents)} reported, "
                      f"{sum('adopted' in a.out for a in agents)} adopted, "
                      f"{sum('error' in a.out for a in agents)} failed", file=sys.stderr,
                      flush=True)


def _desk() -> Any:
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


def etcd_metrics(cluster: Any) -> dict[str, float]:
    """Summed over the members' ``/metrics``: gRPC requests (messages received: unary calls and
    each message on a stream, such as a watch creation), RPCs completed, bytes sent to
    clients, and the watchers and watch streams open."""
    names = {"grpc_server_msg_received_total": "requests", "process_cpu_seconds_total": "cpu_s", "grpc_server_handled_total": "rpcs",
             "etcd_network_client_grpc_sent_bytes_total": "sent_bytes",
             "etcd_debugging_mvcc_watcher_total": "watchers",
             "etcd_debugging_mvcc_watch_stream_total": "watch_streams"}
    total = dict.fromkeys(names.values(), 0.0)   # cpu_s: the members' CPU time
    for member in cluster.members:
        with urllib.request.urlopen(f"http://{member.endpoint}/metrics", timeout=5) as r:
            text = r.read().decode()
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                total[names[name]] += float(line.rsplit(" ", 1)[1])
    return total


def _favour(cluster: Any) -> None:
    """Raise the members' CPU priority where allowed: on a shared 2-core machine a starved
    leader misses its heartbeats, elections follow and every lease expires at once, which a
    production etcd on its own cores does not do."""
    for member in cluster.members:
        _favour_pid(member.pid)


def _favour_pid(pid: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, pid, -10)
    except (OSError, TypeError):   # not root: run as is
        pass


def _rate(a: dict[str, float], b: dict[str, float], seconds: float,
          what: str = "requests") -> float:
    return (b[what] - a[what]) / max(seconds, 1e-9)


def _seed(endpoints: str, nodes: int, ttl: int, plan_dir: str) -> None:
    """The job's first decision, as the first full round leaves it: every node, generation 0."""
    from chameleon_elastic.launcher.coordination import agreement as protocol
    from chameleon_elastic.launcher.coordination import messages
    from chameleon_elastic.launcher.session import JobSession
    from chameleon_elastic.rendezvous.client import EtcdClient
    from chameleon_elastic.rendezvous.config import EtcdSettings

    params = _params(endpoints, nodes, ttl)
    client = EtcdClient(EtcdSettings.from_config(params.endpoint, dict(params.config)))
    store, _etcd_store = _stores(client)
    session = JobSession(spec_for(nodes), "auto", Path(plan_dir) / "seed", cache_depth=0)
    first = messages.Decision(session.plan, (), tuple(session.plan.working_devices),
                                  True, nodes=tuple(range(nodes)))
    protocol.commit_record(store.underlying_store, "", first)
    client.close()


def _unspoiled(said: tuple[str, Any]) -> None:
    """A host's message: an agent registered, a host watching, or a lease expired before the
    kill (which ends the run: the leases of an overloaded machine, not the protocol)."""
    if said[0] == "spoiled":
        raise RuntimeError(f"{said[1]}: the machine was overloaded; run again with a longer "
                           "--ttl")


def _simulate(cluster: Any, nodes: int, procs: int, channels: int, ttl: int, revoke: bool,
              steady: float, plan_dir: str, say: Any, decider_nice: int | None = None,
              sampler: Any = None,
              trouble: Any = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """Start the hosts, register and watch, measure the steady state, kill one node and
    collect every host's results; returns (results, [steady start, steady end, round end]
    metrics and times)."""
    ctx = mp.get_context("spawn")
    victim = nodes // 2
    ready, results = ctx.Queue(), ctx.Queue()
    bounds = [(i * nodes // procs, (i + 1) * nodes // procs) for i in range(procs)]
    orders = [ctx.Queue() for _ in bounds]
    hosts = [ctx.Process(target=_host,   # not daemonic: each starts its keep-alive process
                         args=(lo, hi, nodes, victim, cluster.endpoints, ttl, channels,
                               plan_dir, ready, orders[i], results, decider_nice))
             for i, (lo, hi) in enumerate(bounds)]
    t0 = time.monotonic()
    for h in hosts:
        h.start()
    try:
        got = _drive(cluster, nodes, ttl, revoke, steady, say, t0, hosts, ready, results,
                     orders, bounds, sampler, trouble)
    except BaseException:
        for h in hosts:
            h.kill()
        raise
    for h in hosts:
        h.join(timeout=30)
        if h.is_alive():
            h.kill()
    return got


def _track_hosts(sampler: Any, hosts: list[Any]) -> None:
    """Sample the hosts (and their threads) and each host's keep-alive process."""
    import psutil

    for i, h in enumerate(hosts):
        sampler.track(f"host{i}", h.pid, threads=True)
        for j, child in enumerate(psutil.Process(h.pid).children()):
            sampler.track(f"keeper{i}.{j}", child.pid)


def _next(ready: Any, hosts: list[Any], timeout: float) -> Any:
    """The next message of the hosts, or an error naming the host that died meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ready.get(timeout=1.0)
        except queue.Empty:
            dead = [h.exitcode for h in hosts if h.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a host process died (exit code {dead[0]}); its traceback "
                                   "is above") from None
            if time.monotonic() > deadline:
                raise


def _drive(cluster: Any, nodes: int, ttl: int, revoke: bool, steady: float, say: Any,
           t0: float, hosts: list[Any], ready: Any, results: Any, orders: list[Any],
           bounds: list[tuple[int, int]], sampler: Any = None,
           trouble: Any = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """Register, watch, measure the steady state, kill, collect (``_simulate``); the
    ``trouble`` (``etcd_trouble.LeaderChange``) starts with the kill."""
    victim = nodes // 2
    for count in range(1, nodes + 1):
        _unspoiled(_next(ready, hosts, 300))
        if count % max(1, nodes // 4) == 0 or count == nodes:
            say(f"  {nodes} nodes: {count} agents registered ({time.monotonic() - t0:.1f} s)")
    if sampler is not None:
        _track_hosts(sampler, hosts)
    for q in orders:
        q.put("watch")
    for _ in hosts:
        _unspoiled(_next(ready, hosts, 300))
    say(f"  {nodes} nodes: every agent watches ({time.monotonic() - t0:.1f} s)")
    m0, s0 = etcd_metrics(cluster), time.monotonic()
    try:   # a host's keep-alive finding a lease expired before the kill stops the run here
        _unspoiled(ready.get(timeout=steady))
    except queue.Empty:
        pass
    m1, s1 = etcd_metrics(cluster), time.monotonic()
    say(f"  {nodes} nodes: killing node {victim} ({'revoke' if revoke else 'lease expiry'})")
    owner = next(i for i, (lo, hi) in enumerate(bounds) if lo <= victim < hi)
    for i, q in enumerate(orders):
        q.put(revoke if i == owner else None)
    if trouble is not None:
        trouble.killed_at = time.monotonic()
        trouble.start()
    got = [_next(results, hosts, 300) for _ in hosts]
    if trouble is not None:   # a restarted member answers /metrics once it is back
        trouble.wait()
    m2, s2 = etcd_metrics(cluster), time.monotonic()
    say(f"  {nodes} nodes: every host reported ({time.monotonic() - t0:.1f} s)")
    return got, [(m0, s0), (m1, s1), (m2, s2)]


def run(nodes: int, members: int, procs: int, ttl: int, revoke: bool, channels: int = 4,
        steady: float = 10.0, say: Any = print, etcd_dir: str | None = None,
        decider_nice: int | None = None, cpu_profile: bool = False,
        leader_change: str | None = None, leader_change_at: float = 0.5) -> dict[str, Any]:
    from chameleon_elastic.rendezvous.config import EtcdSettings
    from chameleon_elastic.rendezvous.local_cluster import LocalEtcdCluster

    with tempfile.TemporaryDirectory(prefix="coordination-scale-", dir=etcd_dir) as data, \
            LocalEtcdCluster(members=members, work_dir=data) as cluster, \
            tempfile.TemporaryDirectory(prefix="coordination-scale-") as plan_dir:
        _favour(cluster)
        _seed(cluster.endpoints, nodes, ttl, plan_dir)
        sampler = None
        if cpu_profile:
            from cpu_window import CpuSampler

            sampler = CpuSampler()
            for i, member in enumerate(cluster.members):
                sampler.track(f"etcd{i}", member.pid)
            sampler.track("parent", os.getpid())
            sampler.start()
        trouble = None
        if leader_change is not None:
            from etcd_trouble import LeaderChange

            settings = EtcdSettings.from_config(cluster.endpoints, {})
            trouble = LeaderChange(cluster, leader_change,
                                   f"{settings.run_prefix(RUN_ID)}nodes/node-{nodes // 2}",
                                   leader_change_at,
                                   on_restart=lambda member: _favour_pid(member.pid))
        try:
            got, windows = _simulate(cluster, nodes, procs, channels, ttl, revoke, steady,
                                     plan_dir, say, decider_nice, sampler, trouble)
        except Exception:
            for member in cluster.members:
                if not member.is_running():
                    say(f"etcd member {member.endpoint} died; its log ends with:\n"
                        f"{member.log_tail(40)}")
            raise
        finally:
            if sampler is not None:
                sampler.stop()
            changed = trouble.row() if trouble is not None else {}
    if changed:
        say(f"  {nodes} nodes: leader change: {changed}")
    row = _summary(got, windows, nodes // 2)
    row.update(changed)
    row["watch_breaks"] = sum(o.get("watch_breaks", 0) for g in got for o in g["outs"].values())
    if sampler is not None:
        row["cpu_windows"] = _cpu_windows(sampler, got, nodes // 2)
    row.update({"nodes": nodes, "devices": nodes * DEVICES_PER_NODE, "etcd_members": members,
                "procs": procs, "channels_per_proc": channels, "ttl_s": ttl,
                "kill": "revoke" if revoke else "expiry", "decider_nice": decider_nice})
    return row


def _cpu_windows(sampler: Any, got: list[dict[str, Any]],
                 victim: int) -> dict[str, dict[str, float]]:
    """Who used the CPU in each phase of the round: etcd's members, the deciding agent's
    thread, the other agents' threads, the hosts' other Python threads (the watches' dispatch,
    gRPC's Python side), gRPC's C threads by name, the keep-alive processes, and everything
    else on the machine (other sessions); ``wait:`` keys are run-queue waits of threads."""
    marks = next(g["marks"] for g in got if "step_start" in g["marks"])
    outs = {n: o for g in got for n, o in g["outs"].items()}
    decider = outs[0].get("tid")
    followers = {o.get("tid") for n, o in outs.items() if n not in (0, victim)}
    mains = set(sampler.procs.values())

    def group(key: str) -> str | None:
        parts = key.split("/")
        if len(parts) == 1:   # a process: etcd members, hosts (all threads), keepers, parent
            return key if key == "machine" or key.startswith("etcd") else (
                "hosts (all threads)" if key.startswith("host") else
                "keep-alive processes" if key.startswith("keeper") else key)
        tid, what = int(parts[1]), parts[2]
        name = ("decider thread" if tid == decider else "follower agent threads"
                if tid in followers else "host main threads" if tid in mains
                else f"host threads named {sampler.comms.get(tid, '?')}")
        return name if what == "run" else f"wait: {name}" if tid == decider or \
            tid in followers else None

    detected = max(o["detected"] for n, o in outs.items() if n != victim)
    spans = {"reports": (detected, marks["collect_end"]),
             "decision": (marks["step_start"], marks["step_end"]),
             "publication": (marks["step_end"], marks["publish_end"]),
             "decision + publication": (marks["step_start"], marks["publish_end"]),
             "adoption": (marks["publish_end"],
                          max(o["adopted"] for n, o in outs.items() if n != victim))}
    out = {}
    for name, (t0, t1) in spans.items():
        used = sampler.window(t0, t1, group)
        ours = sum(v for k, v in used.items() if k.startswith("etcd") or k in (
            "hosts (all threads)", "keep-alive processes", "parent"))
        used["etcd (all members)"] = sum(v for k, v in used.items() if k.startswith("etcd"))
        used["everything else on the machine"] = used.get("machine", 0.0) - ours
        used["wall"] = t1 - t0
        out[name] = {k: round(v, 3) for k, v in sorted(used.items())}
    return out


def _summary(got: list[dict[str, Any]], windows: list[Any], victim: int) -> dict[str, Any]:
    """The phases and etcd's load, from the hosts' timestamps and the metrics' windows."""
    outs = {n: o for g in got for n, o in g["outs"].items()}
    if any(g["spoiled"] for g in got):
        adopted = sum("adopted" in o for o in outs.values())
        raise RuntimeError(f"a lease expired before every agent adopted ({adopted} of "
                           f"{len(outs) - 1} had): the machine was overloaded; run again with "
                           "a longer --ttl")
    errors = {n: (o["error"], o.get("trigger")) for n, o in outs.items() if "error" in o}
    if errors:
        killed = outs[victim].get("killed", 0.0)
        late = sorted(o.get("reported", float("inf")) - killed for o in outs.values())
        print(f"decider: {outs[0]}; reported after the kill: first {late[0]:.2f} s, median "
              f"{late[len(late) // 2]:.2f} s, last {late[-1]:.2f} s", file=sys.stderr)
        raise RuntimeError(f"{len(errors)} agents failed, e.g. {next(iter(errors.items()))}")
    marks = next(g["marks"] for g in got if "step_start" in g["marks"])
    local = {k: max(g["local"].get(k, 0.0) for g in got) for k in ("step_cpu_s", "adopt_cpu_s")}
    killed = outs[victim]["killed"]
    alive = [o for n, o in outs.items() if n != victim]
    early = [n for n, o in outs.items() if o.get("detected", killed) < killed]
    if early:
        raise RuntimeError(f"agents {early[:5]} saw a node lost before the kill: leases expired "
                           "while the machine was overloaded; run again with a longer --ttl")
    detected = sorted(o["detected"] for o in alive)
    adopted = max(o["adopted"] for o in alive)
    (m0, s0), (m1, s1), (m2, s2) = windows
    steady = {k: _rate(m0, m1, s1 - s0, k) for k in ("requests", "sent_bytes")}
    # the round's own traffic: the window's, less the steady state's (keep-alives) over it
    extra = {k: (m2[k] - m1[k]) - steady[k] * (s2 - s1) for k in ("requests", "sent_bytes")}
    return {
        "detect_first_s": detected[0] - killed, "detect_last_s": detected[-1] - killed,
        "detect_median_s": statistics.median(detected) - killed,
        "reports_s": marks["collect_end"] - detected[-1],
        "decision_s": marks["step_end"] - marks["step_start"],
        "publication_s": marks["publish_end"] - marks["step_end"],
        "decision_cpu_s": marks["step_cpu"],   # the decider thread's own CPU
        "publication_cpu_s": sum(marks[f"{name}_cpu"] for name in (
            "decide", "encode", "commit_record", "publish")),
        "adoption_s": adopted - marks["publish_end"],
        # each follower's own replay of the step (a cold planner here: no plan cache), or
        # the adoption of a fetched plan: parallel on real nodes, once per host here
        "adoption_local_cpu_s": local["step_cpu_s"] + local["adopt_cpu_s"],
        "replayed_agents": sum(o.get("agreed") == "replayed" for o in alive),
        "fetched_agents": sum(o.get("agreed") == "fetched" for o in alive),
        "total_s": adopted - killed,
        "decision_plus_publication_s": marks["publish_end"] - marks["step_start"],
        "generation": {o["generation"] for o in alive}.pop(),
        "agreed": len({(o["generation"], o["excluded"], o["digest"]) for o in alive}) == 1,
        "excluded_devices": max(o["excluded"] for o in alive),
        "steady_requests_per_s": steady["requests"],
        "round_requests": extra["requests"],
        "round_requests_per_s": extra["requests"] / max(adopted - detected[0], 1e-9),
        "round_sent_mb": extra["sent_bytes"] / 1e6,
        "round_etcd_cpu_s": m2["cpu_s"] - m1["cpu_s"],
        "round_agents_cpu_s": sum(g["cpu_s"] for g in got),
        "watchers": m1["watchers"], "watch_streams": m1["watch_streams"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="256,1024",
                        help="comma-separated simulated node counts (default 256,1024)")
    parser.add_argument("--members", type=int, default=3, help="etcd members (default 3)")
    parser.add_argument("--procs", type=int, default=4,
                        help="processes hosting the agents (default 4)")
    parser.add_argument("--channels", type=int, default=16,
                        help="etcd clients (gRPC channels, watch streams) per process, shared "
                             "by its agents (default 16)")
    parser.add_argument("--ttl", type=int, default=5,
                        help="lease TTL in seconds (default 5, chameleon-run's)")
    parser.add_argument("--steady", type=float, default=10.0,
                        help="seconds of steady state measured before the kill (default 10)")
    parser.add_argument("--kill", choices=("expiry", "revoke"), default="expiry",
                        help="how the node is lost: its lease expires (default) or is revoked")
    parser.add_argument("--etcd-dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                        help="where the members keep their data (default /dev/shm: a shared "
                             "machine's disk makes every lease grant wait on fsync, which a "
                             "production etcd's SSD does not)")
    parser.add_argument("--decider-nice", type=int, default=None,
                        help="the deciding agent's thread's nice value during the round "
                             "(default: the benchmark's own; -10, etcd's here, stands for a "
                             "node's own CPU; lowering it needs root)")
    parser.add_argument("--cpu-profile", action="store_true",
                        help="sample every process's and the agents' threads' CPU time "
                             "(/proc) and report who used the CPU in each phase of the round "
                             "(costs CPU itself: not for timing runs)")
    parser.add_argument("--leader-change", choices=("move", "restart"), default=None,
                        help="change etcd's leader inside the round: hand it to another member "
                             "(move) or kill and restart it (restart); needs --members >= 2")
    parser.add_argument("--leader-change-at", type=float, default=0.5,
                        help="seconds after the lost node's key went (default 0.5)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        scales = [int(x) for x in args.nodes.split(",")]
    except ValueError:
        parser.error(f"--nodes {args.nodes!r} must be comma-separated integers, e.g. 256,1024")
    if min(scales) < 2 or min(args.procs, args.members, args.channels) < 1:
        parser.error("--nodes needs at least 2 nodes each, --procs, --channels and --members "
                     "at least 1")
    if args.decider_nice is not None and args.decider_nice < os.nice(0) and os.geteuid() != 0:
        parser.error(f"--decider-nice {args.decider_nice} is below this process's nice value "
                     f"({os.nice(0)}), which only root may set; leave it out or run as root")
    if args.leader_change and args.members < 2:
        parser.error("--leader-change needs --members 2 or more (3: a majority survives)")
    say = (lambda s: print(s, file=sys.stderr, flush=True))
    rows = [run(n, args.members, min(args.procs, n), args.ttl, args.kill == "revoke",
                max(1, min(args.channels, n // min(args.procs, n))), args.steady, say,
                args.etcd_dir, args.decider_nice, args.cpu_profile, args.leader_change,
                args.leader_change_at)
            for n in scales]
    if args.json:
        json.dump({"benchmark": "coordination_scale", "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    cols = [("nodes", "nodes", "{}"), ("detect (last)", "detect_last_s", "{:.2f} s"),
            ("reports", "reports_s", "{:.3f} s"), ("decision", "decision_s", "{:.3f} s"),
            ("(CPU)", "decision_cpu_s", "{:.3f} s"),
            ("publication", "publication_s", "{:.3f} s"), ("(CPU)", "publication_cpu_s", "{:.3f} s"),
            ("adoption", "adoption_s", "{:.3f} s"),
            ("+ per-agent replay CPU", "adoption_local_cpu_s", "{:.3f} s"),
            ("fetched", "fetched_agents", "{}"),
            ("kill -> all adopted", "total_s", "{:.2f} s"),
            ("etcd req/s steady", "steady_requests_per_s", "{:.0f}"),
            ("etcd req/s round", "round_requests_per_s", "{:.0f}"),
            ("etcd MB sent round", "round_sent_mb", "{:.0f}"),
            ("etcd CPU round", "round_etcd_cpu_s", "{:.1f} s"),
            ("agents' CPU round", "round_agents_cpu_s", "{:.1f} s"),
            ("watchers", "watchers", "{:.0f}")]
    if args.leader_change:
        cols += [("leader change after loss", "leader_change_after_loss_s", "{} s"),
                 ("leaders", "leader_pair", "{}"), ("terms", "term_pair", "{}")]
        for r in rows:
            r["leader_pair"] = f"{r.get('leader_before')}->{r.get('leader_after')}"
            r["term_pair"] = f"{r.get('term_before')}->{r.get('term_after')}"
            r.setdefault("leader_change_after_loss_s", r.get("leader_change_error", "?"))
    print(" | ".join(c for c, _, _ in cols))
    for r in rows:
        print(" | ".join(f.format(r[k]) for _, k, f in cols))
    for r in rows:
        for phase, used in r.get("cpu_windows", {}).items():
            print(f"\n{r['nodes']} nodes, CPU seconds in {phase} ({used['wall']:.3f} s wall):")
            for k, v in sorted(used.items(), key=lambda kv: -kv[1]):
                if k != "wall" and abs(v) >= 0.005:
                    print(f"  {k}: {v:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
