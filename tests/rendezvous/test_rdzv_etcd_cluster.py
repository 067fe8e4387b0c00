"""etcd itself failing: a three-member local cluster under the client and under a running job.

- the helper: every member healthy with one leader; a killed leader is replaced; a restarted
  member comes back as the same member with the data; no leader without a majority; stop()
  reaps every process;
- the client fails over: a dead member costs one attempt, for pyetcd's wrapped calls and for
  our direct ones (the connect probe, the store's multi-key read), instead of the retry deadline;
- real chameleon-run agents (2 nodes x 2 workers, gloo) with ``--rdzv-endpoint`` naming all
  three members: SIGKILL of the etcd leader, and SIGKILL then restart of a member, mid-run. The
  agents' writes to the rendezvous state must go on through the surviving members (a new
  revision after the kill), no worker may be restarted, and the job ends with exit 0 through
  its exit barrier on etcd.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
from _rdzv_agents import Agents, chameleon_run, live_reports, progress, torchrun_args

from chameleon_elastic.rendezvous.backend import EtcdV3RendezvousBackend
from chameleon_elastic.rendezvous.client import EtcdClient
from chameleon_elastic.rendezvous.config import EtcdSettings
from chameleon_elastic.rendezvous.errors import EtcdServerError
from chameleon_elastic.rendezvous.local_cluster import LocalEtcdCluster
from chameleon_elastic.rendezvous.store import EtcdStore


@contextmanager
def client_for(endpoints: str, **conf: str) -> Iterator[EtcdClient]:
    settings = EtcdSettings.from_config(
        endpoints, {"retry_timeout": "20", "connect_timeout": "5", **conf}
    )
    client = EtcdClient(settings)
    try:
        yield client
    finally:
        client.close()


def member_index(cluster: LocalEtcdCluster, member_id: int) -> int:
    ids = [cluster.member_id(i) for i in cluster.running()]
    return cluster.running()[ids.index(member_id)]


# -- the helper ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_cluster_replaces_a_killed_leader_and_takes_a_member_back(etcd_cluster) -> None:
    assert len(etcd_cluster.endpoints.split(",")) == 3
    with client_for(etcd_cluster.endpoints) as client:
        EtcdStore(client, "/chameleon/rdzv/cluster/").set("k", "before")
        old, old_term = etcd_cluster.leader_claim()
        old_id = etcd_cluster.member_id(old)
        etcd_cluster.kill(old)
        assert etcd_cluster.running() == [i for i in range(3) if i != old]
        new = etcd_cluster.leader(timeout=15)
        assert new != old
        assert etcd_cluster.term(new) > old_term  # an election took place
        EtcdStore(client, "/chameleon/rdzv/cluster/").set("k", "after")
        etcd_cluster.restart(old)
        assert etcd_cluster.member_id(old) == old_id  # same data dir: the same member
    # the restarted member alone serves the write it missed while it was dead
    with client_for(etcd_cluster.members[old].endpoint) as alone:
        assert EtcdStore(alone, "/chameleon/rdzv/cluster/").get("k") == b"after"


@pytest.mark.timeout(60)
def test_no_leader_without_a_majority(etcd_cluster) -> None:
    # the leader goes too: a leader left alone claims its role for up to an election timeout
    leader = etcd_cluster.leader()
    etcd_cluster.kill(leader)
    etcd_cluster.kill((leader + 1) % 3)
    with pytest.raises(EtcdServerError, match="majority of members must run"):
        etcd_cluster.leader(timeout=3)


@pytest.mark.timeout(60)
def test_stop_reaps_every_member(tmp_path: Path) -> None:
    cluster = LocalEtcdCluster(members=3, work_dir=tmp_path / "c").start()
    pids = [member.pid for member in cluster.members]
    assert all(pid is not None for pid in pids)
    cluster.stop()
    assert cluster.running() == []
    assert not any(psutil.pid_exists(pid) for pid in pids if pid is not None)


@pytest.mark.timeout(60)
def test_members_die_with_the_process_that_started_them(tmp_path: Path) -> None:
    # the parent is killed, so it cannot remove a directory of its own: give it tmp_path's
    code = ("from chameleon_elastic.rendezvous.local_cluster import LocalEtcdCluster; "
            f"import time; c = LocalEtcdCluster(3, work_dir={str(tmp_path / 'c')!r}).start(); "
            "print(*(m.pid for m in c.members), flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]  # type: ignore[union-attr]
    finally:
        parent.kill()
        parent.wait(timeout=10)
    assert len(pids) == 3
    deadline = time.monotonic() + 20
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if _running(pid)]
    for orphan in alive:
        psutil.Process(orphan).kill()
    assert not alive, "an etcd member outlived the process that started it"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- the client ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_client_moves_off_a_dead_member_at_once(etcd_cluster) -> None:
    # before the fix, a call stayed on the dead member until retry_timeout, then raised
    with client_for(etcd_cluster.endpoints, retry_timeout="8") as client:
        store = EtcdStore(client, "/chameleon/rdzv/failover/")
        store.set("k", "v")
        serving = member_index(etcd_cluster, int(client.status().header.member_id))
        etcd_cluster.kill(serving)
        started = time.monotonic()
        # get first checks the key with a direct Txn call, which pyetcd does not fail over
        assert store.get("k") == b"v"
        answered_by = int(client.status().header.member_id)
        took = time.monotonic() - started
    print(f"moved off the dead member in {took:.2f} s")
    assert member_index(etcd_cluster, answered_by) != serving


@pytest.mark.timeout(60)
def test_connect_skips_a_dead_member(etcd_cluster) -> None:
    etcd_cluster.kill(0)
    dead, alive = etcd_cluster.members[0].endpoint, etcd_cluster.members[1].endpoint
    # pyetcd starts on a random endpoint: of 8 clients about 4 start on the dead one
    for _ in range(8):
        with client_for(f"{dead},{alive}", connect_timeout="3") as client:
            assert client.status().header.member_id == etcd_cluster.member_id(1)


# -- a running job ---------------------------------------------------------------------------


def start_job(cluster: LocalEtcdCluster, agents: Agents, out: Path, run_id: str) -> list[Any]:
    """Two chameleon-run agents x two gloo workers, rendezvous on every member of the cluster."""
    return [
        agents.start([*chameleon_run(), *torchrun_args(cluster.endpoints, run_id, "2", out,
                                                         100000, nproc=2)], f"agent{i}")
        for i in range(2)
    ]


def state_revision(client: EtcdClient, run_id: str) -> int:
    """mod revision of the run's rendezvous state, which every agent heartbeat rewrites."""
    state = EtcdV3RendezvousBackend(client, client.settings.run_prefix(run_id)).get_state()
    assert state is not None
    return int(state[1])


def finish(agents: Agents, procs: list[Any], out: Path, pids: set[int]) -> None:
    """Let the job train on, stop it, and check nothing was restarted and it exited 0."""
    step = max(r["step"] for r in progress(out))
    agents.wait_until("training to go on", lambda: live_reports(out, 4, step + 10), 20)
    (out / "stop").touch()
    assert agents.wait_exit(procs, 30) == [0, 0], agents.tails()
    final = progress(out)
    assert {r["pid"] for r in final} == pids, "a worker was restarted"
    assert len({r["step"] for r in final}) == 1 and all(r["sum"] == 4.0 for r in final)


@pytest.mark.timeout(60)
def test_job_survives_the_etcd_leader_being_killed(etcd_cluster, agents, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    procs = start_job(etcd_cluster, agents, out, "leader-loss")
    pids = {r["pid"] for r in agents.wait_until(
        "a group of 2 nodes x 2 workers", lambda: live_reports(out, 4, 3), 40)}
    with client_for(etcd_cluster.endpoints) as client:
        old, old_term = etcd_cluster.leader_claim()
        step_at_kill = min(r["step"] for r in progress(out))
        killed_at = time.monotonic()
        etcd_cluster.kill(old)
        new = etcd_cluster.leader(timeout=15)
        elected_s = time.monotonic() - killed_at
        steps_meanwhile = min(r["step"] for r in progress(out)) - step_at_kill
        assert new != old and etcd_cluster.term(new) > old_term  # elected, not stale
        seen = state_revision(client, "leader-loss")  # a linearizable read: after the kill
        agents.wait_until("an agent heartbeat written through the new leader",
                          lambda: state_revision(client, "leader-loss") > seen, 20)
        written_s = time.monotonic() - killed_at
    print(f"leader member{old} SIGKILLed: member{new} leader after {elected_s:.2f} s "
          f"(workers trained {steps_meanwhile} steps meanwhile), agents' next rendezvous "
          f"write seen after {written_s:.2f} s")
    finish(agents, procs, out, pids)


@pytest.mark.timeout(60)
def test_job_survives_a_member_killed_and_restarted(etcd_cluster, agents, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    procs = start_job(etcd_cluster, agents, out, "member-loss")
    pids = {r["pid"] for r in agents.wait_until(
        "a group of 2 nodes x 2 workers", lambda: live_reports(out, 4, 3), 40)}
    victim = next(i for i in range(3) if i != etcd_cluster.leader())
    victim_id = etcd_cluster.member_id(victim)
    with client_for(etcd_cluster.endpoints) as client:
        killed_at = time.monotonic()
        etcd_cluster.kill(victim)
        seen = state_revision(client, "member-loss")
        agents.wait_until("an agent heartbeat while the member is dead",
                          lambda: state_revision(client, "member-loss") > seen, 20)
        written_s = time.monotonic() - killed_at
        restart_at = time.monotonic()
        etcd_cluster.restart(victim)
        restart_s = time.monotonic() - restart_at
        assert etcd_cluster.member_id(victim) == victim_id
        latest = state_revision(client, "member-loss")
    # the restarted member alone serves the agents' writes, those it missed and new ones
    with client_for(etcd_cluster.members[victim].endpoint) as alone:
        assert state_revision(alone, "member-loss") >= latest
        agents.wait_until("an agent heartbeat read from the restarted member",
                          lambda: state_revision(alone, "member-loss") > latest, 20)
    print(f"follower member{victim} SIGKILLed: agents' next rendezvous write seen after "
          f"{written_s:.2f} s; restarted and healthy in {restart_s:.2f} s")
    finish(agents, procs, out, pids)
