"""A real network partition, not a kill: two nodes in their own network namespaces, joined to
etcd through a bridge; one node's link is cut while a float64 model trains.

- the other node notices through the cut node's lease, re-plans without it and recovers in place
  (its workers, blocked on the cut node's silent sockets, are unblocked by their watchdogs);
- the cut node, unable to refresh its lease, fences itself: its workers are stopped (its plan
  may be stale) and, the job having finished meanwhile, it ends with one line and exit 0
  instead of rejoining with an old plan.

Needs root and ``ip netns`` (iproute2, ``rendezvous.local_hosts``); skipped otherwise, with the
reason (the CI machine may not allow it; the development machine does).
"""

from __future__ import annotations

import pytest

from chameleon_elastic.rendezvous.local_etcd import LocalEtcd
from chameleon_elastic.rendezvous.local_hosts import LocalHosts, unavailable

from .conftest import MLP_FAULTS, assert_single_process_results, pid_alive, read_events, wait_for

SKIP = unavailable()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=f"partition test: {SKIP}")


@pytest.mark.timeout(150)
def test_a_partitioned_node_is_planned_around_and_fences_itself(tmp_path, launch):
    out = tmp_path / "out"
    out.mkdir()
    steps = 14
    with LocalHosts(2) as bed, LocalEtcd(data_dir=tmp_path / "etcd", host=bed.bridge_ip) as etcd:
        hosts = dict(zip("ab", bed.hosts))
        agents = {}
        for name, host in hosts.items():
            agents[name] = launch("chameleon", [
                "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "etcd-v3",
                "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "partition",
                "--rdzv-conf", "last_call_timeout=5,lease_ttl=2", "--local-addr", host.ip,
                "--monitor-interval", "0.1", "--no-status", "--preset", "tiny-cpu",
                "--state-dir", str(tmp_path / name), MLP_FAULTS, str(out), str(steps),
                "--pace", "0.3", "--min-world", "4"],
                name=name, env={"GLOO_SOCKET_IFNAME": host.inside}, wrap=host.wrap())
        wait_for(lambda: (out / "steps.jsonl").exists()
                 and len((out / "steps.jsonl").read_text().splitlines()) >= 4, 90,
                 "both nodes training")
        rank = {n: [e for e in read_events(tmp_path / n / "events.jsonl")
                    if e["event"] == "rendezvous"][-1]["group_rank"] for n in hosts}
        cut = next(n for n in hosts if rank[n] == 1)
        kept = next(n for n in hosts if n != cut)
        cut_node = 1   # group rank 1 in the first round: devices 2 and 3
        cut_workers = [int((out / f"pid-{d}").read_text().split()[0])
                       for d in (2 * cut_node, 2 * cut_node + 1)]
        bed.cut(hosts[cut])                                     # the partition
        assert agents[kept].wait(100) == 0, agents[kept].log.read_text()[-3000:]
        wait_for(lambda: all(not pid_alive(p) for p in cut_workers), 30,
                 "the cut node's workers to be stopped")
        bed.heal(hosts[cut])                                    # healed: nothing to rejoin
        assert agents[cut].wait(60) == 0   # the job finished

    assert_single_process_results(out, [0, 1], steps)
    kept_events = read_events(tmp_path / kept / "events.jsonl")
    assert any(e["event"] == "failure_seen" and e["kind"] == "node_lost" for e in kept_events)
    recovered = [e for e in kept_events if e["event"] == "recovered"]
    lost = [e for e in recovered if e["reason"] == "node_lost"]   # a straggler re-plan may follow
    assert len(lost) == 1 and lost[0]["mode"] == "inplace"
    cut_events = read_events(tmp_path / cut / "events.jsonl")
    assert any(e["event"] == "failure_seen" and e["kind"] == "fenced" for e in cut_events)
    assert cut_events[-1]["event"] == "job_finished" and cut_events[-1]["state"] == "SUCCEEDED"
    assert "the job finished on the other nodes while this node was cut off" in \
        agents[cut].log.read_text()
    assert "Traceback" not in agents[cut].log.read_text() + agents[kept].log.read_text()
