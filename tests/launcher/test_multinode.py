"""Two agents on loopback with the c10d rendezvous: the agent hosting the store is SIGKILLed and
the other one carries on alone (it rebuilds the rendezvous on the same endpoint)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from .conftest import (
    MLP_FAULTS,
    PROBE,
    assert_single_process_results,
    free_port,
    pid_alive,
    port_open,
    read_envs,
    read_events,
    wait_for,
)


def _world(records, size: int) -> list[dict]:
    return [r for r in records if r["env"]["WORLD_SIZE"] == str(size)]


@pytest.mark.timeout(90)
def test_survivor_carries_on_when_the_store_host_agent_is_killed(tmp_path, launch):
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "store-host-test",
              "--max-restarts", "2", "--monitor-interval", "0.1", "--no-status"]
    host = launch("chameleon", [*common, "--event-log", str(tmp_path / "host.jsonl"),
                                PROBE, str(out), "hold"], name="host")
    wait_for(lambda: port_open(port), 45, "the first agent to host the rendezvous store")
    other = launch("chameleon", [*common, "--event-log", str(tmp_path / "other.jsonl"),
                                 PROBE, str(out), "hold"], name="other")
    pair = wait_for(lambda: len(_world(read_envs(out), 2)) == 2 and _world(read_envs(out), 2),
                    60, "both agents' workers in one world of 2")
    host_worker = next(r for r in pair if r["ppid"] == host.proc.pid)

    os.kill(host.proc.pid, signal.SIGKILL)
    host.proc.wait(10)
    alone = wait_for(
        lambda: [r for r in _world(read_envs(out), 1) if r["ppid"] == other.proc.pid],
        45, "the surviving agent to relaunch its worker in a world of 1")
    (out / "release").touch()
    assert other.wait(30) == 0

    assert alone[0]["env"]["RANK"] == "0" and alone[0]["store_reachable"]
    wait_for(lambda: not pid_alive(host_worker["pid"]), 10, "the killed agent's worker to die")
    events = [json.loads(x) for x in (tmp_path / "other.jsonl").read_text().splitlines()]
    names = [e["event"] for e in events]
    assert "rendezvous_failover" in names
    assert names[-1] == "job_finished" and events[-1]["state"] == "SUCCEEDED"


@pytest.mark.timeout(90)
def test_lost_node_under_job_is_planned_around_without_spending_a_restart(tmp_path, launch):
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    common = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lost-node-test",
              "--max-restarts", "1", "--monitor-interval", "0.1", "--no-status",
              "--preset", "tiny-cpu"]
    first = launch("chameleon", [*common, "--state-dir", str(tmp_path / "a"),
                                 PROBE, str(out), "hold-peers"], name="a")
    wait_for(lambda: port_open(port), 45, "the first agent to host the rendezvous store")
    second = launch("chameleon", [*common, "--state-dir", str(tmp_path / "b"),
                                  PROBE, str(out), "hold-peers"], name="b")

    def launches() -> list[list[dict]]:
        by_port: dict[str, list] = {}
        for r in read_envs(out):
            by_port.setdefault(r["env"]["MASTER_PORT"], []).append(r)
        return sorted(by_port.values(), key=lambda rs: rs[0]["time"])

    # the first agent may start alone (devices 2, 3 absent) and re-plan when node 1 joins
    full = wait_for(lambda: next((rs for rs in launches() if len(rs) == 4), None), 60,
                    "4 workers on 2 nodes")
    gen = int(full[0]["env"]["CHAMELEON_PLAN_GENERATION"])
    node1 = {r["env"]["CHAMELEON_DEVICE"] for r in full if r["ppid"] == second.proc.pid}
    assert node1 == {"2", "3"}                       # device = node * nproc + local_rank
    os.kill(second.proc.pid, signal.SIGKILL)          # node 1 dies with its workers
    second.proc.wait(10)
    after = wait_for(
        lambda: next((rs for rs in launches()
                      if int(rs[0]["env"]["CHAMELEON_PLAN_GENERATION"]) > gen
                      and len(rs) == 2), None),
        45, "the surviving node's workers under a new plan")
    (out / "release").touch()
    assert first.wait(30) == 0
    assert sorted(r["env"]["CHAMELEON_DEVICE"] for r in after) == ["0", "1"]
    assert sorted(r["env"]["RANK"] for r in after) == ["0", "1"]
    assert {r["env"]["WORLD_SIZE"] for r in after} == {"2"}
    # a relaunch: one more than the full world's (0, or 1 when the first agent started alone,
    # as it does when the second is slow to start on a loaded machine)
    counted = int(full[0]["env"]["TORCHELASTIC_RESTART_COUNT"])
    assert {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in after} == {str(counted + 1)}
    events = [json.loads(x) for x in (tmp_path / "a" / "events.jsonl").read_text().splitlines()]
    chosen = [e for e in events if e["event"] == "plan_chosen"]
    assert chosen[-1]["lost"] == [2, 3] and chosen[-1]["decided_here"]


@pytest.mark.timeout(90)
def test_etcd_v3_backend_restarts_through_a_real_etcd(tmp_path, launch):
    """The rendezvous engineer's etcd-v3 backend, registered by chameleon-run, under our agent."""
    local_etcd = pytest.importorskip("chameleon_elastic.rendezvous.local_etcd")
    out = tmp_path / "out"
    out.mkdir()
    with local_etcd.LocalEtcd(data_dir=tmp_path / "etcd") as etcd:
        run = launch("chameleon", ["--nnodes", "1:2", "--nproc-per-node", "2",
                                   "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
                                   "--rdzv-id", "etcd-test", "--rdzv-conf", "last_call_timeout=1",
                                   "--max-restarts", "1", "--no-status",
                                   PROBE, str(out), "crash-n", "1"])
        assert run.wait(60) == 0
    records = read_envs(out)
    rank0 = sorted(int(r["env"]["TORCHELASTIC_RESTART_COUNT"]) for r in records
                   if r["env"]["RANK"] == "0")
    assert rank0 == [0, 1]
    assert len({r["env"]["MASTER_PORT"] for r in records}) == 2
    assert all(r["store_reachable"] for r in records if r["env"]["RANK"] == "0")


def _group_rank(state: Path) -> int | None:
    events = [e for e in read_events(state / "events.jsonl") if e["event"] == "rendezvous"]
    return events[-1]["group_rank"] if events else None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault, victim_rank, nnodes", [
    ("kill", 1, "1:2"), ("stop", 1, "1:2"),
    ("kill", 0, "1:2"),    # the quick round's decider: its lease outlives it by up to 2 s
    ("kill", 1, "2"),      # the usual launch: min = max; the minimum binds the first round only
    # the reporting process's node dies right after it printed step 6, its agent with it:
    # nobody is left who heard it, and the new reporter must not print step 6 again
    ("print", 0, "1:2"),
])
def test_lost_node_on_etcd_v3_recovers_in_place(tmp_path, launch, fault, victim_rank, nnodes):
    """2 agents x 2 gloo workers on a real etcd; one whole node (agent and workers) is
    SIGKILLed, or SIGSTOPped (frozen: no socket resets, its lease just stops being refreshed),
    while a float64 model trains: the other node's workers regroup in place, take the lost
    layers from their peers and finish with single-process results, whether the job was
    launched elastic (``1:2``) or fixed-size (``2``). Without a rendezvous round: when the lost
    node is the one that decides quick rounds (the lowest), the survivor decides in its place
    once its lease is gone (giving up for a full round cost 6.6 s). Every step is printed once
    by the job, also when the node lost is the reporter's."""
    local_etcd = pytest.importorskip("chameleon_elastic.rendezvous.local_etcd")
    out = tmp_path / "out"
    out.mkdir()
    steps = 12
    frozen: list[psutil.Process] = []
    with local_etcd.LocalEtcd(data_dir=tmp_path / "etcd") as etcd:
        common = ["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", "etcd-v3",
                  "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", f"{fault}-{victim_rank}",
                  "--rdzv-conf", "last_call_timeout=5,lease_ttl=2", "--local-addr", "127.0.0.1",
                  "--monitor-interval", "0.1", "--no-status", "--preset", "tiny-cpu"]
        agents = [launch("chameleon", [*common, "--state-dir", str(tmp_path / name),
                                       MLP_FAULTS, str(out), str(steps), "--pace", "0.3",
                                       "--min-world", "4",
                                       *(["0:6:reported:kill-node"] if fault == "print" else [])],
                         name=name) for name in ("a", "b")]
        wait_for(lambda: (out / "steps.jsonl").exists()
                 and len((out / "steps.jsonl").read_text().splitlines()) >= 4, 90,
                 "both nodes training")
        ranks = {name: _group_rank(tmp_path / name) for name in ("a", "b")}
        victim = next(i for i, name in enumerate(("a", "b")) if ranks[name] == victim_rank)
        survivor = agents[1 - victim]
        survivor_state = tmp_path / ("a", "b")[1 - victim]
        try:
            if fault == "print":   # the reporter kills its node itself
                agents[victim].proc.wait(60)
            elif fault == "kill":
                os.kill(agents[victim].proc.pid, signal.SIGKILL)   # its workers die with it
                agents[victim].proc.wait(10)
            else:
                root = psutil.Process(agents[victim].proc.pid)
                frozen = [root, *root.children(recursive=True)]
                for proc in frozen:
                    proc.send_signal(signal.SIGSTOP)
            assert survivor.wait(90) == 0, survivor.log.read_text()[-3000:]
        finally:
            for proc in frozen:
                with contextlib.suppress(psutil.Error):
                    proc.kill()

    node = 1 - victim_rank
    assert_single_process_results(out, [2 * node, 2 * node + 1], steps)
    events = read_events(survivor_state / "events.jsonl")
    recovered = [e for e in events if e["event"] == "recovered" and e["reason"] != "membership"]
    assert recovered and recovered[-1]["mode"] == "inplace"
    assert sorted(recovered[-1]["kept_devices"]) == [2 * node, 2 * node + 1]
    assert not [e for e in events if e.get("kind") == "quick_round_failed"]
    assert [e["quick"] for e in events if e["event"] == "rendezvous"][-1]
    assert [e["decided_here"] for e in events if e["event"] == "plan_chosen"][-1]
    if fault == "stop":   # only the lease can tell: nothing failed, nothing reset
        assert any(e["event"] == "failure_seen" and e["kind"] == "node_lost" for e in events)
        assert recovered[-1]["reason"] == "node_lost"
    assert "Traceback" not in survivor.log.read_text()


@contextlib.contextmanager
def _node_b_without_devices(tmp_path: Path, launch, steps: int,
                            script: tuple[str, ...] = ("--min-world", "4"), host: bool = False):
    """Two nodes of two devices on a fresh etcd (tiny-cpu, leases of 2 s); yields (agents by
    name, out, b's first device) once both of b's workers were killed, b says it has no
    device left, and a's train on under the plan without them. ``script``: more arguments
    of the worker script; ``host``: b is the node of group rank 0, the quick rounds' decider,
    whose agent hosts every round's worker store."""
    local_etcd = pytest.importorskip("chameleon_elastic.rendezvous.local_etcd")
    out = tmp_path / "out"
    out.mkdir()
    with local_etcd.LocalEtcd(data_dir=tmp_path / "etcd") as etcd:
        common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "etcd-v3",
                  "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "no-device-left",
                  "--rdzv-conf", "last_call_timeout=5,lease_ttl=2", "--local-addr", "127.0.0.1",
                  "--monitor-interval", "0.1", "--preset", "tiny-cpu", "--snapshot-every", "0"]
        agents = {name: launch("chameleon", [*common, "--state-dir", str(tmp_path / name),
                                             MLP_FAULTS, str(out), str(steps), "--pace", "0.2",
                                             *script], name=name)
                  for name in ("a", "b")}   # with the status line: b says when it has no device
        wait_for(lambda: (out / "steps.jsonl").exists()
                 and len((out / "steps.jsonl").read_text().splitlines()) >= 3, 60,
                 "both nodes training")
        if host and _group_rank(tmp_path / "b") != 0:
            agents = {"a": agents["b"], "b": agents["a"]}   # (their state dirs keep the names)
        b = 0 if host else 2 * _group_rank(tmp_path / "b")
        for device in (b, b + 1):
            os.kill(int((out / f"pid-{device}").read_text().split()[0]), signal.SIGKILL)
        wait_for(lambda: "no device left here" in agents["b"].log.read_text(), 60,
                 "node b to have no device left")
        # a's first step under the new plan: until then its devices may still be taking b's
        # layers from each other, and a kill there loses layers that exist nowhere else
        wait_for(lambda: "resumed at step" in agents["a"].log.read_text(), 60,
                 "node a to resume without b's devices")
        yield agents, out, b


@contextlib.contextmanager
def _frozen(pid: int) -> Iterator[None]:
    """A launcher and every process under it SIGSTOPped (a frozen node); SIGKILLed after."""
    root = psutil.Process(pid)
    frozen = [root, *root.children(recursive=True)]
    try:
        for proc in frozen:
            proc.send_signal(signal.SIGSTOP)
        yield
    finally:
        for proc in frozen:
            with contextlib.suppress(psutil.Error):
                proc.kill()


@pytest.mark.timeout(90)
def test_a_node_whose_devices_are_all_lost_ends_when_the_other_node_is_gone_too(tmp_path,
                                                                                 launch):
    """Both of node b's workers are killed; a's train on (b, with no device left, stays a
    member until the job ends). Then a freezes (its lease just stops). b used to wait out
    torch's 300 s end-of-run barrier for a, which will never come (chaos: "hung"). Now it ends
    once a's lease is gone, in one sentence, with "do not requeue": no device is left."""
    with _node_b_without_devices(tmp_path, launch, 200) as (agents, _, _), \
            _frozen(agents["a"].proc.pid):
        assert agents["b"].wait(45) == 93, agents["b"].log.read_text()[-3000:]
    log = agents["b"].log.read_text()
    assert "cannot continue after losing device(s)" in log
    assert "at least one must survive to continue" in log and "Traceback" not in log


@pytest.mark.timeout(90)
def test_the_end_waits_for_no_member_that_was_lost_with_no_device(tmp_path, launch):
    """Both of node b's workers are killed, then b freezes: its lease expires, which costs
    no device (b had none left). a trains to the end; it used to wait there for b, a member of
    the last round that never comes, for torch's 300 s end-of-run barrier (chaos part 5,
    trial 28: hung). Now a ends with the job: a member's loss starts a round without it, and
    the barrier also ends once fewer nodes hold a lease than the round had."""
    steps = 40
    with _node_b_without_devices(tmp_path, launch, steps) as (agents, out, b), \
            _frozen(agents["b"].proc.pid):
        assert agents["a"].wait(60) == 0, agents["a"].log.read_text()[-3000:]
    a = 2 - b
    assert_single_process_results(out, [a, a + 1], steps)
    assert "Traceback" not in agents["a"].log.read_text()


@pytest.mark.timeout(90)
def test_the_decider_losing_its_last_device_leaves_the_others_in_place(tmp_path, launch):
    """Both devices of node b, the quick rounds' decider, are killed. b, with no worker left,
    used to veto an in-place recovery, so a's workers were relaunched from a checkpoint, or
    from step 0 without one (chaos parts 8 and 9). Now a's workers keep their processes and
    state: every step once, single-process results, and both nodes end with the job."""
    steps = 30
    with _node_b_without_devices(tmp_path, launch, steps, (), host=True) as (agents, out, _):
        assert agents["a"].wait(60) == 0, agents["a"].log.read_text()[-3000:]
        assert agents["b"].wait(30) == 0, agents["b"].log.read_text()[-3000:]
    assert_single_process_results(out, [2, 3], steps)


@pytest.mark.timeout(90)
def test_a_member_with_no_device_that_hosts_the_worker_store_is_recovered_from(tmp_path,
                                                                                launch):
    """Both devices of node b, the quick rounds' decider, are lost; a's workers train on, on
    the worker store that b's agent hosts. Then b freezes. a's workers used to wait on that
    store for good, in the group of their next checkpoint (chaos part 8, trial 45: hung):
    b's loss cost no device, so it was no news. Now the loss of a member is news: a's agent
    opens the next generation on a store of its own, a's workers give the frozen one up (its
    socket is cut with the world's), and the job ends as it should."""
    steps = 40
    with _node_b_without_devices(tmp_path, launch, steps,
                                 ("--checkpoint-dir", str(tmp_path / "ckpt")), host=True) as (
            agents, out, _), _frozen(agents["b"].proc.pid):
        assert agents["a"].wait(60) == 0, agents["a"].log.read_text()[-3000:]
    log = agents["a"].log.read_text()
    assert "a node with no device left lost (its lease expired)" in log, log[-3000:]
    assert "Traceback" not in log
    # (a recovery that restores a checkpoint trains its last steps again, and says so)
    reported = [json.loads(x)["step"] for x in (out / "steps.jsonl").read_text().splitlines()]
    assert sorted(set(reported)) == list(range(steps)), reported


@pytest.mark.timeout(90)
def test_a_node_whose_devices_are_all_lost_still_answers_the_quick_rounds(tmp_path, launch):
    """Both of node b's workers are killed, then one of a's. b has no device left, but it is
    still a member: a's quick round waits for its report. b used to wait in the end-of-run
    barrier instead, so a's round failed after 15 s and its full round never completed (chaos:
    hung). Now a goes on with its last device in place, and both nodes end with the job."""
    steps = 40
    with _node_b_without_devices(tmp_path, launch, steps) as (agents, out, b):
        a = 2 - b
        os.kill(int((out / f"pid-{a}").read_text().split()[0]), signal.SIGKILL)
        assert agents["a"].wait(60) == 0, agents["a"].log.read_text()[-3000:]
        assert agents["b"].wait(30) == 0, agents["b"].log.read_text()[-3000:]
    assert_single_process_results(out, [a + 1], steps)
    events = read_events(tmp_path / "a" / "events.jsonl")
    assert not [e for e in events if e.get("kind") == "quick_round_failed"]
    assert [e["quick"] for e in events if e["event"] == "rendezvous"][-1]
    for name in ("a", "b"):
        assert "Traceback" not in agents[name].log.read_text()


@pytest.mark.timeout(90)
def test_a_node_waiting_for_the_others_says_what_it_waits_for(tmp_path, launch):
    """torch's first rendezvous blocks silently until --nnodes nodes are there; a node alone
    names the endpoint, the run id and how many nodes are missing, and goes on once they come."""
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "waiting-test",
              "--monitor-interval", "0.1"]
    first = launch("chameleon", [*common, PROBE, str(out), "ok"], name="first")
    wait_for(lambda: "waiting for 1 more node" in first.log.read_text(), 45,
             "the lone node's waiting line")
    line = next(x for x in first.log.read_text().splitlines() if "waiting for 1 more" in x)
    assert line.startswith(f"chameleon-run: waiting for 1 more node at 127.0.0.1:{port} (0:0")
    assert line.endswith("start the other node with the same --rdzv-id waiting-test and "
                         "--rdzv-endpoint")
    second = launch("chameleon", [*common, PROBE, str(out), "ok"], name="second")
    assert first.wait(60) == 0 and second.wait(60) == 0
    assert len(read_envs(out)) == 2


@pytest.mark.timeout(120)
def test_a_worker_lost_on_one_node_is_named_by_its_signal_on_both(tmp_path, launch):
    """Device 3 SIGKILLs itself on node 1: both agents' recovery lines say how it was lost
    (node 1 saw it; node 0 learns it from the decision), not "node gone" for a live node."""
    local_etcd = pytest.importorskip("chameleon_elastic.rendezvous.local_etcd")
    out = tmp_path / "out"
    out.mkdir()
    steps = 8
    with local_etcd.LocalEtcd(data_dir=tmp_path / "etcd") as etcd:
        common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "etcd-v3",
                  "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "worker-kill",
                  "--local-addr", "127.0.0.1", "--monitor-interval", "0.1", "--no-status",
                  "--preset", "tiny-cpu"]
        agents = [launch("chameleon", [*common, "--state-dir", str(tmp_path / name),
                                       MLP_FAULTS, str(out), str(steps), "3:4:forward:kill",
                                       "--min-world", "4"], name=name) for name in ("a", "b")]
        for agent in agents:
            assert agent.wait(100) == 0, agent.log.read_text()[-3000:]
    assert_single_process_results(out, [0, 1, 2], steps)
    for agent in agents:
        lines = [x for x in agent.log.read_text().splitlines() if "lost" in x]
        assert any("device 3 lost (SIGKILL) at step 4" in x for x in lines), lines
        assert not any("node gone" in x for x in lines), lines
