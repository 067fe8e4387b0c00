"""Two agents on loopback with the c10d rendezvous: the agent hosting the store is SIGKILLed and
the other one carries on alone (it rebuilds the rendezvous on the same endpoint)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from .conftest import PROBE, free_port, pid_alive, port_open, read_envs, wait_for


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
