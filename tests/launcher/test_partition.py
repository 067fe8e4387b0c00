"""A real network partition, not a kill: two nodes in their own network namespaces, joined to
etcd through a bridge; one node's link is cut while a float64 model trains.

- the other node notices through the cut node's lease, re-plans without it and recovers in place
  (its workers, blocked on the cut node's silent sockets, are unblocked by their watchdogs);
- the cut node, unable to refresh its lease, fences itself: its workers are stopped (its plan
  may be stale) and, the job having finished meanwhile, it ends with one sentence instead of
  rejoining with an old plan.

Needs root and ``ip netns`` (iproute2); skipped otherwise, with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from .conftest import MLP_FAULTS, assert_single_process_results, pid_alive, read_events, wait_for


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _netns_available() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"chprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
        _ip("netns", "del", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"ip netns is not permitted here ({exc})"
    return None


SKIP = _netns_available()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=f"partition test: {SKIP}")


@pytest.fixture
def two_hosts():
    """Namespaces ``<tag>a`` (10.88.x.2) and ``<tag>b`` (10.88.x.3) on a bridge (10.88.x.1)."""
    tag = f"ch{uuid.uuid4().hex[:5]}"
    subnet = f"10.88.{os.getpid() % 250}"
    bridge = f"{tag}br"
    hosts = {}
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, name in ((2, "a"), (3, "b")):
            ns, outside, inside = f"{tag}{name}", f"{tag}{name}o", f"{tag}{name}i"
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            _ip("netns", "exec", ns, "ip", "addr", "add", f"{subnet}.{i}/24", "dev", inside)
            _ip("netns", "exec", ns, "ip", "link", "set", inside, "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
            hosts[name] = {"ns": ns, "ip": f"{subnet}.{i}", "inside": inside,
                           "outside": outside}
        yield f"{subnet}.1", hosts
    finally:
        for host in hosts.values():   # best effort: whatever was created goes
            subprocess.run(["ip", "netns", "del", host["ns"]], check=False,
                           capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", bridge], check=False, capture_output=True,
                       timeout=10)


@pytest.mark.timeout(150)
def test_a_partitioned_node_is_planned_around_and_fences_itself(tmp_path, launch, two_hosts):
    local_etcd = pytest.importorskip("chameleon_elastic.rendezvous.local_etcd")
    bridge_ip, hosts = two_hosts
    out = tmp_path / "out"
    out.mkdir()
    steps = 14
    with local_etcd.LocalEtcd(data_dir=tmp_path / "etcd", host=bridge_ip) as etcd:
        agents = {}
        for name, host in hosts.items():
            agents[name] = launch("chameleon", [
                "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "etcd-v3",
                "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "partition",
                "--rdzv-conf", "last_call_timeout=5,lease_ttl=2", "--local-addr", host["ip"],
                "--monitor-interval", "0.1", "--no-status", "--preset", "tiny-cpu",
                "--state-dir", str(tmp_path / name), MLP_FAULTS, str(out), str(steps),
                "--pace", "0.3", "--min-world", "4"],
                name=name, env={"GLOO_SOCKET_IFNAME": host["inside"]},
                wrap=["ip", "netns", "exec", host["ns"]])
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
        _ip("link", "set", hosts[cut]["outside"], "down")      # the partition
        assert agents[kept].wait(100) == 0, agents[kept].log.read_text()[-3000:]
        wait_for(lambda: all(not pid_alive(p) for p in cut_workers), 30,
                 "the cut node's workers to be stopped")
        _ip("link", "set", hosts[cut]["outside"], "up")       # healed: nothing to rejoin
        assert agents[cut].wait(60) == 1

    assert_single_process_results(out, [0, 1], steps)
    kept_events = read_events(tmp_path / kept / "events.jsonl")
    assert any(e["event"] == "failure_seen" and e["kind"] == "node_lost" for e in kept_events)
    recovered = [e for e in kept_events if e["event"] == "recovered"]
    assert recovered[-1]["mode"] == "inplace" and recovered[-1]["reason"] == "node_lost"
    cut_events = read_events(tmp_path / cut / "events.jsonl")
    assert any(e["event"] == "failure_seen" and e["kind"] == "fenced" for e in cut_events)
    assert cut_events[-1]["event"] == "job_finished" and cut_events[-1]["state"] == "FAILED"
    assert "nothing to rejoin" in agents[cut].log.read_text()
    assert "Traceback" not in agents[cut].log.read_text() + agents[kept].log.read_text()
