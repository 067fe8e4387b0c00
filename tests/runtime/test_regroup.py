"""A gloo world formed with lazy pairs (runtime/world/regroup.py): four real processes on a real
TCPStore. Forming it connects no pair; the pairs a rank names are open (and recorded for the
watchdog) when ``connect_peers`` returns, the others are not; and the recorded sockets still
unblock a survivor waiting on a peer frozen by SIGSTOP, as the full mesh's do."""

from __future__ import annotations

import json
import os
import signal
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

_RANK = textwrap.dedent("""
    import json, os, socket, sys, threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from chameleon_elastic.runtime.world import regroup
    from chameleon_elastic.runtime.world.abort import new_sockets, shut_down

    rank, port, world = int(sys.argv[1]), int(sys.argv[2]), 4
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    with regroup.lazy_pairs("gloo"), new_sockets() as formed:
        dist.init_process_group("gloo", store=dist.PrefixStore("gen/1/", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=30))
    # every rank's formation window closes before any pair connects (a pair a fast rank
    # opened while a slow one was still forming would land in the slow one's first count), and
    # its second window opens before then and closes once every rank connected its pairs: the
    # side that accepts a pair gets its socket whenever the other side connects
    with new_sockets() as connected:
        if store.add("formed", 1) == world:
            store.set("all formed", "1")
        store.wait(["all formed"])
        regroup.connect_peers(regroup.ring_peers(rank, world))
        if store.add("connected", 1) == world:
            store.set("all connected", "1")
        store.wait(["all connected"])

    def peers(sockets):   # connected TCP sockets (not listening), by their remote ports
        out = 0
        for fd, _ in sockets:
            s = socket.socket(fileno=fd)
            try:
                out += not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            finally:
                s.detach()
        return out

    print(json.dumps({"formed": peers(formed), "connected": peers(connected)}), flush=True)
    if rank == 0:   # wait on rank 1, which the test freezes; then cut the recorded sockets
        store.wait(["frozen"])
        threading.Timer(0.5, shut_down, args=(frozenset(connected),)).start()
        start = time.monotonic()
        try:
            dist.recv(torch.zeros(1), 1)
            print(json.dumps({"recv": "returned"}), flush=True)
        except RuntimeError as exc:
            print(json.dumps({"recv": "failed", "after_s": time.monotonic() - start}),
                  flush=True)
        os._exit(0)
    store.wait(["done"])
    os._exit(0)
""")


def test_lazy_pairs_connect_only_the_named_peers_and_stay_unblockable(ranks):
    server, start = ranks
    procs = start(_RANK, 4, drop_env=("TORCH_GLOO_LAZY_INIT",))
    try:
        said = [json.loads(p.stdout.readline() or "{}") for p in procs]
        assert all(s.get("formed") == 0 for s in said), said   # no pair at formation
        # the ring of four: two peers each (a full mesh would have opened three)
        assert [s["connected"] for s in said] == [2, 2, 2, 2], said
        os.kill(procs[1].pid, signal.SIGSTOP)   # frozen: its sockets stay open, silent
        server.set("frozen", "1")
        line = procs[0].stdout.readline()
        assert line, f"rank 0 said nothing: {procs[0].stderr.read()[-2000:]}"
        result = json.loads(line)
        assert result["recv"] == "failed" and result["after_s"] < 10, result
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        server.set("done", "1")
