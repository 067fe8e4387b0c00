"""Shaped links between local hosts (rendezvous/local_hosts.py ``Link``): a host's bytes go
through its own link of the chosen rate, so a transfer between two hosts costs what it would
between machines. Needs root, ``ip netns`` and the kernel's HTB qdisc; skipped otherwise, with
the reason. (The delay needs ``netem``, which the development machine's kernel lacks: that
case skips there, and says so.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from chameleon_elastic.rendezvous.local_hosts import Link, LocalHosts, unavailable

pytestmark = pytest.mark.timeout(60)

_SINK = textwrap.dedent("""
    import socket, sys, time
    srv = socket.create_server((sys.argv[1], 0))
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    got, start = conn.recv(1 << 16), None
    start, total = time.monotonic(), len(got)
    while got:
        got = conn.recv(1 << 16)
        total += len(got)
    print(total, time.monotonic() - start, flush=True)
""")
_SOURCE = textwrap.dedent("""
    import socket, sys
    with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as s:
        s.sendall(b"x" * int(sys.argv[3]))
""")


def _transfer(hosts: LocalHosts, size: int) -> float:
    """Bytes per second from host 1 to host 0, as the receiver saw them arrive."""
    sink, source = hosts.hosts
    receiver = subprocess.Popen([*sink.wrap(), sys.executable, "-c", _SINK, sink.ip],
                                stdout=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()
        subprocess.run([*source.wrap(), sys.executable, "-c", _SOURCE, sink.ip, port,
                        str(size)], check=True, timeout=40)
        total, seconds = receiver.stdout.readline().split()
        assert int(total) == size
        return size / float(seconds)
    finally:
        receiver.kill()
        receiver.wait()


def test_a_shaped_link_holds_a_transfer_to_its_rate():
    why = unavailable(shaped=True)
    if why:
        pytest.skip(why)
    rate_mbit = 40.0
    with LocalHosts(2, link=Link(rate_mbit)) as hosts:
        measured = _transfer(hosts, 4_000_000)   # 0.8 s at the rate
    # at most the rate (a little over: the first bytes fill the queue before shaping bites);
    # loopback would be a hundred times faster
    assert measured * 8 / 1e6 < 1.25 * rate_mbit, measured


def test_a_delayed_link_delays():
    why = unavailable(delayed=True)
    if why:
        pytest.skip(why)
    with LocalHosts(2, link=Link(1000.0, delay_ms=20.0)) as hosts:
        a, b = hosts.hosts
        out = subprocess.run([*a.wrap(), "ping", "-c", "3", "-i", "0.2", b.ip],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    rtt_min = float(out.rsplit("=", 1)[1].split("/")[0])
    assert rtt_min >= 4 * 20.0 * 0.95, out   # each way crosses two links of 20 ms


@pytest.mark.timeout(120)   # 43 s at load 12 on 2 cores: three processes import torch
def test_the_transfer_ablation_runs_on_shaped_links(tmp_path):
    """benchmarks/shaped_transfer.py at its smallest (DP=2 x PP=2 losing device 0, 4 layers,
    one trial, small layers), so that it cannot rot: three survivors in their namespaces form the new world,
    move the layers of both assignments with the runtime's migration (each checks it received
    what the moves say) and the restorer's moves fewer layers than the naive one."""
    why = unavailable(shaped=True)
    if why:
        pytest.skip(why)
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "shaped_transfer.py"
    run = subprocess.run([sys.executable, str(script), "--layers", "4", "--trials", "1",
                          "--hidden", "64", "--rate-mbit", "100", "--dp", "2", "--lost", "0",
                          "--json"],
                         capture_output=True, text=True, timeout=110, cwd=tmp_path, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    (summary,) = json.loads(run.stdout)["summary"]
    assert summary["restorer_layers_moved"] < summary["naive_layers_moved"], summary
    assert summary["restorer_recovery_s"] > 0 and summary["naive_recovery_s"] > 0
