"""A standby node: a third node beyond a two-node job's size (the tiny-cpu-standby preset:
cluster.devices = 6 for training.dp x training.pp = 4) starts its workers warm and idle,
outside every process group, and is swapped in when a device of the layout is lost, so the
job keeps its layout.

Real processes: three chameleon-run agents x two gloo workers on loopback, a real etcd (lease
TTL 2 s), float64 training compared with a single process."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from chameleon_elastic.launcher.coordination.rounds import Rounds
from chameleon_elastic.launcher.observe import ended_state, running_state

from .conftest import MLP_FAULTS, assert_single_process_results, read_events, wait_for


@pytest.mark.parametrize("succeeded", [True, False])
def test_only_a_node_whose_workers_finished_tells_the_standbys_the_job_is_over(succeeded):
    """A node left without workers because every device was lost must not retire the
    standbys: they are the job's way on, and the rendezvous stays open for them. A node whose
    workers finished closes it: a node fenced meanwhile must not wait there for a round. The
    store and the rendezvous handler are real (in-process) torch ones."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    store = dist.HashStore()
    handler = create_handler(store, C10dRendezvousBackend(store, "job"),
                             RendezvousParameters("c10d", "localhost:0", "job", 1, 2))
    ended, asking = Rounds(None, None, None, lambda *a, **k: None), Rounds(
        None, None, None, lambda *a, **k: None)
    ended._last_info = asking._last_info = type("Info", (), {"store": store})()
    assert not asking.finished_elsewhere()
    ended.finish(succeeded, SimpleNamespace(rdzv_handler=handler))
    assert asking.finished_elsewhere() is succeeded
    assert handler.is_closed() is succeeded


def test_the_status_line_names_standbys_and_how_a_node_of_standbys_ended():
    """A node of standbys alone never prints a step: its status line says why, and at the end
    that the job finished without it rather than that its devices were lost."""
    assert running_state({4, 5}, set()) == "standby: devices 4, 5 wait warm for a lost " \
                                           "device's place"
    assert running_state({4, 5}, {4}) == "running, device 5 standby"
    assert running_state({0, 1}, {0, 1}) == "running"
    assert running_state({8, 9}, set(), tp=2) == ("standby: unit 4 (cards 8-9) waits warm for "
                                                  "a lost device's place")
    assert ended_state({4}, lambda: False) == "succeeded"
    assert ended_state(set(), lambda: True) == "succeeded on the other nodes (standby not needed)"
    assert ended_state(set(), lambda: False) == "no device left here"


def _node_of(state) -> int | None:
    first = [e for e in read_events(state / "events.jsonl") if e["event"] == "rendezvous"]
    return first[0]["node"] if first else None


def _steps(out) -> int:
    path = out / "steps.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _three_nodes(launch, tmp_path, endpoint: str, rdzv_id: str, out, steps: int,
                 *flags: str) -> dict:
    """Agents a, b and c of the tiny-cpu-standby job on etcd-v3: two train, one stands by."""
    common = ["--nnodes", "3", "--nproc-per-node", "2", "--rdzv-backend", "etcd-v3",
              "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
              "--rdzv-conf", "last_call_timeout=5,lease_ttl=2", "--local-addr", "127.0.0.1",
              "--monitor-interval", "0.1", "--no-status", *flags, "--preset", "tiny-cpu-standby"]
    return {name: launch("chameleon", [*common, "--state-dir", str(tmp_path / name), MLP_FAULTS,
                                       str(out), str(steps), "--pace", "0.2"], name=name)
            for name in ("a", "b", "c")}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", ["worker", "node"])
def test_a_standby_node_takes_the_place_of_a_lost_device(tmp_path, launch, fault):
    """SIGKILL of device 3's worker (``worker``), or of the whole node holding devices 2-3,
    agent included (``node``), after step 5: the planner swaps the standby's devices in
    (policy ``swap``: it outscores the reroute and at least ties the re-plan), the standby's warm
    processes take the lost stages from their replicas in place, no process is started, and
    the job finishes with single-process losses and layers. Until then the standby held no
    layers and never ran the script."""
    local_etcd = pytest.importorskip("chameleon_elastic.rendezvous.local_etcd")
    out = tmp_path / "out"
    out.mkdir()
    steps = 14
    names = ("a", "b", "c")
    with local_etcd.LocalEtcd(data_dir=tmp_path / "etcd") as etcd:
        agents = _three_nodes(launch, tmp_path, etcd.endpoint, f"standby-{fault}", out, steps)
        wait_for(lambda: _steps(out) >= 5, 90, "the job training on two of the three nodes")
        node = {name: _node_of(tmp_path / name) for name in names}
        standby = next(n for n in names if node[n] == 2)
        # warm and idle: its workers run (the standby wrapper), but never ran the script
        assert not (out / "pid-4").exists() and not (out / "pid-5").exists()
        started = [e for e in read_events(tmp_path / standby / "events.jsonl")
                   if e["event"] == "workers_started"]
        assert [sorted(e["devices"]) for e in started] == [[4, 5]]
        if fault == "worker":
            os.kill(int((out / "pid-3").read_text().split()[0]), signal.SIGKILL)
            lost = [3]
        else:
            victim = next(n for n in names if node[n] == 1)
            os.kill(agents[victim].proc.pid, signal.SIGKILL)   # its workers die with it
            agents[victim].proc.wait(10)
            lost = [2, 3]
        for name in names:
            if node[name] != 1 or fault == "worker":
                assert agents[name].wait(90) == 0, agents[name].log.read_text()[-3000:]

    survivors = {"worker": [0, 1, 2, 4], "node": [0, 1, 4, 5]}[fault]
    assert_single_process_results(out, survivors, steps)
    assert not (out / "pid-5").exists() or fault == "node"   # the other standby waited on
    events = read_events(tmp_path / standby / "events.jsonl")
    chosen = [e for e in events if e["event"] == "plan_chosen"]
    assert chosen[-1]["policy"] == "swap" and chosen[-1]["lost"] == lost
    assert set(chosen[-1]["candidates"]) == {"reroute", "swap", "replan"}
    scores = {k: v["score"] for k, v in chosen[-1]["candidates"].items()}
    assert scores["swap"] >= max(scores.values())
    plan = json.loads(Path(chosen[-1]["plan_file"]).read_text())
    assert [p["devices"] for p in plan["pipelines"]] == (
        [[0, 1], [2, 4]] if fault == "worker" else [[0, 1], [4, 5]])
    recovered = [e for e in events if e["event"] == "recovered"]
    assert recovered[-1]["mode"] == "inplace" and recovered[-1]["started_devices"] == []
    assert set(recovered[-1]["kept_devices"]) >= {4}
    # the standby took its layers from the survivors, not from a checkpoint
    assert (out / "started-4").read_text().split() == ["peers"]
    swapped = "devices 4, 5" if fault == "node" else "device 4"
    assert f"swapped in standby {swapped}, the layout kept" in agents[standby].log.read_text()


def _standby_process(agent_pid: int, device: int) -> int | None:
    """The pid of the standby process of ``device`` among an agent's children."""
    import psutil

    for child in psutil.Process(agent_pid).children(recursive=True):
        try:
            if child.environ().get("CHAMELEON_DEVICE") == str(device):
                return child.pid
        except psutil.Error:
            continue
    return None


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", ["worker", "node"])
def test_a_lost_standby_is_said_and_the_training_workers_never_hear_of_it(tmp_path, launch,
                                                                          fault):
    """SIGKILL of standby device 5's waiting process (``worker``), or of the standby node's
    agent with both its standbys (``node``), while two nodes train: a standby holds no layers
    and takes part in no collective, so the agents agree on the plan without it and tell no
    worker. The training workers stay in plan generation 0 (they never regroup: no pause), every
    node that lives exits 0, every step is reported once with single-process losses, and each
    node's line names the standby, never an empty list of devices. It used to read
    ``rerouted to data-parallel peers: device ;`` and cost the job a regroup."""
    local_etcd = pytest.importorskip("chameleon_elastic.rendezvous.local_etcd")
    out = tmp_path / "out"
    out.mkdir()
    steps, names = 14, ("a", "b", "c")
    with local_etcd.LocalEtcd(data_dir=tmp_path / "etcd") as etcd:
        agents = _three_nodes(launch, tmp_path, etcd.endpoint, f"quiet-{fault}", out, steps,
                              "--stragglers", "off")
        wait_for(lambda: _steps(out) >= 4, 90, "the job training on two of the three nodes")
        node = {name: _node_of(tmp_path / name) for name in names}
        standby = next(n for n in names if node[n] == 2)
        if fault == "worker":
            pid = wait_for(lambda: _standby_process(agents[standby].proc.pid, 5), 30,
                           "standby device 5's waiting process")
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(agents[standby].proc.pid, signal.SIGKILL)   # its standbys die with it
            agents[standby].proc.wait(10)
        lost = "standby device 5 lost (SIGKILL)" if fault == "worker" else \
            "standby devices 4, 5 lost (node gone)"
        living = [n for n in names if fault == "worker" or n != standby]
        for name in living:
            wait_for(lambda name=name: lost in agents[name].log.read_text(), 60,
                     f"node {name}'s line on the lost standby")
        for name in living:
            assert agents[name].wait(90) == 0, agents[name].log.read_text()[-3000:]

    assert_single_process_results(out, [0, 1, 2, 3], steps)
    reported = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert {r["generation"] for r in reported} == {0}   # never told, never regrouped
    for name in living:
        log = agents[name].log.read_text()
        assert "; device ;" not in log and "peers: device ;" not in log, log[-3000:]
        assert "training goes on undisturbed" in log
        recovered = [e for e in read_events(tmp_path / name / "events.jsonl")
                     if e["event"] == "recovered"]
        assert [e.get("quiet") for e in recovered] == [True], recovered
