"""Real torch elastic agents on loopback with --rdzv-backend etcd-v3 (a real etcd, gloo workers).

- plain ``torchrun`` agents form a group of three (and chameleon-run agents a group of two);
- the group-rank-0 node (agent + worker) is SIGKILLed: its lease key vanishes (what
  chameleon-run watches), the survivors' agents re-form a group of two through etcd and
  training carries on; the node is restarted and rejoins (group of three again);
- etcd is stopped and restarted on the same data dir while training runs: the job carries on
  and finishes cleanly (its exit barrier goes through etcd after the restart).
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
from _rdzv_agents import (
    NODE_AGENT,
    TTL,
    chameleon_run,
    kill_tree,
    live_reports,
    progress,
    torchrun_args,
)

from chameleon_elastic.rendezvous.liveness import NodeEvent, NodeLiveness


@pytest.mark.timeout(90)
def test_plain_torchrun_agents_form_a_group_of_three(etcd_server, agents, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    procs = [
        agents.start([*torchrun, *torchrun_args(etcd_server.endpoint, "form", "3", out, 10)],
                     f"agent{i}")
        for i in range(3)
    ]
    assert agents.wait_exit(procs, 80) == [0, 0, 0], agents.tails()
    reports = progress(out)
    assert sorted(r["rank"] for r in reports) == [0, 1, 2]
    assert all(r["world_size"] == 3 and r["sum"] == 3.0 and r["step"] == 10 for r in reports)
    assert sorted(r["group_rank"] for r in reports) == [0, 1, 2]


@pytest.mark.timeout(150)
def test_killed_node_is_seen_by_lease_and_group_carries_on(etcd_server, agents, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    events: list[tuple[float, NodeEvent]] = []
    from chameleon_elastic.rendezvous.client import EtcdClient
    from chameleon_elastic.rendezvous.config import EtcdSettings

    settings = EtcdSettings.from_config(etcd_server.endpoint)
    client = EtcdClient(settings)
    observer = NodeLiveness(client, settings.run_prefix("kill"), "observer", register_self=False,
                            on_event=lambda e: events.append((time.monotonic(), e))).start()

    def node(i: int) -> subprocess.Popen[bytes]:
        argv = [sys.executable, NODE_AGENT, etcd_server.endpoint, "kill", f"node{i}", str(TTL),
                "--", *torchrun_args(etcd_server.endpoint, "kill", "2:3", out, 100000)]
        return agents.start(argv, f"node{i}")

    try:
        procs = {i: node(i) for i in range(3)}
        first = agents.wait_until("a group of three", lambda: live_reports(out, 3, 3), 60)
        # kill group rank 0: its agent published the workers' bootstrap address and its worker
        # hosts the workers' store, the case torch's reused agent store cannot survive
        victim_pid = psutil.Process(min(first, key=lambda r: r["group_rank"])["pid"]).ppid()
        victim = next(i for i, p in procs.items() if p.pid == victim_pid)
        killed_at = time.monotonic()
        kill_tree(procs[victim])
        left = agents.wait_until(
            "the lease-based loss event",
            lambda: [t for t, e in events if e.kind == "left" and e.node_id == f"node{victim}"],
            TTL + 20,
        )
        print(f"lost node seen {left[0] - killed_at:.2f} s after SIGKILL (ttl {TTL} s)")
        agents.wait_until("the survivors to train as a group of two",
                          lambda: live_reports(out, 2, 3), 60)
        procs[victim] = node(victim)  # the node comes back
        agents.wait_until("the node to rejoin (group of three)",
                          lambda: live_reports(out, 3, 3), 60)
        assert any(e.kind == "joined" and e.node_id == f"node{victim}" and t > killed_at
                   for t, e in events)
        (out / "stop").touch()
        assert agents.wait_exit(list(procs.values()), 40) == [0, 0, 0], agents.tails()
    finally:
        observer.stop()
        client.close()


@pytest.mark.timeout(90)
def test_etcd_restart_mid_run_job_carries_on(etcd_server, agents, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    procs = [
        agents.start([*torchrun, *torchrun_args(etcd_server.endpoint, "outage", "2", out,
                                                100000)], f"agent{i}")
        for i in range(2)
    ]
    before = agents.wait_until("a group of two", lambda: live_reports(out, 2, 3), 60)
    etcd_server.stop()
    pids = {r["pid"] for r in before}
    agents.wait_until("training to go on while etcd is down",
                      lambda: live_reports(out, 2, max(r["step"] for r in before) + 10), 30)
    etcd_server.start()
    # the agents' next keep-alive and monitor rounds reach etcd again; then a clean stop,
    # whose exit barrier runs through the etcd store
    agents.wait_until("training to go on after etcd is back",
                      lambda: live_reports(out, 2, max(r["step"] for r in before) + 20), 30)
    (out / "stop").touch()
    assert agents.wait_exit(procs, 40) == [0, 0], agents.tails()
    final = progress(out)
    assert {r["pid"] for r in final} == pids  # no worker was restarted


@pytest.mark.timeout(90)
def test_chameleon_run_agents_form_a_group_on_etcd_v3(etcd_server, agents, tmp_path) -> None:
    pytest.importorskip("chameleon_elastic.launcher.cli")
    out = tmp_path / "out"
    out.mkdir()
    launcher = chameleon_run()
    procs = [
        agents.start([*launcher, *torchrun_args(etcd_server.endpoint, "cr", "2", out, 5)],
                     f"chameleon-run{i}")
        for i in range(2)
    ]
    assert agents.wait_exit(procs, 80) == [0, 0], agents.tails()
    reports = progress(out)
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["world_size"] == 2 and r["sum"] == 2.0 and r["step"] == 5 for r in reports)
