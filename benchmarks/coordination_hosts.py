"""The host processes of ``coordination_scale.py``: each runs many simulated agents
(``coordination_agents.py``) and a keep-alive process for their leases.

A host registers its agents (a few at a time: at 16384 nodes one after the other took minutes),
has each watch the run's nodes from one listing, and on the parent's order kills the victim and
waits for its agents to adopt. Its keep-alive process refreshes every lease of its agents at
ttl / 3, the requests production makes (one ``LeaseKeepAliveRequest`` per lease), batched per
tick on one stream as a host's would be.
"""

from __future__ import annotations

import copy
import gc
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from coordination_agents import (
    RUN_ID,
    Agent,
    Clock,
    HostView,
    Waker,
    host_desk,
    meter_agents,
    note_reports,
    params_for,
    round_limit_s,
    share_local_work,
    spec_for,
)

_REGISTERING = 8   # agents registering at once in a host
_STACK = 512 * 1024   # each agent thread's stack: 16384 threads at the default 8 MiB map 128 GiB

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

    tied_to_parent()
    params = params_for(endpoints, 2, ttl)
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



def host_main(first: int, last: int, nodes: int, victim: int, endpoints: str, ttl: int,
          channels: int, plan_dir: str, ready: Any, orders: Any, results: Any,
          decider_nice: int | None = None, active: int = 0, cpu: int | None = None) -> None:
    """One process hosting agents ``first..last-1`` on ``channels`` shared etcd clients (each
    with its watch-dispatch thread) and a keep-alive process; on CPU ``cpu`` alone when it is
    given (``--pin``)."""
    import faulthandler

    from chameleon_elastic.launcher.coordination import agreement as protocol
    from chameleon_elastic.launcher.coordination import messages
    from chameleon_elastic.rendezvous.liveness import list_nodes

    tied_to_parent()
    faulthandler.enable(all_threads=False)   # a host that crashes says where
    # `kill -USR1 <host pid>`: every thread's stack on the host's stderr (py-spy cannot
    # read a process of 4096 threads: 12 000 memory maps)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.stack_size(_STACK)
    if cpu is not None:
        pin_process(cpu)
    ctx = mp.get_context("fork")   # before this process opens any gRPC channel: no new start
    stop, killed, spoiled, connected = (ctx.Event() for _ in range(4))
    inbox = ctx.Queue()
    keeper = ctx.Process(target=_keeper, daemon=True,
                         args=(endpoints, ttl, connected, inbox, victim, killed, stop, spoiled,
                               ready))
    keeper.start()
    favour_pid(keeper.pid)   # as the members: a node's keep-alive has its node's CPU
    clock, local = Clock(), {}
    for name in ("collect", "decide", "commit_record", "publish"):
        clock.wrap(protocol, name)
    clock.wrap(messages.Decision, "encode")   # the record's bytes: the decider's only
    waker = Waker(active)
    reported = note_reports()
    meter_agents(waker)
    if not connected.wait(300):
        raise RuntimeError("the keep-alive process did not reach etcd within 300 s")
    agents, clients, session = _register(first, last, nodes, endpoints, ttl, channels, plan_dir,
                                         ready, inbox, local, decider_nice)
    for agent in agents:
        agent.waker = waker
    if first == 0:   # the decider's planning step, timed (the followers' are copies before)
        clock.wrap(session, "step")
    orders.get()   # every agent of every host has registered: list once, watch each
    listing, revision = list_nodes(clients[0], clients[0].settings.run_prefix(RUN_ID))
    agents[0].view.listing(listing, revision)
    for agent in agents:
        agent.watch(revision)
    ready.put(("watching", first))
    # the host's objects so far (its agents, sessions, the view: millions at 16384 nodes) out
    # of the collector's reach: its passes over them were 8% of the machine's CPU in a round
    # there (perf), a cost of a thousand agents in one process, not of an agent
    gc.freeze()
    protocol.QUICK_S = round_limit_s(nodes)   # see the module docstring: two cores
    # a follower wakes once per slice to check its decider's lease: one wake-up a second per
    # node in production, each on its own CPU. Here the followers sleep until the decision
    # (the decider is never lost): at 16384 nodes their slices' wake-ups, 250 a second per
    # host at nodes / 1000 s, queued for the interpreter lock behind the decider's planning,
    # and each waiting thread wakes every 5 ms to ask for it: the load average went from 30 to
    # 2000 and no decision was adopted (the publication was metered already)
    protocol._slice_s = lambda members: round_limit_s(nodes)
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


def _register(first: int, last: int, nodes: int, endpoints: str, ttl: int, channels: int,
              plan_dir: str, ready: Any, inbox: Any, local: dict[str, float],
              decider_nice: int | None) -> tuple[list[Agent], list[Any], Any]:
    """The host's agents, each with its lease granted and node key put (``_REGISTERING`` at
    a time), their leases handed to the keep-alive process; returns (agents, clients, the
    deciding session: node 0's, which every follower's copies)."""
    from chameleon_elastic.launcher.session import JobSession
    from chameleon_elastic.rendezvous.client import EtcdClient
    from chameleon_elastic.rendezvous.config import EtcdSettings

    session = JobSession(spec_for(nodes), "auto", Path(plan_dir) / "decider", cache_depth=0)
    share_local_work(local)
    desk = host_desk()
    params = params_for(endpoints, nodes, ttl)
    settings = EtcdSettings.from_config(params.endpoint, dict(params.config))
    clients = [EtcdClient(settings) for _ in range(channels)]
    view = HostView(clients[0])
    agents = []
    for n in range(first, last):
        own = session if n == 0 else copy.copy(session)   # followers: own plan dir
        if n != 0:
            own.plan_dir, own.excluded, own.speeds = Path(plan_dir) / f"node{n}", set(), {}
        agent = Agent(n, nodes, clients[n % channels], view, own, desk)
        agent.decider_nice = decider_nice
        agents.append(agent)

    def register(agent: Agent) -> None:
        agent.live._register()   # the real lease grant and node key
        inbox.put((agent.node, agent.live.lease_id))
        ready.put(("registered", agent.node))

    with ThreadPoolExecutor(_REGISTERING) as pool:
        list(pool.map(register, agents))
    return agents, clients, session

def _close(agents: list[Agent], clients: list[Any], victim: int,
           reported: dict[int, float]) -> None:
    """The host's clients closed (only once its agents are done: gRPC crashes an agent still
    running on a closed channel), and each agent's outcome completed."""
    for agent in agents:
        agent.stop()
    if all(a.node == victim or "adopted" in a.out or "error" in a.out for a in agents):
        for c in clients:
            c.close()
    for agent in agents:
        if agent.node != victim and not agent.out:
            agent.out["error"] = "never saw the lost node"
        elif agent.node != victim and "adopted" not in agent.out:
            agent.out.setdefault("error", "no decision adopted in time")
        if agent.node in reported:
            agent.out["reported"] = reported[agent.node]


def _await(agents: list[Agent], victim: int, spoiled: Any, reported: dict[int, float]) -> None:
    """Until every agent of the host adopted or failed (twice the round's limit at most),
    saying every 10 s how far a slow round got; a lease expired before the kill spoils the run: return at once."""
    start = time.monotonic()
    deadline, said = start + 2 * round_limit_s(agents[0].nodes), start
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
                      f"{sum('error' in a.out for a in agents)} failed"
                      f"{_first_error(agents)}", file=sys.stderr, flush=True)


def tied_to_parent() -> None:
    """SIGKILL this process when the one that started it dies (Linux ``PR_SET_PDEATHSIG``), and
    leave Ctrl-C to the run's parent: a host waits on its parent's orders, and a keep-alive
    process refreshes leases until its host says stop, so either outlived a parent stopped by a
    signal, for good; and Ctrl-C, sent to every process of the terminal's group, printed a
    traceback from each of them."""
    from chameleon_elastic.rendezvous.local_etcd import parent_death_signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent, hook = os.getppid(), parent_death_signal()   # the hook etcd's members start with
    if hook is not None:
        hook()
    if os.getppid() != parent:   # the parent was gone before the call
        os._exit(1)


def pin_process(cpu: int) -> None:
    """Every thread of this process, and those it starts later (they inherit it), on ``cpu``.

    A host is a thousand threads handing one interpreter lock and gRPC's completions to each
    other: spread over both CPUs, half of those hand-offs wake a thread on the other CPU, and on
    this virtual machine a cross-CPU wake-up is an interrupt to the hypervisor. Pinned, they stay
    on one CPU (a host stands for a thousand nodes that would each have their own)."""
    for tid in os.listdir("/proc/self/task"):   # sched_setaffinity is per thread on Linux
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except (ProcessLookupError, PermissionError):   # a thread that ended meanwhile
            pass


def favour_pid(pid: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, pid, -10)
    except (OSError, TypeError):   # not root: run as is
        pass




def _first_error(agents: list[Agent]) -> str:
    """The first failed agent's error, for the progress line (a long round's failures are
    seen as they come, not only at its end)."""
    for agent in agents:
        if "error" in agent.out:
            return f" (node {agent.node}: {str(agent.out['error'])[:300]})"
    return ""
