"""The agents' quick-round coordination at 256-1024 simulated nodes, on a real etcd cluster.

Each simulated node is one agent thread with what a production agent holds: its own etcd
client, a lease kept alive and a watch on the run's nodes (``launcher.node_watch.NodeWatch``),
and the rendezvous store (``EtcdStore`` under torch's ``PrefixStore``). Workers are faked: each
node reports 8 live devices. One node is killed (its keep-alive stops, so its lease expires
after the TTL; ``--kill revoke`` revokes it instead) and every other agent runs the real
recovery path: ``Rounds.quick`` then ``coordination.agree(quick=True)``, the lowest node
deciding with the real planner (a ``JobSession`` on the Llama-2-7B spec of
``planner_latency.py`` scaled to 8 devices per node; cold, no plan cache: the worst case).

Reported: kill -> every agent adopted, split into detection (the lease's expiry seen by the
agents' watches), reports (the last agent seeing the loss -> the decider holding every report),
decision (the planner), publication (fenced record + ``decision`` key) and adoption (published
-> the last agent adopted); and etcd's load over the steady state and the recovery window
(gRPC requests per second, summed over the members' ``/metrics``, and the watchers).

Agents run as threads in ``--procs`` processes (spawned): one Python process cannot drive
1024 agents' keep-alive, watch and poll threads on its own GIL without its own scheduling
delays dominating the figures (compare ``--procs 1`` with the default).

    python benchmarks/coordination_scale.py [--nodes 256,1024] [--members 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
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
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(backend="etcd-v3", endpoint=endpoints, run_id=RUN_ID,
                                min_nodes=1, max_nodes=nodes, lease_ttl=str(ttl))


def _stores(params: Any) -> tuple[Any, Any, Any]:
    """(client, the round's store as torch hands it to agents: a PrefixStore on EtcdStore, and
    the EtcdStore, which the caller keeps referenced: torch's bridge forwards its extended
    calls such as compare_set only while the Python object lives, as the handler's does)."""
    import torch.distributed as dist

    from chameleon_elastic.rendezvous.client import EtcdClient
    from chameleon_elastic.rendezvous.config import EtcdSettings
    from chameleon_elastic.rendezvous.store import EtcdStore

    settings = EtcdSettings.from_config(params.endpoint, dict(params.config))
    client = EtcdClient(settings)
    etcd_store = EtcdStore(client, settings.run_prefix(RUN_ID))
    return client, dist.PrefixStore(f"torch.rendezvous.{RUN_ID}.0", etcd_store), etcd_store


class Clock:
    """Timestamps (monotonic: one clock for every process of the host) of named moments."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.lock = threading.Lock()

    def wrap(self, module: Any, name: str) -> None:
        inner = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return inner(*args, **kwargs)
            finally:
                with self.lock:
                    self.marks[f"{name}_start"] = start
                    self.marks[f"{name}_end"] = time.monotonic()

        setattr(module, name, timed)


def _agent(node: int, nodes: int, params: Any, session: Any, plan_dir: Path, ready: Any,
           starting: threading.Semaphore, kill: threading.Event | None,
           out: dict[str, Any]) -> None:
    """One simulated agent: lease, watch, store; on another node's loss, the quick round.
    ``kill``: set for the victim only, which stops its keep-alive when told."""
    import copy

    from chameleon_elastic.launcher import coordination
    from chameleon_elastic.launcher.node_watch import NodeWatch
    from chameleon_elastic.launcher.rounds import Rounds

    with starting:   # a few at a time: a thousand simultaneous connects starve the keep-alives
        client, store, _etcd_store = _stores(params)
        watch = NodeWatch(params, node).start()
    if node != 0:   # followers adopt: a shallow copy of the process's session, own plan dir
        session = copy.copy(session)
        session.plan_dir, session.excluded = plan_dir / f"node{node}", set()
    rounds = Rounds(SimpleNamespace(backend="etcd-v3", max_nodes=nodes), None, None, None)
    rounds._last_info, rounds.nodes = SimpleNamespace(store=store), tuple(range(nodes))
    ready.put(node)
    try:
        if kill is not None:   # the victim: keep-alive stops; the lease expires (or is revoked)
            kill.wait()
            out["killed"] = time.monotonic()
            watch._live.stop(revoke=out.get("revoke", False))
            return
        while True:   # what the agent's monitor loop does, but woken by the watch's queue
            event = watch._live.events.get()
            watch._live.events.put(event)
            lost, _ = watch.changes()
            if lost:
                break
        out["detected"] = time.monotonic()
        _, members = rounds.quick(node, watch.alive)
        mine = coordination.NodeReport(node, (), tuple(range(node * DEVICES_PER_NODE,
                                                             (node + 1) * DEVICES_PER_NODE)),
                                       True)
        decision, _ = coordination.agree(store, rounds.scope(), members, mine, session, True,
                                         DEVICES_PER_NODE, 120.0, quick=True)
        out["adopted"] = time.monotonic()
        out["generation"] = decision.plan.generation if decision.plan else None
        out["excluded"] = len(decision.excluded)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if "killed" not in out:
            watch.close()
        client.close()


def _host(first: int, last: int, nodes: int, victim: int, endpoints: str, ttl: int,
          plan_dir: str, ready: Any, orders: Any, results: Any) -> None:
    """One process hosting agents ``first..last-1`` as threads."""
    from chameleon_elastic.launcher import coordination
    from chameleon_elastic.launcher.session import JobSession

    clock = Clock()
    for name in ("collect", "commit_record", "publish"):
        clock.wrap(coordination, name)
    session = JobSession(spec_for(nodes), "auto", Path(plan_dir) / "decider", cache_depth=0)
    clock.wrap(session, "apply")
    params = _params(endpoints, nodes, ttl)
    outs: dict[int, dict[str, Any]] = {n: {} for n in range(first, last)}
    kill, starting = threading.Event(), threading.Semaphore(8)
    threads = [threading.Thread(target=_agent, daemon=True,
                                args=(n, nodes, params, session, Path(plan_dir), ready,
                                      starting, kill if n == victim else None, outs[n]))
               for n in range(first, last)]
    for t in threads:
        t.start()
    while True:
        order = orders.get()
        if order is None:
            break
        outs[victim]["revoke"] = order
        kill.set()
    for t in threads:
        t.join(timeout=180)
    results.put({"outs": outs, "marks": clock.marks})


def etcd_metrics(cluster: Any) -> dict[str, float]:
    """gRPC requests handled and watchers, summed over the members' ``/metrics``."""
    total = {"requests": 0.0, "watchers": 0.0, "watch_streams": 0.0}
    for member in cluster.members:
        with urllib.request.urlopen(f"http://{member.endpoint}/metrics", timeout=5) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith("grpc_server_handled_total"):
                total["requests"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("etcd_debugging_mvcc_watcher_total "):
                total["watchers"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("etcd_debugging_mvcc_watch_stream_total "):
                total["watch_streams"] += float(line.rsplit(" ", 1)[1])
    return total


def _favour(cluster: Any) -> None:
    """Raise the members' CPU priority where allowed: on a shared 2-core machine a starved
    leader misses its heartbeats, elections follow and every lease expires at once, which a
    production etcd on its own cores does not do."""
    for member in cluster.members:
        try:
            os.setpriority(os.PRIO_PROCESS, member.pid, -10)
        except (OSError, TypeError):   # not root: run as is
            return


def _rate(a: dict[str, float], b: dict[str, float], seconds: float) -> float:
    return (b["requests"] - a["requests"]) / max(seconds, 1e-9)


def run(nodes: int, members: int, procs: int, ttl: int, revoke: bool,
        say: Any = print, etcd_dir: str | None = None) -> dict[str, Any]:
    from chameleon_elastic.launcher import coordination
    from chameleon_elastic.launcher.session import JobSession
    from chameleon_elastic.rendezvous.local_cluster import LocalEtcdCluster

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="coordination-scale-", dir=etcd_dir) as data, \
            LocalEtcdCluster(members=members, work_dir=data) as cluster, \
            tempfile.TemporaryDirectory(prefix="coordination-scale-") as plan_dir:
        _favour(cluster)
        params = _params(cluster.endpoints, nodes, ttl)
        client, store, _etcd_store = _stores(params)
        session = JobSession(spec_for(nodes), "auto", Path(plan_dir) / "seed", cache_depth=0)
        victim = nodes // 2
        first = coordination.Decision(session.plan, (), tuple(session.plan.working_devices),
                                      True, nodes=tuple(range(nodes)))
        coordination.commit_record(store.underlying_store, "", first)
        ready, results = ctx.Queue(), ctx.Queue()
        bounds = [(i * nodes // procs, (i + 1) * nodes // procs) for i in range(procs)]
        orders = [ctx.Queue() for _ in bounds]
        hosts = [ctx.Process(target=_host, daemon=True,
                             args=(lo, hi, nodes, victim, cluster.endpoints, ttl, plan_dir,
                                   ready, orders[i], results))
                 for i, (lo, hi) in enumerate(bounds)]
        t0 = time.monotonic()
        for h in hosts:
            h.start()
        for count in range(1, nodes + 1):
            ready.get(timeout=300)
            if count % max(1, nodes // 8) == 0 or count == nodes:
                say(f"  {nodes} nodes: {count} agents registered ({time.monotonic() - t0:.1f} s)")
        time.sleep(ttl)   # every watch has seen every node; leases refreshed at least twice
        m0, s0 = etcd_metrics(cluster), time.monotonic()
        time.sleep(ttl)
        m1, s1 = etcd_metrics(cluster), time.monotonic()
        say(f"  {nodes} nodes: killing node {victim} ({'revoke' if revoke else 'lease expiry'})")
        owner = next(i for i, (lo, hi) in enumerate(bounds) if lo <= victim < hi)
        orders[owner].put(revoke)
        for q in orders:
            q.put(None)
        got = [results.get(timeout=300) for _ in hosts]
        m2, s2 = etcd_metrics(cluster), time.monotonic()
        for h in hosts:
            h.join(timeout=30)
        client.close()
    outs = {n: o for g in got for n, o in g["outs"].items()}
    errors = {n: o["error"] for n, o in outs.items() if "error" in o}
    if errors:
        raise RuntimeError(f"{len(errors)} agents failed, e.g. {next(iter(errors.items()))}")
    marks = next(g["marks"] for g in got if "apply_start" in g["marks"])
    killed = outs[victim]["killed"]
    alive = [o for n, o in outs.items() if n != victim]
    early = [n for n, o in outs.items() if o.get("detected", killed) < killed]
    if early:
        raise RuntimeError(f"agents {early[:5]} saw a node lost before the kill: leases expired "
                           "while the machine was overloaded; run again with a longer --ttl")
    detected = sorted(o["detected"] for o in alive)
    adopted = max(o["adopted"] for o in alive)
    # the round's own requests: those of the window past the steady state's (keep-alives)
    round_requests = (m2["requests"] - m1["requests"]) - _rate(m0, m1, s1 - s0) * (s2 - s1)
    return {
        "nodes": nodes, "devices": nodes * DEVICES_PER_NODE, "etcd_members": members,
        "procs": procs, "ttl_s": ttl, "kill": "revoke" if revoke else "expiry",
        "detect_first_s": detected[0] - killed, "detect_last_s": detected[-1] - killed,
        "detect_median_s": statistics.median(detected) - killed,
        "reports_s": marks["collect_end"] - detected[-1],
        "decision_s": marks["apply_end"] - marks["apply_start"],
        "publication_s": marks["publish_end"] - marks["apply_end"],
        "adoption_s": adopted - marks["publish_end"],
        "total_s": adopted - killed,
        "decision_plus_publication_s": marks["publish_end"] - marks["apply_start"],
        "generation": {o["generation"] for o in alive}.pop(),
        "agreed": len({(o["generation"], o["excluded"]) for o in alive}) == 1,
        "excluded_devices": max(o["excluded"] for o in alive),
        "steady_requests_per_s": _rate(m0, m1, s1 - s0),
        "round_requests": round_requests,
        "round_requests_per_s": round_requests / max(adopted - detected[0], 1e-9),
        "watchers": m1["watchers"], "watch_streams": m1["watch_streams"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="256,1024",
                        help="comma-separated simulated node counts (default 256,1024)")
    parser.add_argument("--members", type=int, default=3, help="etcd members (default 3)")
    parser.add_argument("--procs", type=int, default=4,
                        help="processes hosting the agent threads (default 4)")
    parser.add_argument("--ttl", type=int, default=5,
                        help="lease TTL in seconds (default 5, chameleon-run's)")
    parser.add_argument("--kill", choices=("expiry", "revoke"), default="expiry",
                        help="how the node is lost: its lease expires (default) or is revoked")
    parser.add_argument("--etcd-dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                        help="where the members keep their data (default /dev/shm: a shared "
                             "machine's disk makes every lease grant wait on fsync, which a "
                             "production etcd's SSD does not)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        scales = [int(x) for x in args.nodes.split(",")]
    except ValueError:
        parser.error(f"--nodes {args.nodes!r} must be comma-separated integers, e.g. 256,1024")
    if min(scales) < 2 or args.procs < 1 or args.members < 1:
        parser.error("--nodes needs at least 2 nodes each, --procs and --members at least 1")
    say = (lambda s: print(s, file=sys.stderr, flush=True))
    rows = [run(n, args.members, min(args.procs, n), args.ttl, args.kill == "revoke", say,
                args.etcd_dir)
            for n in scales]
    if args.json:
        json.dump({"benchmark": "coordination_scale", "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    cols = [("nodes", "nodes", "{}"), ("detect (last)", "detect_last_s", "{:.2f} s"),
            ("reports", "reports_s", "{:.3f} s"), ("decision", "decision_s", "{:.3f} s"),
            ("publication", "publication_s", "{:.3f} s"), ("adoption", "adoption_s", "{:.3f} s"),
            ("kill -> all adopted", "total_s", "{:.2f} s"),
            ("etcd req/s steady", "steady_requests_per_s", "{:.0f}"),
            ("etcd req/s round", "round_requests_per_s", "{:.0f}"),
            ("watchers", "watchers", "{:.0f}")]
    print(" | ".join(c for c, _, _ in cols))
    for r in rows:
        print(" | ".join(f.format(r[k]) for _, k, f in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
