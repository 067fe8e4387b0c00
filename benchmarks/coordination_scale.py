"""The agents' quick-round coordination at 256-16384 simulated nodes, on a real etcd cluster.

Each simulated node holds what a production agent holds on etcd: its own lease and node key
(granted by ``NodeLiveness``), its own watch on the run's nodes, and the round's store
(``EtcdStore`` under torch's ``PrefixStore``); ``coordination_agents.py`` (the agents) and
``coordination_hosts.py`` (the processes that host them) beside this driver. Workers are faked:
each node reports 8 live devices. One node is killed (its
keep-alive stops, so its lease expires after the TTL; ``--kill revoke`` revokes it instead) and
every other agent, on its own thread, runs the real recovery path: ``Rounds.quick`` then
``protocol.agree(quick=True)``, the lowest node deciding with the real planner (a
``JobSession`` on the Llama-2-7B spec of ``planner_latency.py`` scaled to 8 devices per node;
cold, no plan cache: the worst case).

What is lighter than production, so that thousands of agents fit on two cores (a thread set per agent
made 1300 threads at 256 agents and took etcd down), and why it does not change what is
measured (etcd's requests, watchers and bytes are those of production):

- the agents of one process share ``--channels`` etcd clients: each agent's watch is still its
  own etcd watcher, multiplexed on its client's stream (fewer watch streams than production);
- one keep-alive process per host refreshes every lease of its agents at ttl / 3, the requests
  production makes, instead of a thread per agent (behind hundreds of agent threads on one GIL
  a refresh outlived the TTL); the self-fencing expiry check is not on the measured path;
- the agents of a host keep one view of the live nodes (each agent's watch still delivers every
  event; a copy per agent is nodes^2 entries, more than this machine's memory at 16384), and
  each agent's recovery thread is started idle with it, woken by its watch's event;
- ``--active N`` lets at most N agents of a host be awake at once, woken in turn by the loss
  and by the decision (``coordination_agents.Waker``): a thousand runnable threads on one
  interpreter lock spent more CPU switching than working (42 against 26 s of the agents' CPU
  per round at 4096 nodes), and at 16384 nodes took the machine down;
- each host process runs on one CPU (``--pin``, the default): its thousand threads hand the
  interpreter lock and gRPC's completions to each other, and spread over both CPUs half of
  those wake-ups crossed CPUs, an interrupt through the hypervisor each on this virtual
  machine (3x the rescheduling interrupts; the round's CPU, etcd's included, doubled);
- one process replays each planning step once for its agents (every agent reads the agreement
  and checks its own digest); that per-agent CPU (parallel on real nodes) is measured and
  reported beside the adoption;
- ``rpc_timeout`` is 60 s and the quick round's limit 120 s (a second per 30 nodes above 3600):
  requests queue behind thousands of agents' on two cores;
- the followers' wait slices (a wake-up to check the decider's lease, 1 s in production,
  each on its own CPU) last the whole round: the decider is never lost here, and thousands of
  slices ending on two cores queued for the interpreter lock behind the decider's planning
  (a collapse at 16384 nodes); the keep-alive processes run at the members' priority (-10, as
  root), each standing in for keep-alive threads that have their nodes' CPUs.

Reported: kill -> every agent adopted, split into detection (the lease's deletion seen by the
agents' watches), reports (the last agent seeing the loss -> the decider holding every report),
decision (the planning step), publication (fenced record, the whole decision offered in the
decider's worker store, the agreement under ``decision``; both
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
        [--active N] [--no-pin]
        [--cpu-profile] [--leader-change move|restart] [--leader-change-at S] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the modules beside it

from coordination_agents import (
    DEVICES_PER_NODE,
    RUN_ID,
    params_for,
    round_limit_s,
    spec_for,
    stores_of,
)
from coordination_hosts import favour_pid, host_main


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
        favour_pid(member.pid)


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

    params = params_for(endpoints, nodes, ttl)
    client = EtcdClient(EtcdSettings.from_config(params.endpoint, dict(params.config)))
    store, _etcd_store = stores_of(client)
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
              active: int = 0, pin: bool = True,
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
    cpus = sorted(os.sched_getaffinity(0))
    hosts = [ctx.Process(target=host_main,   # not daemonic: each starts its keep-alive process
                         args=(lo, hi, nodes, victim, cluster.endpoints, ttl, channels,
                               plan_dir, ready, orders[i], results, decider_nice, active,
                               cpus[i % len(cpus)] if pin else None))
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
    got = [_next(results, hosts, 2 * round_limit_s(nodes) + 60) for _ in hosts]
    if trouble is not None:   # a restarted member answers /metrics once it is back
        trouble.wait()
    m2, s2 = etcd_metrics(cluster), time.monotonic()
    say(f"  {nodes} nodes: every host reported ({time.monotonic() - t0:.1f} s)")
    return got, [(m0, s0), (m1, s1), (m2, s2)]


def run(nodes: int, members: int, procs: int, ttl: int, revoke: bool, channels: int = 4,
        steady: float = 10.0, say: Any = print, etcd_dir: str | None = None,
        decider_nice: int | None = None, cpu_profile: bool = False, active: int = 0,
        leader_change: str | None = None, leader_change_at: float = 0.5,
        pin: bool = True) -> dict[str, Any]:
    from chameleon_elastic.rendezvous.config import EtcdSettings
    from chameleon_elastic.rendezvous.local_cluster import LocalEtcdCluster

    _sweep_stale(etcd_dir)
    with tempfile.TemporaryDirectory(prefix=f"coordination-scale-{os.getpid()}-",
                                     dir=etcd_dir) as data, \
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
                                   on_restart=lambda member: favour_pid(member.pid))
        try:
            got, windows = _simulate(cluster, nodes, procs, channels, ttl, revoke, steady,
                                     plan_dir, say, decider_nice, active, pin, sampler,
                                     trouble)
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
    row["pinned_hosts"] = pin
    row["watch_breaks"] = sum(o.get("watch_breaks", 0) for g in got for o in g["outs"].values())
    if sampler is not None:
        row["cpu_windows"] = _cpu_windows(sampler, got, nodes // 2)
    row.update({"nodes": nodes, "devices": nodes * DEVICES_PER_NODE, "etcd_members": members,
                "procs": procs, "channels_per_proc": channels, "ttl_s": ttl,
                "kill": "revoke" if revoke else "expiry", "decider_nice": decider_nice,
                "active_per_proc": active})
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
        # what the steady state (keep-alives, watch progress) costs the members over the same
        # window: part of the round's figure above, not of the round's own work
        "steady_etcd_cpu_s": _rate(m0, m1, s1 - s0, "cpu_s") * (s2 - s1),
        "round_window_s": s2 - s1,
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
    parser.add_argument("--active", type=int, default=0,
                        help="agents of a process awake at once, woken in turn by the loss "
                             "and by the decision (default 0: all; a thousand runnable "
                             "threads on one interpreter lock thrash; at least 2: the "
                             "deciding agent holds one while it collects the reports)")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="each host process (its agents' threads, its gRPC threads, its "
                             "keep-alive process) on one CPU, the hosts dealt round-robin over "
                             "the CPUs this process may use (default: on; --no-pin lets the "
                             "kernel spread every thread over every CPU, as before: on this "
                             "virtual machine the cross-CPU wake-ups doubled the round's CPU)")
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
    if args.active == 1 or args.active < 0:
        parser.error(f"--active {args.active}: use 0 (every agent awake) or 2 or more; the "
                     "deciding agent stays awake while it collects the reports, so with 1 the "
                     "other agents of its process never report")
    if args.leader_change and args.members < 2:
        parser.error("--leader-change needs --members 2 or more (3: a majority survives)")
    say = (lambda s: print(s, file=sys.stderr, flush=True))
    # SIGTERM (timeout, a batch system) unwinds as Ctrl-C does: the hosts are killed and etcd's
    # members stopped, their data directories removed (by default it ended the process at once)
    signal.signal(signal.SIGTERM, _terminated)
    rows = [run(n, args.members, min(args.procs, n), args.ttl, args.kill == "revoke",
                max(1, min(args.channels, n // min(args.procs, n))), args.steady, say,
                args.etcd_dir, args.decider_nice, args.cpu_profile, leader_change=args.leader_change,
                leader_change_at=args.leader_change_at, active=args.active, pin=args.pin)
            for n in scales]
    if args.json:
        json.dump({"benchmark": "coordination_scale", "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    _print_table(rows, bool(args.leader_change))
    return 0


def _terminated(signum: int, frame: Any) -> None:
    print("coordination_scale: stopped by SIGTERM; stopping the hosts and etcd's members and "
          "removing their data", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def _sweep_stale(etcd_dir: str | None) -> None:
    """Remove the etcd data left by runs that were SIGKILLed (nothing else can remove it: in
    /dev/shm it holds memory until the next boot): each directory is named by its run's pid,
    and one whose run is gone is stale."""
    for path in Path(etcd_dir or tempfile.gettempdir()).glob("coordination-scale-*-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


def _print_table(rows: list[dict[str, Any]], leader_change: bool) -> None:
    """The rows as a table, then each row's CPU windows (``--cpu-profile``)."""
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
    if leader_change:
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


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:   # Ctrl-C: the hosts and members are stopped by now
        print("coordination_scale: interrupted; the hosts and etcd's members are stopped and "
              "their data removed", file=sys.stderr)
        sys.exit(130)
